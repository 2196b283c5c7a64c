"""The worker pool with real processes: placement queues what does not fit, a worker
killed with SIGKILL has its job requeued and finished from its checkpoint, and a
scheduler killed and restarted mid-job loses nothing."""

import asyncio
import signal

import pytest

from opentinker.schemas import JobState
from opentinker.sdk import Client

from conftest import follow, submit_when_ready, until


def spec(model: str, steps: int, **kw) -> dict:
    return {"name": "pool", "model": model, "env": "arith", "engine": "hf", "lora_rank": 4,
            "prompts_per_step": 2, "group_size": 2, "steps": steps, "lr": 1e-3, "checkpoint_every": 1,
            "micro_batch_size": 4, "sampling": {"max_new_tokens": 8, "max_total_tokens": 256}, **kw}


def placed_s(rec) -> float:
    """When the record's current placement was made."""
    return rec.placement.placed_s


@pytest.mark.timeout(600)
async def test_two_jobs_on_a_pool_that_fits_one_queue_and_both_finish(services, nats_url, tiny_model, job_id):
    for name in ("scheduler", "envhost", "learner"):
        services.start(name)
    services.start("rollout", "engine=hf")
    client = await Client.connect(nats_url)
    try:
        first = await submit_when_ready(client, spec(tiny_model, 2), f"{job_id}-a")
        second = await client.submit(spec(tiny_model, 2), job_id=f"{job_id}-b")
        await until(lambda: _placed(first), 60, services, "the first job placed")
        rec_b = await second.record()
        assert rec_b.state == JobState.QUEUED and rec_b.placement is None  # one learner: it waits
        await follow(first, 300, services)
        a = await first.wait(timeout_s=30)
        await follow(second, 300, services)
        b = await second.wait(timeout_s=30)
        # the second started on the learner the first freed, after the first completed
        assert b.placement.learner == a.placement.learner
        done_a = max(float(h.split()[0]) for h in a.history if " completed" in h)
        assert placed_s(b) >= done_a - 0.01, (a.history, b.history)
    finally:
        await client.close()


async def _placed(job):
    rec = await job.record()
    return rec if rec.placement is not None and rec.state == JobState.RUNNING else None


@pytest.mark.timeout(900)
async def test_killed_learner_and_scheduler_lose_nothing(services, nats_url, tiny_model, job_id):
    sched = services.start("scheduler")
    services.start("envhost")
    services.start("rollout", "engine=hf")
    learners = {w: services.start("learner", f"worker_id={w}") for w in (f"l1-{job_id}", f"l2-{job_id}")}
    client = await Client.connect(nats_url)
    try:
        main = await submit_when_ready(client, spec(tiny_model, 6), f"{job_id}-m")
        other = await client.submit(spec(tiny_model, 3), job_id=f"{job_id}-o")
        steps: list[int] = []
        metrics = asyncio.create_task(_collect(main, steps))
        await until(lambda: asyncio.sleep(0, len(steps) >= 2), 300, services, "two steps of the job")

        # the scheduler dies mid-job and comes back: records, placements and the job go on
        sched.send_signal(signal.SIGKILL)
        await asyncio.to_thread(sched.wait, 10)
        before = await main.record()
        services.start("scheduler")
        after = await main.record()
        assert after.placement == before.placement and after.attempt == 1

        # the main job's learner dies: its job is requeued and resumed from its checkpoint
        # on the other learner once that one is free (it runs the other job meanwhile)
        victim = (await main.record()).placement.learner
        learners[victim].send_signal(signal.SIGKILL)
        await asyncio.to_thread(learners[victim].wait, 10)
        note = await until(lambda: _requeued(main), 60, services, "the job requeued")
        assert victim in note
        await asyncio.wait_for(metrics, 600)
        rec = await main.wait(timeout_s=60)
        assert rec.attempt == 2 and rec.placement.learner != victim
        assert f"job {main.id} resumed from step" in services.logs(tail=None)
        # every step trained once per attempt, each step reported, none lost
        assert sorted(set(steps)) == list(range(6)), steps
        assert (await other.wait(timeout_s=300)).state == JobState.COMPLETED
    finally:
        await client.close()


async def _collect(job, into: list[int]) -> None:
    async for m in job.metrics():
        if m.split == "train":
            into.append(m.step)


async def _requeued(job):
    rec = await job.record()
    return next((h for h in rec.history if "left the pool" in h), None)
