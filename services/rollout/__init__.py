"""The rollout service: generation engines and the agent loop.

    service.py     the worker: admission of requests (the job record places the job
                   here), batches, engine slots, heartbeat, trajectories out
    policy.py      PolicyTracker: weight events -> the policy each job samples with
                   (one table, fed by an ordered consumer; waiters are woken by it)
    env_client.py  request/reply to envhost (init, reset, step, close)
    agent_loop.py  groups of episodes as token-exact trajectories (multi-turn, tools)
    engine_vllm.py engine_hf.py   vLLM (multi-LoRA) and transformers engines
    weights.py     adapter and full-weight tensors: decode, check, merge, apply
    openai_api.py  an inference job's OpenAI-compatible endpoint
"""
