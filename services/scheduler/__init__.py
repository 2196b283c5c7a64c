"""scheduler: job intake and placement, users and API keys, the REST API.

    service.py    submit / cancel, the job records (KV ot_jobs), placement and requeue,
                  the NATS auth callout
    placement.py  which queued jobs start now, on which workers (pure functions)
    (users and API keys, argon2id hashes in KV: services/core/users.py, shared with the tinker API)
    api.py        the REST API and web dashboard (static/)
"""
