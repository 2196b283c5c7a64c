"""One job on a learner: `JobRun` drives a GRPO job from its assignment to a terminal
state (see service.py for the subjects it reads and writes).

Per step: ask for rollouts (at most max_staleness + 1 steps in flight), wait for every
group of the step, train one optimizer step (loss.py; episode- or turn-level credit),
publish the new weights and the step's metrics, evaluate when due (evaluation.py),
checkpoint every `checkpoint_every` steps (checkpoint.py), repeat.

Lineage and fencing. Every run of a job (a first start, a resume after a crash or a
requeue) has a fresh run id: its request ids, weight events, metrics and evaluation
ids carry it, rollout samples with that run's weights only and stamps trajectories
with it, and the learner trains only on its own run's samples. So a resumed run (back
at its checkpoint's policy version) never mistakes a lost run's newer policy, or
trajectories, for its own, and JetStream's deduplication never swallows its messages
as repeats of the lost run's. Before each weight event and checkpoint the run checks
that the job record still names its placement attempt: a learner that missed its
requeue stops instead of overwriting the new attempt's checkpoint.

Bounded waits. A group that is not complete `spec.rollout_timeout_s` after it was asked
for is asked again (a dead-lettered request, a lost worker), and a group whose every
episode ended on an error is asked again with that error as the reason; each counts
toward MAX_ATTEMPTS, after which the job fails naming the last reason.
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
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.msg import Msg
from nats.js import api
from nats.js.errors import NotFoundError

from opentinker.schemas import (
    JobAssigned, JobSpec, JobState, JobStateChanged, Metrics, RolloutRequest,
    Trajectory, WeightsPublished, decode,
)
from opentinker.schemas import subjects as S
from opentinker.services.core import tracing
from opentinker.services.core.bus import Bus
from opentinker.services.core.config import Settings
from opentinker.services.core.models import resolve_model
from opentinker.services.learner import checkpoint
from opentinker.services.learner.batching import StepAdvantages, check_trajectory, micro_batches, step_advantages
from opentinker.services.learner.evaluation import Evaluator, parse_eval_request_id

log = logging.getLogger("opentinker.learner")

SERVICE = "learner"
# trajectories wait unacked for later steps; long enough that redeliveries are rare
# (a redelivered duplicate is recognized by its stream sequence and skipped)
TRAJ_ACK_WAIT_S = 600.0
TRAJ_FETCH = 64
KEEP_WEIGHT_VERSIONS = 3
# a group asked for this many times without a usable answer fails the job: the rollout
# side is broken, and asking forever would hide it
MAX_ATTEMPTS = 8
# after the last step, how long the final evaluation may take before the job ends without it
FINAL_EVAL_WAIT_S = 900.0


def group_seed(seed: int, step: int, group_index: int) -> int:
    """The initial-state seed of one group, a pure function of (seed, step, group).
    In [0, 2**31) so that any RNG an environment uses accepts it."""
    h = hashlib.blake2b(f"{seed}:{step}:{group_index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & 0x7FFFFFFF


def request_id(job_id: str, step: int, group_index: int, attempt: int, run: str = "") -> str:
    """`<job>-s<step>-g<group>`, plus `-a<n>` when a dropped group is asked again, plus
    `-r<run>` for the learner run asking (unique per run: episode ids and the stream's
    deduplication ids derive from it)."""
    base = f"{job_id}-s{step}-g{group_index}"
    if attempt:
        base += f"-a{attempt}"
    return f"{base}-r{run}" if run else base


class JobStopped(Exception):
    """The job stops without a final state from the learner (cancelled, or shutdown)."""


@dataclass
class Held:
    """A trajectory the learner holds until its step is trained."""

    traj: Trajectory
    msg: Msg
    seq: int


@dataclass
class StepStats:
    dropped_stale: int = 0
    dropped_invalid: int = 0
    dropped_error: int = 0   # groups whose every episode ended on an error
    timed_out: int = 0       # groups asked again after rollout_timeout_s
    wait_s: float = 0.0


class JobRun:
    """One job on this learner, from its assignment to a terminal state."""

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
        self.rollout_workers = list(assigned.rollout_workers)
        self.cancelled = asyncio.Event()
        self.requeued = asyncio.Event()
        self.engine = None
        self.step = 0            # next step to train
        self.version = 0         # policy version: steps trained so far
        self.requested_upto = -1
        self.attempts: dict[int, list[int]] = {}
        # step -> request_id -> episode_id -> held trajectory
        self.buffers: dict[int, dict[str, dict[str, Held]]] = {}
        self.seen: set[int] = set()                     # stream sequences delivered this run
        self.skip: set[int] = set()                     # used by a checkpointed step (resume)
        self.traj_floor = 0
        self.used_seqs: set[int] = set()
        self.asked_at: dict[tuple[int, int], float] = {}  # (step, group) -> when asked (monotonic)
        self.stats = StepStats()
        self.evaluator = Evaluator(self.job_id, self.spec, self.run_id, self.attempt)
        self.sub = None
        self.events_sub = None
        self.scratch = Path()  # a temporary folder for checkpoint files, made by run()

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

    async def announce(self, state: JobState, reason: str = "") -> None:
        ev = JobStateChanged(job_id=self.job_id, state=state, reason=reason, step=self.step,
                             time_s=time.time(), source=SERVICE, attempt=self.attempt)
        await self.bus.publish(self.subject("events"), ev)

    def rollout_subject(self, index: int) -> str:
        """Where request `index` (a group, or an evaluation episode) goes: the job's
        rollout workers take turns."""
        if not self.rollout_workers:
            raise RuntimeError(f"job {self.job_id} was assigned without rollout workers")
        return S.rollout(self.job_id, self.rollout_workers[index % len(self.rollout_workers)])

    def publish_id(self, request_id: str) -> str:
        """The Nats-Msg-Id of a request (its id names the run; the attempt too, for ids
        without a run)."""
        return f"{request_id}@a{self.attempt}"

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
        elif ev.source == "scheduler" and ev.state == JobState.QUEUED and self.attempt:
            if await self.not_runnable(requeued=True):
                log.info("job %s requeued by the scheduler (%s): stopping", self.job_id, ev.reason)
                self.requeued.set()

    # -- main -------------------------------------------------------------------

    async def start(self) -> None:
        """Announce RUNNING, follow the job's events (cancel), read the job's owner
        (self.tenant) and build the engine. Raises SpecError naming `model` for a model
        path the owner may not name (services/core/access.py)."""
        from opentinker.services.core import access

        self.scratch = Path(tempfile.mkdtemp(prefix=f"learner-{self.job_id}-"))
        self.events_sub = await self.bus.nc.subscribe(self.subject("events"), cb=self.on_event)
        await self.announce(JobState.RUNNING)
        self.tenant = await access.tenant_of_job(self.bus, self.job_id)
        model = access.check_model_ref(self.spec.model, **self.tenant.rules(self.settings.home))
        model_path = await self.in_engine(resolve_model, model, self.settings.home)
        from opentinker.services.learner.engine_deepspeed import TrainEngine

        self.engine = await self.in_engine(TrainEngine, self.spec, model_path, self.settings.device)
        self.check_live()

    async def run(self) -> None:
        """Train to completion. Raises JobStopped (cancel or shutdown) or the error
        that failed the job."""
        await self.start()
        resumed = await self.resume()
        await self.open_trajectories()
        if resumed:
            await self.publish_weights()
        await self.maybe_evaluate()
        while self.step < self.spec.steps:
            await self.request_rollouts()
            groups = await self.wait_for_step()
            await self.train(groups)
            await self.maybe_evaluate()
        await self.wait_for_evaluations()
        await self.finish()

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
        with contextlib.suppress(NotFoundError):
            await self.bus.js.delete_consumer("OT_TRAJ", f"learner-{self.job_id}")
        with contextlib.suppress(NotFoundError):
            await self.bus.js.purge_stream("OT_ROLLOUT", subject=S.rollout_all(self.job_id))

    # -- resume -----------------------------------------------------------------

    async def resume(self) -> bool:
        data = await checkpoint.get(self.bus, self.job_id)
        if data is None:
            return False
        meta, state_dir = await self.in_engine(checkpoint.unpack, data, self.scratch / "restore")
        await self.in_engine(self.engine.load_state, state_dir)
        checkpoint.set_rng_state(meta["rng"])
        self.step = meta["step"] + 1
        self.version = meta["policy_version"]
        self.traj_floor = meta["traj_floor"]
        self.skip = set(meta["traj_used"])
        self.attempts = {int(k): list(v) for k, v in meta["attempts"].items()}
        log.info("job %s resumed from step %d (policy version %d, stream from %d)",
                 self.job_id, meta["step"], self.version, self.traj_floor + 1)
        return True

    async def open_trajectories(self) -> None:
        """(Re)create the job's trajectory consumer at the checkpoint's stream position,
        so the replay is exactly what the checkpoint had not consumed."""
        durable = f"learner-{self.job_id}"
        with contextlib.suppress(NotFoundError):
            await self.bus.js.delete_consumer("OT_TRAJ", durable)
        start = dict(deliver_policy=api.DeliverPolicy.ALL)
        if self.traj_floor > 0:
            start = dict(deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self.traj_floor + 1)
        cfg = api.ConsumerConfig(durable_name=durable, ack_policy=api.AckPolicy.EXPLICIT,
                                 ack_wait=TRAJ_ACK_WAIT_S, filter_subject=self.subject("traj"),
                                 max_ack_pending=100_000, **start)
        self.sub = await self.bus.js.pull_subscribe(self.subject("traj"), durable=durable,
                                                    stream="OT_TRAJ", config=cfg)

    # -- rollout requests -------------------------------------------------------

    def current_rid(self, step: int, group_index: int) -> str:
        return request_id(self.job_id, step, group_index, self.attempts[step][group_index], self.run_id)

    async def request_group(self, step: int, i: int) -> None:
        rid = self.current_rid(step, i)
        spec = self.spec
        self.asked_at[(step, i)] = time.monotonic()
        req = RolloutRequest(job_id=self.job_id, request_id=rid, step=step, group_index=i,
                             group_seed=group_seed(spec.seed, step, i), policy_version=self.version,
                             model=spec.model, env=spec.env, env_args=spec.env_args,
                             group_size=spec.group_size, sampling=spec.sampling, engine=spec.engine,
                             attempt=self.attempt, policy_run=self.run_id)
        # the root of the group's trace: rollout, envhost and this learner's
        # trajectory spans follow it through the message headers
        with tracing.span("learner.request", kind=tracing.SpanKind.PRODUCER,
                          attrs={"ot.job_id": self.job_id, "ot.step": step, "ot.group_index": i,
                                 "ot.request_id": rid, "ot.policy_version": self.version}):
            await self.bus.publish(self.rollout_subject(i), req, msg_id=self.publish_id(rid))

    async def request_rollouts(self) -> None:
        """Ask for every step up to `step + max_staleness` not asked for yet."""
        last = min(self.step + self.spec.max_staleness, self.spec.steps - 1)
        for s in range(max(self.step, self.requested_upto + 1), last + 1):
            self.attempts.setdefault(s, [0] * self.spec.prompts_per_step)
            for i in range(self.spec.prompts_per_step):
                self.check_live()  # a requeue or cancel stops even a long round of asking
                await self.request_group(s, i)
        self.requested_upto = max(self.requested_upto, last)

    async def drop_group(self, step: int, i: int, why: str) -> None:
        """Discard a group's current attempt and ask for it again.

        Raises RuntimeError after MAX_ATTEMPTS attempts (the job fails).
        """
        rid = self.current_rid(step, i)
        for held in self.buffers.get(step, {}).pop(rid, {}).values():
            await held.msg.ack()
        if self.attempts[step][i] + 1 >= MAX_ATTEMPTS:
            raise RuntimeError(f"group {rid}: {MAX_ATTEMPTS} attempts dropped, the last as {why}; "
                               "is the rollout side sampling an old policy, failing, or sending bad trajectories?")
        self.attempts[step][i] += 1
        if why == "stale":
            self.stats.dropped_stale += 1
        elif why.startswith("timeout"):
            self.stats.timed_out += 1
        elif why.startswith("every episode failed"):
            self.stats.dropped_error += 1
            # an environment or engine failing outright (a restart, say) is given time
            # to come back: 1, 2, 4, ... up to 30 s (and rollout_timeout_s) between
            # attempts, ~1.5 min in all by default
            await self.pause(min(2.0 ** (self.attempts[step][i] - 1), 30.0, self.spec.rollout_timeout_s))
        else:
            self.stats.dropped_invalid += 1
        log.info("job %s: dropped group %s (%s); asking again", self.job_id, rid, why)
        await self.request_group(step, i)

    async def pause(self, seconds: float) -> None:
        """Sleep `seconds`, stopping at once on a cancel, requeue or shutdown."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.check_live()
            await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))

    # -- trajectories -----------------------------------------------------------

    def lag_ok(self, traj: Trajectory) -> bool:
        if not any(traj.loss_mask):
            return True  # no sampled token (an early error): nothing of it is trained
        if traj.policy_version > 0 and traj.policy_run != self.run_id:
            return False  # another run's policy of that number (module docstring: lineage)
        lag = self.version - traj.policy_version
        # a version newer than ours comes from a run that did not survive (resume)
        return 0 <= lag <= self.spec.max_staleness

    async def on_trajectory(self, m: Msg) -> None:
        # continues the episode's trace (rollout -> envhost -> here)
        with tracing.span("learner.trajectory", parent=tracing.extract(m.headers), kind=tracing.SpanKind.CONSUMER,
                          attrs={"ot.job_id": self.job_id, "ot.stream_seq": m.metadata.sequence.stream}) as sp:
            await self._on_trajectory(m, sp)

    async def _on_trajectory(self, m: Msg, sp) -> None:
        seq = m.metadata.sequence.stream
        if seq in self.seen:
            return  # redelivered while held; the first delivery is acked with its step
        self.seen.add(seq)
        if seq in self.skip:
            await m.ack()
            return
        traj = await self.bus.decode_or_dead_letter(m, Trajectory)
        if traj is None:
            return
        sp.set_attributes({"ot.episode_id": traj.episode_id, "ot.step": traj.step,
                           "ot.policy_version": traj.policy_version, "ot.reward": traj.reward})
        if parse_eval_request_id(self.job_id, traj.request_id) is not None:
            await self.on_eval_trajectory(traj, m)
            return
        spec = self.spec
        if not (self.step <= traj.step < spec.steps and 0 <= traj.group_index < spec.prompts_per_step):
            await m.ack()  # late (its step is trained) or not part of this job: nothing to do
            return
        # a step not asked for yet is possible after a resume (the lost run asked): keep it
        self.attempts.setdefault(traj.step, [0] * spec.prompts_per_step)
        rid = self.current_rid(traj.step, traj.group_index)
        try:
            if traj.job_id != self.job_id:
                raise ValueError(f"Trajectory.job_id: {traj.job_id!r} on {self.job_id}'s subject")
            if traj.group_size != spec.group_size:
                raise ValueError(f"Trajectory.group_size: {traj.group_size} != the job's {spec.group_size}")
            check_trajectory(traj, self.engine.vocab_size)
        except ValueError as e:
            await self.bus.dead_letter(m, str(e))
            await m.term()
            if traj.request_id == rid:
                await self.drop_group(traj.step, traj.group_index, "invalid")
            return
        group = self.buffers.setdefault(traj.step, {}).setdefault(traj.request_id, {})
        if traj.episode_id in group or len(group) >= spec.group_size:
            await m.ack()  # a duplicate episode, or more than the group needs
            return
        group[traj.episode_id] = Held(traj, m, seq)
        if traj.request_id == rid and not self.lag_ok(traj):
            await self.drop_group(traj.step, traj.group_index, "stale")

    async def wait_for_step(self) -> list[list[Held]]:
        """Fetch trajectories until every group of `self.step` is complete and fresh.
        A group missing `rollout_timeout_s` after it was asked for, or whose every
        episode failed, is asked again (drop_group; raises RuntimeError past
        MAX_ATTEMPTS)."""
        t0 = time.monotonic()
        s, spec = self.step, self.spec
        while True:
            self.check_live()
            ready = True
            for i in range(spec.prompts_per_step):
                group = self.buffers.get(s, {}).get(self.current_rid(s, i), {})
                if len(group) < spec.group_size:
                    ready = False
                    waited = time.monotonic() - self.asked_at.get((s, i), t0)
                    if waited > spec.rollout_timeout_s:
                        await self.drop_group(s, i, f"timeout: {len(group)} of {spec.group_size} episodes "
                                                    f"{waited:.0f} s after asking (is a rollout worker serving it? "
                                                    "see ot.dlq.rollout)")
                elif not all(self.lag_ok(h.traj) for h in group.values()):
                    await self.drop_group(s, i, "stale")
                    ready = False
                elif all(h.traj.error for h in group.values()):
                    err = next(iter(group.values())).traj.error
                    await self.drop_group(s, i, f"every episode failed: {err[:500]}")
                    ready = False
            if ready:
                break
            for m in await self.bus.fetch(self.sub, TRAJ_FETCH, 1.0):
                await self.on_trajectory(m)
        self.stats.wait_s = time.monotonic() - t0
        return [list(self.buffers[s][self.current_rid(s, i)].values()) for i in range(spec.prompts_per_step)]

    # -- evaluation -------------------------------------------------------------

    async def maybe_evaluate(self) -> None:
        """Ask for an evaluation of the current policy if one is due (evaluation.py)."""
        if not self.evaluator.due(self.version):
            return
        await self.fence()
        for i, req in enumerate(self.evaluator.requests(self.version)):
            await self.bus.publish(self.rollout_subject(i), req, msg_id=self.publish_id(req.request_id))
        log.info("job %s: evaluating policy version %d on %d %s episodes", self.job_id, self.version,
                 self.spec.eval_episodes, self.spec.eval_split)

    async def on_eval_trajectory(self, traj: Trajectory, m: Msg) -> None:
        await m.ack()  # an eval episode is only reported, never trained on
        metrics = self.evaluator.add(traj)
        if metrics is not None:
            await self.bus.publish(self.subject("metrics"), metrics,
                                   msg_id=f"{self.job_id}-eval-m{metrics.policy_version}-r{self.run_id}")
            log.info("job %s eval at policy version %d: reward %.3f, correct %.3f",
                     self.job_id, metrics.policy_version, metrics.values["reward_mean"],
                     metrics.values["correct_frac"])

    async def wait_for_evaluations(self) -> None:
        deadline = time.monotonic() + FINAL_EVAL_WAIT_S
        while self.evaluator.pending and time.monotonic() < deadline:
            self.check_live()
            for m in await self.bus.fetch(self.sub, TRAJ_FETCH, 1.0):
                await self.on_trajectory(m)
        if self.evaluator.pending:
            log.warning("job %s: evaluations of versions %s did not finish within %.0f s",
                        self.job_id, sorted(self.evaluator.pending), FINAL_EVAL_WAIT_S)

    # -- training ---------------------------------------------------------------

    def advantages(self, trajs: list[Trajectory]) -> StepAdvantages:
        """Per-episode (GRPO) or per-token (turn-level credit) advantages, trajs in group
        order, and which episodes are excluded (errors; batching.step_advantages)."""
        spec = self.spec
        return step_advantages(trajs, spec.prompts_per_step, spec.group_size, spec.advantage, spec.turn_discount)

    def _train_blocking(self, trajs: list[Trajectory]) -> dict[str, float]:
        with tracing.span("learner.batch", attrs={"ot.episodes": len(trajs)}):
            adv = self.advantages(trajs)
            batches = micro_batches(trajs, adv.advantages, self.spec.micro_batch_size, self.engine.pad_id,
                                    exclude=adv.excluded)
        return {**self.engine.train_step(batches), "excluded_frac": adv.excluded_frac}

    async def train(self, groups: list[list[Held]]) -> None:
        with tracing.span("learner.step", attrs={"ot.job_id": self.job_id, "ot.step": self.step}):
            await self._train(groups)

    async def _train(self, groups: list[list[Held]]) -> None:
        t_start = time.monotonic() - self.stats.wait_s
        held = [h for g in groups for h in g]
        trajs = [h.traj for h in held]
        t0 = time.monotonic()
        out = await self.in_engine(self._train_blocking, trajs)
        train_s = time.monotonic() - t0
        self.check_live()  # a job cancelled mid-step publishes nothing more
        s = self.step
        self.version += 1
        self.step += 1
        await self.publish_weights()
        used = {h.seq for h in held}
        for group in self.buffers.pop(s, {}).values():
            for h in group.values():
                if h.seq not in used:
                    await h.msg.ack()  # a dropped attempt's late arrivals
        self.used_seqs |= used
        if self.checkpoint_due():
            await self.save_checkpoint(s)
        for h in held:
            await h.msg.ack()
        step_s = time.monotonic() - t_start
        await self.publish_metrics(s, trajs, out, train_s, step_s)
        log.info("job %s step %d: reward %.3f loss %.4f grad_norm %.4f (%.1f s train, %.1f s wait)",
                 self.job_id, s, statistics.fmean(t.reward for t in trajs), out["loss"],
                 out["grad_norm"], train_s, self.stats.wait_s)
        self.stats = StepStats()

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
            store = await self.bus.objects(S.OBJ_WEIGHTS)
            with contextlib.suppress(NotFoundError):
                await store.delete(f"{self.job_id}/v{v - keep}")

    async def publish_metrics(self, s: int, trajs: list[Trajectory], out: dict[str, float],
                              train_s: float, step_s: float) -> None:
        rewards = [t.reward for t in trajs]
        lags = [self.version - 1 - t.policy_version for t in trajs if any(t.loss_mask)] or [0]
        gen_tokens = [sum(t.loss_mask) for t in trajs]
        values = {
            "reward_mean": statistics.fmean(rewards),
            "reward_std": statistics.pstdev(rewards),
            "kl": out["kl"],
            "approx_kl": out["approx_kl"],
            "entropy": out["entropy"],
            "clip_frac": out["clip_frac"],
            "loss": out["loss"],
            "grad_norm": out["grad_norm"],
            "policy_lag_mean": statistics.fmean(lags),
            "policy_lag_max": float(max(lags)),
            "tokens_per_s": sum(gen_tokens) / max(step_s, 1e-9),
            "step_time_s": step_s,
            "train_time_s": train_s,
            "wait_time_s": self.stats.wait_s,
            "dropped_stale": float(self.stats.dropped_stale),
            "dropped_invalid": float(self.stats.dropped_invalid),
            "dropped_error": float(self.stats.dropped_error),
            "timed_out": float(self.stats.timed_out),
            "episode_len_mean": statistics.fmean(len(t.token_ids) for t in trajs),
            "gen_tokens_mean": statistics.fmean(gen_tokens),
            "turns_mean": statistics.fmean(len(t.turns) for t in trajs),
            "error_frac": sum(1 for t in trajs if t.error) / len(trajs),
            "excluded_frac": out["excluded_frac"],
            "episodes": float(len(trajs)),
        }
        await self.step_done(s, values, list(dict.fromkeys(t.request_id for t in trajs)))

    def checkpoint_due(self) -> bool:
        """After a step: every `checkpoint_every` steps, and after the last."""
        return self.step % self.spec.checkpoint_every == 0 or self.step == self.spec.steps

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

    def stream_position(self) -> tuple[int, list[int]]:
        """(floor, used above floor): every sequence <= floor is consumed or discarded;
        held trajectories of later steps stay above the floor, to be replayed."""
        pending = [h.seq for step in self.buffers.values() for g in step.values() for h in g.values()]
        floor = (min(pending) - 1) if pending else max(self.seen, default=self.traj_floor)
        floor = max(floor, self.traj_floor)
        used = sorted(q for q in (self.used_seqs | self.skip) if q > floor)
        return floor, used

    async def save_checkpoint(self, s: int) -> None:
        floor, used = self.stream_position()
        meta: dict[str, Any] = {
            "job_id": self.job_id, "step": s, "policy_version": self.version,
            "traj_floor": floor, "traj_used": used,
            "attempts": {k: v for k, v in self.attempts.items() if k > s},
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
        self.traj_floor = floor
        self.used_seqs = {q for q in self.used_seqs if q > floor}
        self.seen = {q for q in self.seen if q > floor}
        self.skip = {q for q in self.skip if q > floor}
        log.info("job %s: checkpoint at step %d (%d bytes in the object store)", self.job_id, s, len(data))
