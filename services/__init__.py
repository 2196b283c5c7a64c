"""OpenTinker services. Each subpackage is one OS process; they share only `core` and
talk only over NATS (no service imports another).

    scheduler/  job intake, placement on the worker pool, users and keys, REST API
    learner/    the per-job training loop (GRPO, SFT) on DeepSpeed
    rollout/    generation engines (vLLM, transformers) and the agent loop
    envhost/    serves environments (AbstractGame) over request/reply
    recorder/   the trajectory log: bus -> Parquet
    core/       what they share: bus, settings, runner, models, auth, the log's views
"""
