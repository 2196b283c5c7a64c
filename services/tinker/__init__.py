"""tinker: Thinking Machines' Tinker API, served by the stack, so code written against
the official `tinker` SDK trains on OpenTinker unchanged (TINKER_BASE_URL, TINKER_API_KEY).

    service.py   the process: the HTTP server, the idle-session reaper
    api.py       the /api/v1 routes the SDK calls
    sessions.py  sessions, models (tinker jobs on a learner), operations, futures
    runs.py      the REST client's listing: training runs (the models) and their checkpoints
    wire.py      the SDK's protobuf and JSON shapes, and its names and paths
"""
