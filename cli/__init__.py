"""`opentinker`, the command line: one small module per group of commands.

    main.py    the parser; `main()` is the console script
    common.py  what commands share: home, NATS URL, job specs from TOML (--set), console
    train.py   train CONFIG.toml [--up] [--set K=V]: submit a job and follow it
    infer.py   infer: a base model, an adapter or a job's policy on an environment
    jobs.py    jobs, cancel, endpoint, watch, wandb: a user's jobs through the SDK
    log.py     query, export, plot, episodes: the trajectory log (DuckDB over Parquet)
    tail.py    tail SUBJECT: bus messages decoded by their schema header
    views.py   the live job view (watch), episode printouts and charts (plot)
    ops.py     up, serve, envhost, serve-model, data, models, nats-keys: the operator's
               commands (opentinker.ops; the `server` extra)
"""
