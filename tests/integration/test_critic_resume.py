"""PPO with a critic through the services: a learner killed past a checkpoint resumes the
job with its critic. A resume loads the critic's state from the checkpoint or fails the
job (critic.ActorCritic.load_state), so a job that completes after the kill, with
"resumed from step" in the log and the value metrics on every step, had its critic
saved in the checkpoint and restored from it."""

import asyncio
import signal

import pytest

from opentinker.schemas import JobState
from opentinker.sdk import Client

from conftest import submit_when_ready
from test_resume import train_steps, until_step

STEPS, EVERY = 6, 2


@pytest.mark.timeout(600)
async def test_a_job_with_a_critic_resumes_with_it(services, nats_url, bus, tiny_model, job_id):
    for name in ("scheduler", "envhost", "rollout"):
        services.start(name, *(["engine=hf"] if name == "rollout" else []))
    worker = f"l1-{job_id}"
    learner = services.start("learner", f"worker_id={worker}")
    client = await Client.connect(nats_url)
    try:
        spec = {"name": "ppo-resume", "model": tiny_model, "env": "arith", "engine": "hf", "lora_rank": 4,
                "advantage_estimator": "gae", "group_size": 1, "prompts_per_step": 4, "critic_lr": 1e-3,
                "steps": STEPS, "lr": 1e-3, "checkpoint_every": EVERY, "micro_batch_size": 4,
                "sampling": {"max_new_tokens": 8, "max_total_tokens": 256}}
        job = await submit_when_ready(client, spec, job_id)
        await until_step(bus, job_id, EVERY + 1, services)  # a checkpoint every 2 steps: one is behind it
        learner.send_signal(signal.SIGKILL)
        await asyncio.to_thread(learner.wait, 10)
        services.start("learner", f"worker_id={worker}")
        rec = await job.wait(timeout_s=400)
        assert rec.state == JobState.COMPLETED, (rec, services.logs())
        assert f"job {job_id} resumed from step" in services.logs(tail=None), services.logs()
        final = {m.step: m for m in await train_steps(bus, job_id)}
        assert sorted(final) == list(range(STEPS))
        for s, m in final.items():  # the critic trained every step (the tiny model's rewards are mostly 0)
            assert {"value_loss", "value_error", "critic_grad_norm"} <= set(m.values), (s, m.values)
    finally:
        await client.close()
