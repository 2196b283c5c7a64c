"""Many rollout workers on one job: requests spread across them, every trajectory names
its worker, and a worker SIGKILLed with requests outstanding loses the job nothing. The
scheduler keeps the job's attempt on the surviving worker (no requeue, the learner never
stops) and the learner asks the lost worker's groups again there."""

import asyncio
import signal
from collections import Counter

import pytest
from nats.js.api import DeliverPolicy

from opentinker.schemas import JobState, Trajectory, decode
from opentinker.schemas import subjects as S
from opentinker.sdk import Client

from conftest import follow, submit_when_ready, until

# long enough that the job is still running when the test freezes a worker: steps whose
# rewards are all equal train nothing and take well under a second here
STEPS = 30


async def outstanding(bus, worker: str) -> int:
    """Rollout requests addressed to `worker` and not acked: waiting or being served."""
    d = S.rollout_durable(worker)
    try:
        info = await bus.js.consumer_info(d.stream, d.name)
    except Exception:
        return 0
    return info.num_pending + info.num_ack_pending


@pytest.mark.timeout(900)
async def test_a_killed_rollout_worker_loses_the_job_nothing_and_requeues_nothing(
        services, nats_url, bus, tiny_model, job_id):
    services.start("scheduler")
    services.start("envhost")
    learner = services.start("learner")
    names = [f"r1-{job_id}", f"r2-{job_id}"]
    workers = {w: services.start("rollout", "engine=hf", f"worker_id={w}") for w in names}
    spec = {"name": "failover", "model": tiny_model, "env": "arith", "engine": "hf", "lora_rank": 4,
            "prompts_per_step": 4, "group_size": 2, "steps": STEPS, "lr": 1e-3, "checkpoint_every": 10,
            "micro_batch_size": 4, "rollout_workers": 2, "max_staleness": 1,
            "sampling": {"max_new_tokens": 8, "max_total_tokens": 256}}
    client = await Client.connect(nats_url)
    try:
        job = await submit_when_ready(client, spec, job_id)
        metrics = asyncio.create_task(follow(job, 800, services))
        placed = await until(lambda: _running(job), 120, services, "the job running")
        assert sorted(placed.placement.rollout) == sorted(names)
        await until(lambda: _trained(job, 1), 300, services, "the first step trained")
        # freeze one worker until requests of the job wait on it, then SIGKILL it: it
        # dies with work outstanding (a live worker could otherwise finish it first)
        victim = placed.placement.rollout[0]
        workers[victim].send_signal(signal.SIGSTOP)
        await until(lambda: outstanding(bus, victim), 120, services, f"requests waiting on {victim}")
        workers[victim].send_signal(signal.SIGKILL)
        await asyncio.to_thread(workers[victim].wait, 10)

        got = await metrics
        rec = await job.wait(timeout_s=60)
        assert rec.state == JobState.COMPLETED, rec.history
        # no requeue: the first attempt, the same learner, the survivor alone at the end
        assert rec.attempt == 1 and rec.placement.rollout == [w for w in names if w != victim], rec.history
        assert any(f"rollout worker {victim} left the pool" in h for h in rec.history), rec.history
        assert not any(" queued: " in h and "left the pool" in h for h in rec.history), rec.history
        assert learner.poll() is None and "resumed from step" not in services.logs(tail=None)
        train = [m for m in got if m.split == "train"]
        assert sorted(m.step for m in train) == list(range(STEPS))  # each step trained once
        assert sum(m.values["failed_over"] for m in train) >= 1, [m.values for m in train]

        # every trajectory names its worker; both served the job, and every trained
        # group's episodes came whole from one worker
        by_worker: Counter = Counter()
        by_group: dict[str, set[str]] = {}
        sub = await bus.durable(S.Durable(S.STREAM_TRAJ, f"audit-{job_id}", S.job(job_id, "traj")),
                                deliver_policy=DeliverPolicy.ALL)
        while msgs := await bus.fetch(sub, 256, 1.0):
            for m in msgs:
                t = decode(m.data, Trajectory)
                by_worker[t.worker] += 1
                by_group.setdefault(t.request_id, set()).add(t.worker)
                await m.ack()
        assert set(by_worker) == set(names), by_worker
        trained = {g for m in train for g in m.groups}
        assert trained and all(len(by_group[g]) == 1 for g in trained), by_group
    finally:
        await client.close()


async def _running(job):
    rec = await job.record()
    return rec if rec.placement is not None and rec.state == JobState.RUNNING else None


async def _trained(job, steps: int):
    rec = await job.record()
    return rec.step >= steps
