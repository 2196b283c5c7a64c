"""Learner: owns a job's training state (a DeepSpeed engine) and drives its loop.

One job at a time per process; run more processes for more jobs. A GRPO job is a
`JobRun` (job.py): ask for rollouts (at most max_staleness + 1 steps in flight), wait
for every group of a step, train one optimizer step (loss.py, episode- or turn-level
credit), publish the new weights and the step's metrics, evaluate every `eval_every`
steps (evaluation.py), checkpoint every `checkpoint_every` steps, repeat. An SFT job is
an `SFTRun` (sft.py): the same weights, metrics and checkpoints, from a dataset or a
DuckDB-filtered slice of the trajectory log.

Joins the pool: a heartbeat in KV `ot_workers` (kind "learner", one slot, the job it
runs, the most data-parallel ranks it starts for one job: `learner_max_ranks`), so the
scheduler places jobs here and requeues them if this process dies.

Reads
- `ot.ctl.assign.learner.<worker_id>` (OT_CTL work queue, durable "learner-<worker_id>"):
  JobAssigned, placed here by the scheduler. Acked when the job ends (completed,
  failed, cancelled, or requeued elsewhere); an assignment from a past placement
  attempt is acked and skipped; one whose job record does not place it on this
  learner (no record, another learner) is dead-lettered. A job placed again after this
  learner died resumes from its checkpoint on the next learner. A NATS failure that
  outlasts the bus's retries (bus.py) ends this process with the job handed back
  (not failed): the job resumes from its checkpoint after a restart or a requeue.
- `ot.job.<id>.traj` (OT_TRAJ, durable "learner-<id>"): Trajectory.
- `ot.job.<id>.events` (core subscription): a terminal state from the scheduler
  (cancel) stops the job.
- KV `ot_jobs`: a job already terminal there, or placed again since, is not started.
Writes
- `ot.job.<id>.rollout`: RolloutRequest, one per group (eval requests: `<id>-eval-v<n>-e<i>`).
- `ot.job.<id>.weights`: WeightsPublished; bytes in object store `ot_weights/<id>/v<n>`.
- `ot.job.<id>.metrics`: Metrics, one per step (split "train"), one per evaluation (split "eval").
- `ot.job.<id>.events`: JobStateChanged (running after every step, completed, failed).
- object store `ot_checkpoints/<id>/latest` (checkpoint.py); `<home>/checkpoints/<id>/final`
  (the adapter or model in Hugging Face format, at the end).
- `ot.dlq.learner`: undecodable or invalid assignments and trajectories.

Run: `python -m opentinker.services.learner [KEY=VALUE ...]` (`opentinker serve learner`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import nats.errors
from nats.aio.msg import Msg

from opentinker.schemas import JobAssigned, JobState, JobStateChanged, SpecError, validate_job_spec
from opentinker.schemas import subjects as S
from opentinker.services.core.bus import TRANSIENT, Bus
from opentinker.services.core.config import Settings
from opentinker.services.core.pool import Heartbeat, default_worker_id, machine_capacity
from opentinker.services.core.runner import run_service
from opentinker.services.learner.job import SERVICE, JobRun, JobStopped
from opentinker.services.learner.engine_deepspeed import pick_device

log = logging.getLogger("opentinker.learner")

# a learner that dies holding a job has its assignment redelivered this long after its
# last "in progress" (every HEARTBEAT_S): a restarted learner resumes the job that soon
ASSIGN_ACK_WAIT_S = 30.0
HEARTBEAT_S = 5.0


# -- the service loop -------------------------------------------------------------

async def heartbeat(m: Msg) -> None:
    """Tell JetStream the assignment is still being worked on."""
    while True:
        await asyncio.sleep(HEARTBEAT_S)
        with contextlib.suppress(Exception):
            await m.in_progress()


async def placed_here(bus: Bus, assigned: JobAssigned, worker: str) -> str:
    """'' if the job's record places this attempt of it on learner `worker`, else why
    not. An assignment only the scheduler could have meant is one its record confirms."""
    try:
        got = await bus.job_record(assigned.job_id)
    except msgspec.MsgspecError as e:
        return f"unreadable JobRecord ({e})"
    if got is None:
        return f"no job {assigned.job_id!r} in the scheduler's records"
    p = got[0].placement
    if p is None or p.learner != worker or p.attempt != assigned.attempt:
        return f"the job's record does not place attempt {assigned.attempt} on learner {worker}"
    return ""


async def handle_assignment(settings: Settings, bus: Bus, stop: asyncio.Event,
                            executor: ThreadPoolExecutor, m: Msg, running: list[str], worker: str) -> None:
    """Run one JobAssigned to a terminal state (ack) or until shutdown (nak: another
    learner resumes it)."""
    assigned = await bus.decode_or_dead_letter(m, JobAssigned)
    if assigned is None:
        return
    try:
        S.check_job_id(assigned.job_id)
    except ValueError as e:
        await bus.dead_letter(m, f"JobAssigned.job_id: {e}")
        await m.term()
        return
    job_id = assigned.job_id
    try:
        validate_job_spec(assigned.spec)
    except SpecError as e:
        await bus.dead_letter(m, f"JobAssigned.spec: {e}")
        await bus.publish(S.job(job_id, "events"), JobStateChanged(
            job_id=job_id, state=JobState.FAILED, reason=str(e), time_s=time.time(), source=SERVICE))
        await m.term()
        return
    run_cls = JobRun
    if assigned.spec.algorithm == "sft":
        from opentinker.services.learner.sft import SFTRun

        run_cls = SFTRun
    elif assigned.spec.algorithm == "tinker":
        from opentinker.services.learner.tinker_run import TinkerRun

        run_cls = TinkerRun
    elif not assigned.rollout_workers:
        await bus.dead_letter(m, "JobAssigned.rollout_workers: a GRPO job needs at least one rollout worker")
        await m.term()
        return
    job = run_cls(settings, bus, stop, executor, assigned, incarnation=m.metadata.num_delivered or 1)
    why = await job.not_runnable()
    if why:
        log.info("job %s: %s; not starting it", job_id, why)
        await m.ack()
        return
    why = await placed_here(bus, assigned, worker)
    if why:
        await bus.dead_letter(m, f"JobAssigned refused: {why}")
        await m.term()
        return
    running.append(job_id)
    log.info("job %s assigned (attempt %d, delivery %d, rollout on %s)", job_id, assigned.attempt,
             job.incarnation, ", ".join(assigned.rollout_workers) or "-")
    beat = asyncio.create_task(heartbeat(m))
    outcome = "completed"
    try:
        await job.run()
    except JobStopped as e:
        outcome = str(e)
    except (*TRANSIENT, nats.errors.ConnectionClosedError) as e:
        # the bus is gone past its retries: no state to report, nothing to fail the job
        # for; hand it back and exit (restarted, or requeued by the scheduler)
        log.error("job %s: NATS failed (%r); handing the job back", job_id, e)
        with contextlib.suppress(nats.errors.Error):
            await m.nak()
        raise
    except Exception as e:
        log.exception("job %s failed", job_id)
        outcome = "failed"
        await job.announce(JobState.FAILED, reason=f"{type(e).__name__}: {e}"[:2000])
    finally:
        beat.cancel()
        await job.close()
        running.remove(job_id)
    if outcome == "requeued":
        await m.ack()  # the scheduler has placed (or will place) it elsewhere
        log.info("job %s: requeued by the scheduler; let go", job_id)
        return
    if outcome == "shutdown":
        await m.nak()  # redelivered now: another learner resumes from the checkpoint
        log.info("job %s: handed back at shutdown", job_id)
        return
    await job.cleanup_bus()
    await m.ack()
    log.info("job %s: %s", job_id, outcome)


async def body(settings: Settings, bus: Bus, stop: asyncio.Event) -> None:
    worker = settings.worker_id or default_worker_id("learner")
    S.check_worker_id(worker)
    sub = await bus.durable(S.assignments_durable(worker), ack_wait_s=ASSIGN_ACK_WAIT_S, recreate=True)
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="learner-engine")
    running: list[str] = []
    capacity = machine_capacity(1, ["deepspeed"])
    ranks = settings.learner_max_ranks or (capacity.gpus if pick_device(settings.device) == "cuda"
                                            else capacity.cpu_cores)
    capacity = msgspec.structs.replace(capacity, ranks=max(1, ranks))
    beat = Heartbeat(bus, "learner", worker, settings.pool, capacity, jobs=lambda: list(running))
    await beat.start()
    log.info("learner %s of pool %s ready on %s", worker, settings.pool, settings.nats_url)
    try:
        while not stop.is_set():
            for m in await bus.fetch(sub, 1, 1.0):
                await handle_assignment(settings, bus, stop, executor, m, running, worker)
    finally:
        await beat.stop()
        executor.shutdown(wait=True)


def main(argv: list[str] | None = None) -> None:
    run_service(SERVICE, body, argv)
