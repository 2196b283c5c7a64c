"""What every service shares; no service logic lives here.

    bus.py          the NATS client: JetStream topology, publish with trace context,
                    durable consumers (`Bus.durable`), KV, object store, dead letters,
                    retries across an outage
    config.py       typed settings (defaults, TOML, OPENTINKER_* env, KEY=VALUE); where
                    and as whom to connect (default NATS URL, service credentials)
    runner.py       the shared `main` of a service: settings, signals, bus, run
    tracing.py      OpenTelemetry spans carried in message headers
    models.py       model resolution (a Hugging Face id, a path, the embedded default)
    nats_server.py  a local nats-server (JetStream, loopback, authenticated)
    natsauth.py     tenant isolation on the bus: accounts, auth callout, JWTs, xkeys
    access.py       what a tenant's spec may name: files, models, log rows
    pool.py         a worker's identity and heartbeat in the pool
    logdb.py        the trajectory log's schema, DuckDB views, a tenant's sandboxed query
    queries.py      example queries over those views
    http.py         an HTTP app (FastAPI) inside a service's event loop
"""
