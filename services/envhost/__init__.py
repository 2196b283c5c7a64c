"""envhost: serves environments (opentinker.environment.base_game.AbstractGame) over NATS
request/reply.

    service.py  init / reset / step / close, one instance per episode, keyed by job
    loader.py   the environment classes from `--env module:Class` or a file
    registry.py the built-in environments by name (envs/)
    sandbox.py  runs model-written code under bubblewrap (code_math)
    envs/       arith, gsm8k, code_math, bandit, guess_number, gomoku
"""
