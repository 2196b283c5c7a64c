"""A job trained data parallel on 2 learner ranks through the services: the scheduler
places it on a learner offering 2 ranks (never on one offering fewer), the learner
service starts them with torchrun and stays the job's one voice on the bus, every step
reports 2 ranks. The learner service SIGKILLed mid-job takes its ranks along (no rank
outlives it), and its restart resumes the job from the checkpoint on 2 fresh ranks."""

import asyncio
import os
import signal
import time
import re
from pathlib import Path

import pytest

from opentinker.schemas import JobState
from opentinker.sdk import Client

from conftest import follow, submit_when_ready, until

# Steps of the tiny model take ~0.3 s: enough of them that the SIGKILL, sent once the
# job record shows a step past the first checkpoint, lands before the job ends.
STEPS, EVERY = 24, 3


def descendants(pid: int) -> set[int]:
    """The live processes under `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.timeout(900)
async def test_a_job_trains_on_two_learner_ranks_and_resumes_on_fresh_ones(services, nats_url, bus, tiny_model,
                                                                           job_id, home):
    services.start("scheduler")
    services.start("envhost")
    services.start("rollout", "engine=hf")
    one = f"l1-{job_id}"
    two = f"l2-{job_id}"
    services.start("learner", f"worker_id={one}", "learner_max_ranks=1")
    learner = services.start("learner", f"worker_id={two}", "learner_max_ranks=2")
    spec = {"name": "ranks", "model": tiny_model, "env": "arith", "engine": "hf", "lora_rank": 4,
            "prompts_per_step": 4, "group_size": 2, "steps": STEPS, "lr": 1e-3, "checkpoint_every": EVERY,
            "micro_batch_size": 2, "learner_ranks": 2, "zero_stage": 2,
            # an entropy bonus: every step has a gradient, whatever the tiny model's rewards
            "entropy_coef": 0.01,
            "sampling": {"max_new_tokens": 8, "max_total_tokens": 256}}
    client = await Client.connect(nats_url)
    try:
        job = await submit_when_ready(client, spec, job_id)
        metrics = asyncio.create_task(follow(job, 800, services))

        async def past_checkpoint():
            rec = await job.record()
            return rec if rec.step >= EVERY + 1 and rec.placement is not None else None

        rec = await until(past_checkpoint, 400, services, f"step {EVERY + 1}")
        assert rec.placement.learner == two, rec  # the learner offering 1 rank cannot hold it
        assert rec.state == JobState.RUNNING and rec.step < STEPS - EVERY, rec  # the kill lands mid-job
        ranks = descendants(learner.pid)
        assert len(ranks) >= 2, ranks  # its 2 ranks
        assert services.open_listeners() == []  # the ranks listen on loopback alone
        learner.send_signal(signal.SIGKILL)
        await asyncio.to_thread(learner.wait, 10)
        deadline = time.monotonic() + 60
        while any(alive(p) for p in ranks) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        assert not [p for p in ranks if alive(p)], "ranks outlived their learner service"
        services.start("learner", f"worker_id={two}", "learner_max_ranks=2")

        got = await metrics
        rec = await job.wait(timeout_s=60)
        assert rec.state == JobState.COMPLETED, rec.history
        assert rec.placement.learner == two
        logs = services.logs()
        resumed = [int(k) for k in re.findall(rf"job {job_id} resumed from step (\d+)", services.logs(tail=None))]
        # one resume, from a checkpoint (written after steps EVERY-1, 2*EVERY-1, ...)
        assert len(resumed) == 1 and (resumed[0] + 1) % EVERY == 0 and resumed[0] < STEPS - 1, (resumed, logs)
        train = [m for m in got if m.split == "train"]
        assert {m.step for m in train} == set(range(STEPS))
        assert all(m.values["learner_ranks"] == 2 for m in train), [m.values["learner_ranks"] for m in train]
        assert all(m.values["grad_norm"] > 0 and m.values["updates"] >= 1 for m in train), \
            [m.values["grad_norm"] for m in train]
        assert (Path(home) / "checkpoints" / job_id / "final" / "adapter_model.safetensors").is_file()
        assert os.path.isdir(Path(home) / "checkpoints" / job_id)
    finally:
        await client.close()
