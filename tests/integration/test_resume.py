"""A learner killed between checkpoints costs the steps since the checkpoint, never the
job: once restarted in place (its assignment is redelivered to it), once for good (the
job is requeued to another learner). The job runs the main example's checkpoint period
(`checkpoint_every = 10`); each kill lands a step or more past a checkpoint.

Before runs had their own lineage, the resumed run (back at the checkpoint's policy
version) found the rollout worker holding the lost run's newer policy: every group came
back "stale" (84 drops in the run that found it) until the job FAILED.
"""

import asyncio
import signal
import time

import pytest

from opentinker.schemas import JobState, Metrics
from opentinker.schemas import subjects as S
from opentinker.sdk import Client
from opentinker.services.core.bus import Bus

from conftest import submit_when_ready

STEPS, EVERY = 26, 10


async def train_steps(bus: Bus, job_id: str) -> list[Metrics]:
    """Every train Metrics message the stream holds for the job, in publish order."""
    return [m for m in await bus.read_subject(S.job(job_id, "metrics"), Metrics) if m.split == "train"]


async def until_step(bus: Bus, job_id: str, step: int, services, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(m.step >= step for m in await train_steps(bus, job_id)):
        assert time.monotonic() < deadline, f"step {step} not reached\n{services.logs()}"
        await asyncio.sleep(0.3)


@pytest.mark.timeout(900)
async def test_a_learner_killed_between_checkpoints_loses_only_those_steps(services, nats_url, bus, tiny_model,
                                                                         job_id):
    for name in ("scheduler", "envhost", "rollout"):
        services.start(name, *(["engine=hf"] if name == "rollout" else []))
    learners = {w: services.start("learner", f"worker_id={w}") for w in (f"l1-{job_id}", f"l2-{job_id}")}
    client = await Client.connect(nats_url)
    try:
        spec = {"name": "resume", "model": tiny_model, "env": "arith", "engine": "hf", "lora_rank": 4,
                "prompts_per_step": 2, "group_size": 2, "steps": STEPS, "lr": 1e-3, "checkpoint_every": EVERY,
                "micro_batch_size": 4, "sampling": {"max_new_tokens": 8, "max_total_tokens": 256}}
        job = await submit_when_ready(client, spec, job_id)

        # 1. killed two steps past the checkpoint at step 9 and restarted at once, as a
        # supervisor would (its assignment comes back to it, unless its heartbeat lapsed
        # first and the job was requeued: either way the job resumes)
        await until_step(bus, job_id, EVERY + 1, services)
        first = (await job.record()).placement.learner
        learners[first].send_signal(signal.SIGKILL)
        await asyncio.to_thread(learners[first].wait, 10)
        learners[first] = services.start("learner", f"worker_id={first}")
        # 2. killed two steps past the checkpoint at step 19, and not restarted: the job
        # is requeued to the other learner
        await until_step(bus, job_id, 2 * EVERY + 1, services, timeout_s=400)
        second = await job.record()
        learners[second.placement.learner].send_signal(signal.SIGKILL)
        await asyncio.to_thread(learners[second.placement.learner].wait, 10)

        rec = await job.wait(timeout_s=600)
        assert rec.state == JobState.COMPLETED
        assert rec.attempt > second.attempt and rec.placement.learner != second.placement.learner, rec
        logs = services.logs(tail=None)
        assert f"job {job_id} resumed from step {EVERY - 1}" in logs, services.logs()
        assert f"job {job_id} resumed from step {2 * EVERY - 1}" in logs, services.logs()

        reports = await train_steps(bus, job_id)
        per_step = {s: sum(m.step == s for m in reports) for s in range(STEPS)}
        # the steps after a checkpoint were trained (and reported) by the lost run and
        # again by the resumed one: at most once more each, all others once. Redone are
        # the steps from each checkpoint on, up to the kill (how far past the checkpoint
        # it lands depends on this machine's speed; the resumes above bound it)
        redone = {s for s, n in per_step.items() if n > 1}
        assert all(1 <= n <= 2 for n in per_step.values()), per_step
        for start in (EVERY, 2 * EVERY):
            run = sorted(s for s in redone if start <= s < start + EVERY)
            assert run and run == list(range(start, start + len(run))), per_step
        assert redone <= set(range(EVERY, 2 * EVERY)) | set(range(2 * EVERY, STEPS)), per_step
        # the final report of each step: a continuous curve, one policy version per step,
        # no group dropped as stale or failed by the resumed runs
        final = {m.step: m for m in reports}
        assert [final[s].policy_version for s in range(STEPS)] == list(range(1, STEPS + 1))
        assert sum(m.values["dropped_stale"] for m in final.values()) == 0, \
            {s: m.values["dropped_stale"] for s, m in final.items()}
        print(f"\nresume: attempts {rec.attempt}, learners {first} -> {second.placement.learner} -> "
              f"{rec.placement.learner}; steps redone {sorted(redone)}; reward per step "
              f"{[round(final[s].values['reward_mean'], 3) for s in range(STEPS)]}")
    finally:
        await client.close()
