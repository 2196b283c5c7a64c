"""The lifecycle every job run on a learner shares, GRPO (`JobRun`, job.py) and SFT
(`SFTRun`, sft.py): announce RUNNING, follow the job's events (cancel, requeue), build
the engine, resume from the checkpoint, publish weights and per-step metrics, save
checkpoints, export the final policy, announce COMPLETED, close. A subclass holds its
own state and writes `run`.

Lineage and fencing. Every run of a job (a first start, a resume after a crash or a
requeue) has a fresh run id: its request ids, weight events, metrics and evaluation
ids carry it, rollout samples with that run's weights only and stamps trajectories
with it, and the learner trains only on its own run's samples. So a resumed run (back
at its checkpoint's policy version) never mistakes a lost run's newer policy, or
trajectories, for its own, and JetStream's deduplication never swallows its messages
as repeats of the lost run's. Before each weight event and checkpoint the run checks
that the job record still names its placement attempt: a learner that missed its
requeue stops instead of overwriting the new attempt's checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
import hashlib
import logging
import secrets
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.msg import Msg

from opentinker.schemas import (
    JobAssigned, JobSpec, JobState, JobStateChanged, Metrics, WeightsPublished, decode,
)
from opentinker.schemas import subjects as S
from opentinker.services.core import tracing
from opentinker.services.core.bus import Bus
from opentinker.services.core.config import Settings
from opentinker.services.core.models import resolve_model
from opentinker.services.learner import checkpoint

log = logging.getLogger("opentinker.learner")

SERVICE = "learner"
KEEP_WEIGHT_VERSIONS = 3


class JobStopped(Exception):
    """The job stops without a final state from the learner (cancelled, or shutdown)."""


class RunLifecycle:
    """One job on this learner, from its assignment to a terminal state: what GRPO and
    SFT runs share. `run` (a subclass's) trains to completion."""

    def __init__(self, settings: Settings, bus: Bus, stop: asyncio.Event, executor: ThreadPoolExecutor,
                 assigned: JobAssigned, incarnation: int):
        self.settings = settings
        self.bus = bus
        self.stop = stop
        self.executor = executor
        self.job_id = assigned.job_id
        self.spec: JobSpec = assigned.spec
        self.incarnation = incarnation
        self.attempt = assigned.attempt  # the scheduler's placement attempt (0: unplaced)
        self.run_id = secrets.token_hex(4)  # this run's lineage (module docstring)
        self.cancelled = asyncio.Event()
        self.requeued = asyncio.Event()
        # the scheduler announced a change to the job's record that does not stop this
        # run (a lost rollout worker dropped from its placement): job.py follows it
        self.placement_changed = asyncio.Event()
        self.engine = None
        self.step = 0            # next step to train
        self.version = 0         # policy version: steps trained so far
        self.events_sub = None
        self.scratch = Path()  # a temporary folder for checkpoint files, made by begin() under <home>/scratch
        self.model_ref = ""    # the spec's model once begin() checked it for the job's owner
        self.unkept: set[int] = set()  # versions past the keep window whose weights an evaluation still samples

    async def run(self) -> None:
        """Train to completion. Raises JobStopped (cancel or shutdown) or the error
        that failed the job."""
        raise NotImplementedError

    # -- helpers ----------------------------------------------------------------

    def subject(self, family: str) -> str:
        return S.job(self.job_id, family)

    async def in_engine(self, fn, *args):
        """Run blocking engine work on the engine thread; the event loop stays free
        for heartbeats and NATS pings. The current trace context goes along (spans made
        there are children of the caller's)."""
        ctx = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(self.executor, ctx.run, fn, *args)

    def check_live(self) -> None:
        if self.cancelled.is_set():
            raise JobStopped("cancelled")
        if self.requeued.is_set():
            raise JobStopped("requeued")
        if self.stop.is_set():
            raise JobStopped("shutdown")

    async def pause(self, seconds: float) -> None:
        """Sleep `seconds`, stopping at once on a cancel, requeue or shutdown."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.check_live()
            await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))

    async def announce(self, state: JobState, reason: str = "") -> None:
        ev = JobStateChanged(job_id=self.job_id, state=state, reason=reason, step=self.step,
                             time_s=time.time(), source=SERVICE, attempt=self.attempt)
        await self.bus.publish(self.subject("events"), ev)

    async def fence(self) -> None:
        """Raise JobStopped unless the job record still names this run's placement
        attempt and is not terminal (a learner that missed its requeue or cancel event
        must not publish weights or overwrite the checkpoint of the attempt that owns
        the job now). A job run without a scheduler (attempt 0) is not fenced."""
        if not self.attempt:
            return
        why = await self.not_runnable(requeued=True)
        if why:
            log.warning("job %s: %s; this run stops", self.job_id, why)
            self.requeued.set()
            raise JobStopped("requeued")

    async def not_runnable(self, requeued: bool = False) -> str:
        """Why this assignment must not run ('' if it may): the job is terminal, the
        scheduler has placed it again since (a stale attempt), or, with `requeued`, its
        record has no placement (the scheduler requeued it). An unreadable or missing
        record (a job run without a scheduler) does not stop it."""
        try:
            got = await self.bus.job_record(self.job_id)
        except msgspec.MsgspecError:
            return ""
        if got is None:
            return ""
        rec = got[0]
        if rec.state.terminal:
            return f"already {rec.state.value}"
        if self.attempt and rec.attempt != self.attempt:
            return f"attempt {self.attempt} is stale (the job is at attempt {rec.attempt})"
        if requeued and rec.placement is None:
            return "requeued"
        return ""

    async def on_event(self, m: Msg) -> None:
        try:
            ev = decode(m.data, JobStateChanged)
        except msgspec.MsgspecError:
            return  # the scheduler dead-letters bad events on its durable consumer
        if ev.job_id != self.job_id:
            return  # a body naming another job than the subject: not about this job
        if ev.source != SERVICE and ev.state.terminal:
            log.info("job %s %s by %s: stopping", self.job_id, ev.state.value, ev.source or "?")
            self.cancelled.set()
        elif ev.source == "scheduler" and self.attempt:
            if ev.state == JobState.QUEUED and await self.not_runnable(requeued=True):
                log.info("job %s requeued by the scheduler (%s): stopping", self.job_id, ev.reason)
                self.requeued.set()
            else:
                self.placement_changed.set()

    # -- start and end ----------------------------------------------------------

    async def start(self) -> None:
        """begin(), then build_engine()."""
        await self.begin()
        await self.build_engine()

    async def begin(self) -> None:
        """Announce RUNNING, follow the job's events (cancel), read the job's owner
        (self.tenant) and check the model it names. Raises SpecError naming `model` for
        a model path the owner may not name (services/core/access.py)."""
        from opentinker.services.core import access

        scratch_root = Path(self.settings.home) / "scratch"  # not /tmp: a killed learner leaves it in home
        scratch_root.mkdir(parents=True, exist_ok=True)
        self.scratch = Path(tempfile.mkdtemp(prefix=f"learner-{self.job_id}-", dir=scratch_root))
        self.events_sub = await self.bus.nc.subscribe(self.subject("events"), cb=self.on_event)
        await self.bus.nc.flush()
        # a cancel published between the assignment and the subscription is not missed
        why = await self.not_runnable() if self.attempt else ""
        if why:
            log.info("job %s %s before its run began: stopping", self.job_id, why)
            self.cancelled.set()
        await self.announce(JobState.RUNNING)
        self.tenant = await access.tenant_of_job(self.bus, self.job_id)
        self.model_ref = access.check_model_ref(self.spec.model, **self.tenant.rules(self.settings.home))

    async def build_engine(self) -> None:
        """Build the training engine (one rank, or a rank group) for the model begin() checked."""
        model_path = await self.in_engine(resolve_model, self.model_ref, self.settings.home)
        from opentinker.services.learner.engine_deepspeed import TrainEngine, pick_device

        if self.spec.learner_ranks > 1:  # data parallel: N ranks (ranks.py)
            from opentinker.services.learner.ranks import RankGroup

            self.engine = await self.in_engine(RankGroup, self.spec, model_path, pick_device(self.settings.device),
                                               self.scratch, self.settings.threads or None)
        else:
            self.engine = await self.in_engine(TrainEngine, self.spec, model_path, self.settings.device)
        if self.spec.advantage_estimator == "gae":  # PPO with a critic beside the policy
            from opentinker.services.learner.critic import ActorCritic, CriticEngine

            critic = await self.in_engine(CriticEngine, self.spec, model_path, self.settings.device)
            self.engine = ActorCritic(self.engine, critic)
        self.check_live()

    async def finish(self) -> None:
        """Export the policy in Hugging Face format (`<home>/checkpoints/<id>/final`)
        and announce COMPLETED."""
        await self.in_engine(self.engine.save_pretrained, checkpoint.job_dir(self.settings.home, self.job_id) / "final")
        self.check_live()
        await self.announce(JobState.COMPLETED)

    async def close(self) -> None:
        if self.events_sub is not None:
            with contextlib.suppress(Exception):
                await self.events_sub.unsubscribe()
        if self.engine is not None:
            await self.in_engine(self.engine.close)
            self.engine = None
            gc.collect()  # the next job's model needs the memory
        if self.scratch != Path():
            shutil.rmtree(self.scratch, ignore_errors=True)

    async def cleanup_bus(self) -> None:
        """After a terminal state: drop the job's consumer and its unserved requests."""
        await self.bus.delete_durable(S.traj_durable(self.job_id))
        await self.bus.purge_subject(S.STREAM_ROLLOUT, S.rollout_all(self.job_id))

    # -- per step ---------------------------------------------------------------

    async def publish_weights(self) -> None:
        with tracing.span("learner.publish_weights", attrs={"ot.job_id": self.job_id,
                                                            "ot.policy_version": self.version}):
            await self._publish_weights()

    async def _publish_weights(self) -> None:
        await self.fence()
        data = await self.in_engine(self.engine.weights_bytes)
        v = self.version
        name = f"{self.job_id}/v{v}"
        await self.bus.put_object(S.OBJ_WEIGHTS, name, data)
        spec = self.spec
        ev = WeightsPublished(
            job_id=self.job_id, policy_version=v, kind=self.engine.kind,
            uri=f"nats-os://{S.OBJ_WEIGHTS}/{name}", sha256=hashlib.sha256(data).hexdigest(),
            size_bytes=len(data), lora_rank=spec.lora_rank if spec.lora_rank > 0 else 0,
            lora_alpha=spec.lora_alpha if spec.lora_rank > 0 else 0,
            target_modules=list(spec.lora_target_modules) if spec.lora_rank > 0 else [],
            step=max(self.step - 1, 0), time_s=time.time(), run=self.run_id, attempt=self.attempt)
        # a resumed run re-makes versions a lost run already announced: the run in the
        # id keeps JetStream's deduplication from swallowing the new bytes' event
        await self.bus.publish(self.subject("weights"), ev, msg_id=f"{self.job_id}-w{v}-r{self.run_id}")
        keep = max(KEEP_WEIGHT_VERSIONS, self.spec.max_staleness + 2)
        if v - keep >= 0:
            self.unkept.add(v - keep)
        await self.drop_unkept_weights()

    def versions_in_use(self) -> set[int]:
        """Policy versions whose weights must stay in ot_weights past the keep window:
        those an unfinished evaluation samples (it is pinned to its version)."""
        evaluator = getattr(self, "evaluator", None)
        return set(evaluator.pending) if evaluator is not None else set()

    async def drop_unkept_weights(self) -> None:
        """Delete the weights of versions past the keep window that no evaluation uses."""
        for old in sorted(self.unkept - self.versions_in_use()):
            await self.bus.delete_object(S.OBJ_WEIGHTS, f"{self.job_id}/v{old}")
            self.unkept.discard(old)

    async def step_done(self, s: int, values: dict[str, float], groups: list[str] | None = None) -> None:
        """Publish step `s`'s Metrics (split "train"; `groups`: the request ids it was
        trained on) and a RUNNING event for it."""
        m = Metrics(job_id=self.job_id, step=s, policy_version=self.version, values=values, time_s=time.time(),
                    groups=list(groups or []))
        # a step redone after a resume reports again, under this run's id (the log's
        # metrics view keeps the newest report of a step)
        await self.bus.publish(self.subject("metrics"), m, msg_id=f"{self.job_id}-m{s}-r{self.run_id}")
        await self.bus.publish(self.subject("events"), JobStateChanged(
            job_id=self.job_id, state=JobState.RUNNING, step=s, time_s=time.time(), source=SERVICE,
            attempt=self.attempt))

    # -- checkpoints ------------------------------------------------------------

    def checkpoint_due(self) -> bool:
        """After a step: every `checkpoint_every` steps, and after the last."""
        return self.step % self.spec.checkpoint_every == 0 or self.step == self.spec.steps

    async def resume(self, data: bytes | None) -> dict[str, Any] | None:
        """Restore the engine, RNG states, step and policy version from the job's
        checkpoint (`data`: its bytes as checkpoint.get read them, None when it has
        none); returns its metadata (a subclass restores its own keys from it), or None."""
        if data is None:
            return None
        meta, state_dir = await self.in_engine(checkpoint.unpack, data, self.scratch / "restore")
        await self.in_engine(self.engine.load_state, state_dir)
        checkpoint.set_rng_state(meta["rng"])
        self.step = meta["step"] + 1
        self.version = meta["policy_version"]
        log.info("job %s resumed from step %d (policy version %d, stream from %d)",
                 self.job_id, meta["step"], self.version, meta["traj_floor"] + 1)
        return meta

    async def init_from_job(self) -> None:
        """Start from `spec.init_from`'s newest checkpoint: its weights, not its
        optimizer state, step or policy version (this run stays at version 0). Raises
        ValueError naming init_from when that job has no checkpoint or its state does
        not fit this job's model (another LoRA rank or target modules)."""
        source = self.spec.init_from
        data = await checkpoint.get(self.bus, source)
        if data is None:
            raise ValueError(f"init_from: job {source!r} has no checkpoint yet (a job saves one every "
                             "checkpoint_every steps and after its last)")
        _, state_dir = await self.in_engine(checkpoint.unpack, data, self.scratch / "init")
        try:
            await self.in_engine(self.engine.load_state, state_dir, False)
        except Exception as e:
            raise ValueError(f"init_from: job {source!r}'s checkpoint does not fit this job "
                             f"(same model, lora_rank and lora_target_modules?): {str(e)[:300]}") from e
        log.info("job %s starts from job %s's policy", self.job_id, source)

    async def save_checkpoint(self, s: int, stream: dict[str, Any]) -> None:
        """Checkpoint after step `s`: the engine's state, RNG states, step and policy
        version, and `stream`, the trajectory-stream keys (ledger.py)."""
        meta: dict[str, Any] = {
            "job_id": self.job_id, "step": s, "policy_version": self.version,
            **stream,
            "rng": checkpoint.rng_state(), "time_s": time.time(),
        }
        state_dir = self.scratch / f"save-{s}"

        def write() -> bytes:
            self.engine.save_state(state_dir)
            data = checkpoint.store(self.settings.home, self.job_id, meta, state_dir)
            shutil.rmtree(state_dir, ignore_errors=True)
            return data

        data = await self.in_engine(write)
        await self.fence()
        await checkpoint.put(self.bus, self.job_id, data)
        await self.in_engine(checkpoint.prune, self.settings.home, self.job_id, s)
        log.info("job %s: checkpoint at step %d (%d bytes in the object store)", self.job_id, s, len(data))
