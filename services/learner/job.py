"""One GRPO job on a learner: `JobRun` drives it from its assignment to a terminal
state (see service.py for the subjects it reads and writes; lifecycle.py for what it
shares with SFT: events, fencing, weights, checkpoints, run lineage).

Per step: ask for rollouts (at most max_staleness + 1 steps in flight), wait for every
group of the step, train one step (step.py plans it: advantages, updates, micro-batches;
the engine runs it), publish the new weights and the step's metrics, evaluate when due
(evaluation.py), checkpoint every `checkpoint_every` steps (checkpoint.py), repeat. A
new job (no checkpoint) asks for its first steps, sampled by the base model, before its
engine is built, so the rollout worker starts its own engine meanwhile. Which
trajectories are held, seen, used or skipped, each group's attempt and the stream
position a checkpoint records live in the run's ledger (ledger.py); this module does the
NATS side: requests, fetches, acks, dead letters.

Bounded waits. A group that is not complete `spec.rollout_timeout_s` after it was asked
for is asked again (a dead-lettered request, a lost worker), and a group whose every
episode ended on an error is asked again with that error as the reason; each counts
toward MAX_ATTEMPTS, after which the job fails naming the last reason.

Many rollout workers. Groups and evaluation episodes go to the job's rollout workers in
turn. When some of them leave the pool, the scheduler keeps the job's attempt on the
survivors and announces it; the run then asks the lost workers' unfinished groups again
on the survivors at once (follow_placement), without waiting for the timeout.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgspec
from nats.aio.msg import Msg

from opentinker.schemas import JobAssigned, RolloutRequest, Trajectory
from opentinker.schemas import subjects as S
from opentinker.schemas.rollout import SEATS_MISMATCH, TEACHER_MISMATCH
from opentinker.schemas.stats import derived_seed, episode_stats, lag_stats, seat_stats
from opentinker.services.core import tracing
from opentinker.services.core.bus import Bus
from opentinker.services.core.config import Settings
from opentinker.services.core.runner import torch_threads
from opentinker.services.learner import checkpoint
from opentinker.services.learner.batching import check_trajectory
from opentinker.services.learner.evaluation import Evaluator
from opentinker.services.learner.ledger import Delivery, StepStats, TrajectoryLedger, by_seat, seats_complete
# SERVICE and JobStopped are imported from here too (service.py)
from opentinker.services.learner.lifecycle import SERVICE, JobStopped, RunLifecycle  # noqa: F401
from opentinker.services.learner.step import plan_step, token_stats

log = logging.getLogger("opentinker.learner")

# trajectories wait unacked for later steps; long enough that redeliveries are rare
# (a redelivered duplicate is recognized by its stream sequence and skipped)
TRAJ_ACK_WAIT_S = 600.0
TRAJ_FETCH = 64
AHEAD_FETCH_S = 0.2  # a fetch during an update (while_training): the step ends <= this after it
# a group asked for this many times without a usable answer fails the job: the rollout
# side is broken, and asking forever would hide it
MAX_ATTEMPTS = 8
# after the last step, how long the final evaluation may take before the job ends without it
FINAL_EVAL_WAIT_S = 900.0


def group_seed(seed: int, step: int, group_index: int, refill: int = 0) -> int:
    """The initial-state seed of one group, a pure function of (seed, step, group) and,
    for the `refill`-th replacement of a group without signal (dynamic_sampling), of
    that index too."""
    return (derived_seed(seed, step, group_index) if refill == 0
            else derived_seed("refill", seed, step, group_index, refill))


@dataclass
class Held:
    """A trajectory the learner holds until its step is trained, and its message to ack."""

    traj: Trajectory
    msg: Msg


class JobRun(RunLifecycle):
    """One GRPO job on this learner, from its assignment to a terminal state."""

    def __init__(self, settings: Settings, bus: Bus, stop: asyncio.Event, executor: ThreadPoolExecutor,
                 assigned: JobAssigned, incarnation: int):
        super().__init__(settings, bus, stop, executor, assigned, incarnation)
        spec = self.spec
        self.rollout_workers = list(assigned.rollout_workers)
        self.asked_on: dict[tuple[int, int], str] = {}  # (step, group) -> its current attempt's worker
        self.eval_asked_on: dict[str, tuple[RolloutRequest, str]] = {}  # eval request id -> (it, its worker)
        # a rollout worker lost between the placement and this start: the record is read
        # at the first wait (follow_placement)
        self.placement_changed.set()
        self.requested_upto = -1
        self.ledger: TrajectoryLedger[Held] = TrajectoryLedger(
            self.job_id, self.run_id, spec.steps, spec.prompts_per_step, spec.group_trajectories)
        self.stats = StepStats()
        self.evaluator = Evaluator(self.job_id, spec, self.run_id, self.attempt)
        self.sub = None
        self.weights_s = 0.0  # the last publish_weights, seconds
        # dynamic sampling: (step, group) -> how many times its prompt was replaced
        self.refill_index: dict[tuple[int, int], int] = {}
        self.ahead_stats: dict[int, StepStats] = {}  # a later step's replacements (while_training)

    async def run(self) -> None:
        """Train to completion. Raises JobStopped (cancel or shutdown) or the error
        that failed the job."""
        await self.begin()
        saved = await checkpoint.get(self.bus, self.job_id)
        building = asyncio.ensure_future(self.build_engine())
        try:
            if saved is None and not self.spec.init_from:
                # a new job's first steps are sampled by the base model: ask for them now,
                # so the rollout starts its engine while this learner builds its own
                await self.open_trajectories()
                await self.request_rollouts()
        finally:
            await building  # the engine thread finishes before anything can close the engine
        if await self.resume(saved) is not None:
            await self.open_trajectories()
            await self.publish_weights()
        elif self.spec.init_from:  # version 0 is the policy it starts from, not the base model
            await self.init_from_job()
            await self.open_trajectories()
            await self.publish_weights()
        await self.maybe_evaluate()
        while self.step < self.spec.steps:
            await self.request_rollouts()
            groups = await self.wait_for_step()
            await self.train(groups)
            await self.maybe_evaluate()
        await self.wait_for_evaluations()
        await self.finish()

    # -- resume -----------------------------------------------------------------

    async def resume(self, data: bytes | None) -> dict[str, Any] | None:
        """The lifecycle's resume, then the ledger's stream position and attempts."""
        meta = await super().resume(data)
        if meta is not None:
            self.ledger.restore(meta)
        return meta

    async def open_trajectories(self) -> None:
        """(Re)create the job's trajectory consumer at the checkpoint's stream position,
        so the replay is exactly what the checkpoint had not consumed."""
        d = S.traj_durable(self.job_id)
        await self.bus.delete_durable(d)
        self.sub = await self.bus.durable(d, ack_wait_s=TRAJ_ACK_WAIT_S, max_ack_pending=100_000,
                                          opt_start_seq=self.ledger.floor + 1 if self.ledger.floor > 0 else None)

    # -- rollout requests -------------------------------------------------------

    def rollout_worker(self, index: int) -> str:
        """Which worker request `index` (a group, or an evaluation episode) goes to:
        the job's rollout workers take turns."""
        if not self.rollout_workers:
            raise RuntimeError(f"job {self.job_id} was assigned without rollout workers")
        return self.rollout_workers[index % len(self.rollout_workers)]

    def publish_id(self, request_id: str) -> str:
        """The Nats-Msg-Id of a request (its id names the run; the attempt too, for ids
        without a run)."""
        return f"{request_id}@a{self.attempt}"

    async def request_group(self, step: int, i: int) -> None:
        rid = self.ledger.current_request_id(step, i)
        spec = self.spec
        self.ledger.ask(step, i, time.monotonic())
        req = RolloutRequest(job_id=self.job_id, request_id=rid, step=step, group_index=i,
                             group_seed=group_seed(spec.seed, step, i, self.refill_index.get((step, i), 0)),
                             policy_version=self.version,
                             model=spec.model, env=spec.env, env_args=spec.env_args,
                             group_size=spec.group_size, sampling=spec.sampling, engine=spec.engine,
                             sampler_dtype=spec.sampler_dtype,
                             purpose="train", attempt=self.attempt, policy_run=self.run_id, agents=spec.agents,
                             opponents=spec.opponents, teacher=spec.teacher, teacher_job=spec.teacher_job,
                             teacher_model=spec.teacher_model, teacher_context=spec.teacher_context)
        # the root of the group's trace: rollout, envhost and this learner's
        # trajectory spans follow it through the message headers
        worker = self.rollout_worker(i)
        self.asked_on[(step, i)] = worker
        with tracing.span("learner.request", kind=tracing.SpanKind.PRODUCER,
                          attrs={"ot.job_id": self.job_id, "ot.step": step, "ot.group_index": i,
                                 "ot.request_id": rid, "ot.policy_version": self.version}):
            await self.bus.publish(S.rollout(self.job_id, worker), req, msg_id=self.publish_id(rid))

    async def request_rollouts(self) -> None:
        """Ask for every step up to `step + max_staleness` not asked for yet."""
        last = min(self.step + self.spec.max_staleness, self.spec.steps - 1)
        for key in [k for k in self.asked_on if k[0] < self.step]:
            del self.asked_on[key]  # trained steps
        for s in range(max(self.step, self.requested_upto + 1), last + 1):
            self.ledger.open(s)
            for i in range(self.spec.prompts_per_step):
                self.check_live()  # a requeue or cancel stops even a long round of asking
                await self.request_group(s, i)
        self.requested_upto = max(self.requested_upto, last)

    async def drop_group(self, step: int, i: int, why: str) -> None:
        """Discard a group's current attempt and ask for it again.

        Raises RuntimeError after MAX_ATTEMPTS attempts (the job fails).
        """
        rid = self.ledger.current_request_id(step, i)
        for held in self.ledger.drop(step, i):
            await held.msg.ack()
        attempt = self.ledger.attempt(step, i)
        if attempt >= MAX_ATTEMPTS:
            raise RuntimeError(f"group {rid} of env {self.spec.env!r}: {MAX_ATTEMPTS} attempts dropped, the last "
                               f"as {why}; is the env failing or stalling, or the rollout side sampling an old "
                               "policy, failing, or sending bad trajectories?")
        if why == "stale":
            self.stats.dropped_stale += 1
        elif why.startswith("timeout"):
            self.stats.timed_out += 1
        elif why.startswith("rollout worker"):
            self.stats.failed_over += 1
        elif why.startswith("every episode failed"):
            self.stats.dropped_error += 1
            # an environment or engine failing outright (a restart, say) is given time
            # to come back: 1, 2, 4, ... up to 30 s (and rollout_timeout_s) between
            # attempts, ~1.5 min in all by default
            await self.pause(min(2.0 ** (attempt - 1), 30.0, self.spec.rollout_timeout_s))
        else:
            self.stats.dropped_invalid += 1
        log.info("job %s: dropped group %s (%s); asking again", self.job_id, rid, why)
        await self.request_group(step, i)

    # -- trajectories -----------------------------------------------------------

    def lag_ok(self, traj: Trajectory, version: int | None = None) -> bool:
        """Is `traj` fresh enough to train at policy version `version` (default: the
        current one), within max_staleness?"""
        if traj.policy_of:
            return True  # an opponent's seat: its versions are another job's, never trained
        if not any(traj.loss_mask):
            return True  # no sampled token (an early error): nothing of it is trained
        if traj.policy_version > 0 and traj.policy_run != self.run_id:
            return False  # another run's policy of that number (lifecycle.py: lineage)
        lag = (self.version if version is None else version) - traj.policy_version
        # a version newer than ours comes from a run that did not survive (resume)
        return 0 <= lag <= self.spec.max_staleness

    async def on_trajectory(self, m: Msg) -> None:
        # continues the episode's trace (rollout -> envhost -> here)
        with tracing.span("learner.trajectory", parent=tracing.extract(m.headers), kind=tracing.SpanKind.CONSUMER,
                          attrs={"ot.job_id": self.job_id, "ot.stream_seq": m.metadata.sequence.stream}) as sp:
            await self._on_trajectory(m, sp)

    async def _on_trajectory(self, m: Msg, sp) -> None:
        seq = m.metadata.sequence.stream
        delivery = self.ledger.deliver(seq)
        if delivery is Delivery.REDELIVERED:
            return  # the first delivery is acked with its step
        if delivery is Delivery.USED:
            await m.ack()
            return
        traj = await self.bus.decode_or_dead_letter(m, Trajectory)
        if traj is None:
            return
        sp.set_attributes({"ot.episode_id": traj.episode_id, "ot.step": traj.step,
                           "ot.policy_version": traj.policy_version, "ot.reward": traj.reward})
        if self.evaluator.claims(traj):
            await self.on_eval_trajectory(traj, m)
            return
        if not self.ledger.admit(traj.step, traj.group_index, next_step=self.step):
            await m.ack()  # late (its step is trained) or not part of this job: nothing to do
            return
        spec = self.spec
        rid = self.ledger.current_request_id(traj.step, traj.group_index)
        try:
            if traj.job_id != self.job_id:
                raise ValueError(f"Trajectory.job_id: {traj.job_id!r} on {self.job_id}'s subject")
            if traj.group_size != spec.group_size:
                raise ValueError(f"Trajectory.group_size: {traj.group_size} != the job's {spec.group_size}")
            if bool(traj.agent) != (spec.agents > 1):
                raise ValueError(f"Trajectory.agent: {traj.agent!r} in a job with agents = {spec.agents}")
            if traj.policy_of != spec.opponents.get(traj.agent, ""):
                raise ValueError(f"Trajectory.policy_of: {traj.policy_of!r} for seat {traj.agent!r}; the job's "
                                 f"opponents are {spec.opponents}")
            check_trajectory(traj, self.engine.vocab_size)
            if spec.teacher != "none" and not traj.error and any(traj.loss_mask) and not traj.teacher_logprobs:
                raise ValueError(f"Trajectory.teacher_logprobs: none, in a job taught by teacher = {spec.teacher!r}")
        except ValueError as e:
            await self.bus.dead_letter(m, str(e))
            await m.term()
            if traj.request_id == rid:
                await self.drop_group(traj.step, traj.group_index, "invalid")
            return
        if not self.ledger.hold(seq, traj.step, traj.request_id, traj.episode_id, Held(traj, m)):
            await m.ack()  # a duplicate episode, or more than the group needs
            return
        if traj.request_id == rid and not self.lag_ok(traj):
            await self.drop_group(traj.step, traj.group_index, "stale")

    async def check_group(self, s: int, i: int, since_s: float) -> None:
        """Ask again for group `i` of step `s` if its current attempt is missing
        episodes `rollout_timeout_s` after it was asked for (`since_s` if this run did
        not ask), or is complete but stale, or every episode of it failed."""
        spec = self.spec
        group = self.ledger.group(s, i)
        if len(group) < spec.group_trajectories:
            waited = time.monotonic() - self.ledger.asked_at(s, i, since_s)
            if waited > spec.rollout_timeout_s:
                await self.drop_group(s, i, f"timeout: {len(group)} of {spec.group_trajectories} episodes "
                                            f"{waited:.0f} s after asking (is a rollout worker serving it? "
                                            "see ot.dlq.rollout)")
        elif (fault := self.group_fault(group)) == "stale":
            await self.drop_group(s, i, "stale")
        elif fault == "failed":
            first = group[0].traj.error
            if first.startswith(SEATS_MISMATCH) and all(h.traj.error == first for h in group):
                # the spec's seat count does not fit the env: no retry can mend that
                raise RuntimeError(f"env {spec.env!r} does not fit the spec: {first[:500]}")
            if first.startswith(TEACHER_MISMATCH) and all(h.traj.error == first for h in group):
                raise RuntimeError(f"the teacher cannot score this job's tokens: {first[:500]}")
            await self.drop_group(s, i, f"every episode failed: {first[:500]}")
        elif fault == "invalid":
            await self.drop_group(s, i, "invalid")
        elif self.refill_due(s, i, group):
            await self.refill_group(s, i)

    def group_fault(self, group: list[Held], version: int | None = None) -> str | None:
        """Why a complete group cannot be trained at `version` (default: the current):
        "stale" (lag_ok), "failed" (every episode errored), "invalid" (seats), or None."""
        if not all(self.lag_ok(h.traj, version) for h in group):
            return "stale"
        if all(h.traj.error for h in group):
            return "failed"
        if not seats_complete([h.traj for h in group], self.spec.group_size):
            return "invalid"
        return None

    async def follow_placement(self) -> None:
        """After the scheduler announced a change that does not stop this run: when
        rollout workers of the job left the pool (the scheduler's fail_over keeps the
        attempt with the survivors), send every later request to the survivors and ask
        there again for each group whose current attempt went to a lost worker and is
        not complete (its episodes from the lost worker are dropped with the attempt).
        A requeue or a newer attempt is left to on_event and the fence."""
        self.placement_changed.clear()
        try:
            got = await self.bus.job_record(self.job_id)
        except msgspec.MsgspecError:
            return
        p = got[0].placement if got is not None and got[0].attempt == self.attempt else None
        if p is None or not p.rollout or p.rollout == self.rollout_workers:
            return
        lost = [w for w in self.rollout_workers if w not in p.rollout]
        self.rollout_workers = list(p.rollout)
        log.warning("job %s: rollout worker %s left the pool; asking its open groups again on %s",
                    self.job_id, ", ".join(lost) or "-", ", ".join(self.rollout_workers))
        for (s, i), w in sorted(self.asked_on.items()):
            if w in lost and s >= self.step and len(self.ledger.group(s, i)) < self.spec.group_trajectories:
                await self.drop_group(s, i, f"rollout worker {w} left the pool")
        # evaluation episodes the lost workers owe: the same requests, to the survivors
        # (a new message id, else JetStream would drop them as repeats)
        answered = {t.request_id for got in self.evaluator.pending.values() for t in got.values()}
        for n, (rid, (req, w)) in enumerate(sorted(self.eval_asked_on.items())):
            if w in lost and req.step in self.evaluator.pending and rid not in answered:
                worker = self.rollout_worker(n)
                self.eval_asked_on[rid] = (req, worker)
                await self.bus.publish(S.rollout(self.job_id, worker), req,
                                       msg_id=f"{self.publish_id(rid)}-{worker}")

    def refill_due(self, s: int, i: int, group: list[Held]) -> bool:
        """Dynamic sampling (DAPO, arXiv 2503.14476 §3.2: "over-sample and filter out
        prompts with the accuracy equal to 1 and 0"): is the complete group `i` of step
        `s` without signal (every reward equal, so every advantage 0) while the step
        may still replace one (spec.dynamic_sampling) and the group has attempts to
        spare (half of MAX_ATTEMPTS stays for failures)?"""
        step_refills = sum(self.refill_index.get((s, j), 0) for j in range(self.spec.prompts_per_step))
        rewards: dict[str, set[float]] = {}
        for h in group:
            rewards.setdefault(h.traj.agent, set()).add(h.traj.reward)
        return (all(len(r) == 1 for r in rewards.values())
                and step_refills < self.spec.dynamic_sampling
                and self.ledger.attempt(s, i) < MAX_ATTEMPTS // 2)

    async def refill_group(self, s: int, i: int) -> None:
        """Replace group `i` of step `s` by a new attempt on a fresh prompt (its group
        seed derives from the refill's index); the old attempt's episodes are acked
        and never trained, but their rewards count in the step's reward_mean. A resumed
        run forgets the indices: a group it has to ask again goes back to its first prompt."""
        dropped = self.ledger.drop(s, i)
        stats = self.stats if s == self.step else self.ahead_stats.setdefault(s, StepStats())
        stats.refilled_rewards += [h.traj.reward for h in dropped]
        for held in dropped:
            await held.msg.ack()
        self.refill_index[(s, i)] = self.refill_index.get((s, i), 0) + 1
        stats.refilled += 1
        await self.request_group(s, i)

    async def while_training(self, training: asyncio.Future) -> Any:
        """Await `training` (a step's update on the engine thread); meanwhile, in an async
        job with dynamic sampling, take in later steps' trajectories and replace their
        groups without signal (refill_ahead), so the rollout samples the replacements
        beside the update (AReaL, arXiv 2505.24298, overlaps generation and training).
        Raises what `training` raises; an error here waits for the engine thread first."""
        if not (self.spec.dynamic_sampling and self.spec.max_staleness >= 1):
            return await training
        try:
            while not training.done():
                for m in await self.bus.fetch(self.sub, TRAJ_FETCH, AHEAD_FETCH_S):
                    await self.on_trajectory(m)
                # this step's update is version + 1: step s trains at version + (s - step)
                for s in range(self.step + 1, self.requested_upto + 1):
                    for i in range(self.spec.prompts_per_step):
                        await self.refill_ahead(s, i, self.version + s - self.step)
        except BaseException:  # the engine finishes first; the update's own error is dropped
            await asyncio.wait([training])
            if not training.cancelled():
                training.exception()
            raise
        return await training

    async def refill_ahead(self, s: int, i: int, version: int) -> None:
        """Replace group `i` of later step `s` (trained at policy version `version`) if
        it is complete, trainable at that version (group_fault) and without signal
        (refill_due); anything else about it is check_group's, when its step comes."""
        group = self.ledger.group(s, i)
        if (len(group) == self.spec.group_trajectories and self.group_fault(group, version) is None
                and self.refill_due(s, i, group)):
            await self.refill_group(s, i)

    async def wait_for_step(self) -> list[list[Held]]:
        """Fetch trajectories until every group of `self.step` is complete and fresh.
        A group missing `rollout_timeout_s` after it was asked for, or whose every
        episode failed, is asked again (drop_group; raises RuntimeError past
        MAX_ATTEMPTS)."""
        t0 = time.monotonic()
        s = self.step
        while True:
            self.check_live()
            if self.placement_changed.is_set():
                await self.follow_placement()
            for i in range(self.spec.prompts_per_step):
                await self.check_group(s, i, t0)
            # a dropped attempt leaves its group incomplete: complete is also fresh
            if self.ledger.complete(s):
                break
            for m in await self.bus.fetch(self.sub, TRAJ_FETCH, 1.0):
                await self.on_trajectory(m)
        self.stats.wait_s = time.monotonic() - t0
        return [by_seat(self.ledger.group(s, i)) for i in range(self.spec.prompts_per_step)]

    # -- evaluation -------------------------------------------------------------

    async def maybe_evaluate(self) -> None:
        """Ask for an evaluation of the current policy if one is due (evaluation.py)."""
        if not self.evaluator.due(self.version):
            return
        await self.fence()
        for i, req in enumerate(self.evaluator.requests(self.version)):
            worker = self.rollout_worker(i)
            self.eval_asked_on[req.request_id] = (req, worker)
            await self.bus.publish(S.rollout(self.job_id, worker), req, msg_id=self.publish_id(req.request_id))
        log.info("job %s: evaluating policy version %d on %d %s episodes", self.job_id, self.version,
                 self.spec.eval_episodes, self.spec.eval_split)

    async def on_eval_trajectory(self, traj: Trajectory, m: Msg) -> None:
        await m.ack()  # an eval episode is only reported, never trained on
        metrics = self.evaluator.add(traj)
        if metrics is not None:
            for rid in [r for r, (req, _) in self.eval_asked_on.items() if req.step == metrics.policy_version]:
                del self.eval_asked_on[rid]
            await self.drop_unkept_weights()
            await self.bus.publish(self.subject("metrics"), metrics,
                                   msg_id=f"{self.job_id}-eval-m{metrics.policy_version}-r{self.run_id}")
            log.info("job %s eval at policy version %d: reward %.3f, correct %.3f",
                     self.job_id, metrics.policy_version, metrics.values["reward_mean"],
                     metrics.values["correct_frac"])

    async def wait_for_evaluations(self) -> None:
        deadline = time.monotonic() + FINAL_EVAL_WAIT_S
        while self.evaluator.pending and time.monotonic() < deadline:
            self.check_live()
            if self.placement_changed.is_set():
                await self.follow_placement()
            for m in await self.bus.fetch(self.sub, TRAJ_FETCH, 1.0):
                await self.on_trajectory(m)
        if self.evaluator.pending:
            log.warning("job %s: evaluations of versions %s did not finish within %.0f s",
                        self.job_id, sorted(self.evaluator.pending), FINAL_EVAL_WAIT_S)

    # -- training ---------------------------------------------------------------

    def _train_blocking(self, trajs: list[Trajectory]) -> dict[str, float]:
        """The step's plan (step.plan_step: advantages, skipped and excluded episodes,
        updates, micro-batches, learning rates), then its optimizer updates
        (engine.train_step). Returns the engine's metrics and the plan's stats."""
        with tracing.span("learner.batch", attrs={"ot.episodes": len(trajs)}):
            plan = plan_step(trajs, self.spec, self.step, self.engine.pad_id,
                             lambda batches: self.engine.sequence_logprobs(batches, reference=True),
                             getattr(self.engine, "values", None))  # a critic's (critic.ActorCritic)
        with torch_threads(self.async_threads()):
            train = self.engine.train_critic if plan.critic_only else self.engine.train_step
            out = train(plan.micro_batches, plan.updates, plan.totals, plan.lrs)
        return {**out, **plan.stats}

    def async_threads(self) -> int:
        """The thread count this job's steps train with (0: unchanged): the setting
        learner_async_threads for an asynchronous job on a CPU engine in this process."""
        cpu = getattr(self.engine, "device", "") == "cpu"  # a RankGroup's ranks are processes of their own
        return self.settings.learner_async_threads if cpu and self.spec.max_staleness >= 1 else 0

    async def train(self, groups: list[list[Held]]) -> None:
        with tracing.span("learner.step", attrs={"ot.job_id": self.job_id, "ot.step": self.step}):
            await self._train(groups)

    async def _train(self, groups: list[list[Held]]) -> None:
        t_start = time.monotonic() - self.stats.wait_s
        held = [h for g in groups for h in g]
        trajs = [h.traj for h in held]
        t0 = time.monotonic()
        out = await self.while_training(asyncio.ensure_future(self.in_engine(self._train_blocking, trajs)))
        train_s = time.monotonic() - t0
        self.check_live()  # a job cancelled mid-step publishes nothing more
        s = self.step
        self.version += 1
        self.step += 1
        t_w = time.monotonic()
        await self.publish_weights()
        self.weights_s = time.monotonic() - t_w
        for h in self.ledger.take_step(s):
            await h.msg.ack()  # a dropped attempt's late arrivals
        for i in range(self.spec.prompts_per_step):
            self.refill_index.pop((s, i), None)
        if self.checkpoint_due():
            await self.checkpoint_step(s)
        for h in held:
            await h.msg.ack()
        step_s = time.monotonic() - t_start
        await self.publish_metrics(s, trajs, out, train_s, step_s)
        log.info("job %s step %d: reward %.3f loss %.4f grad_norm %.4f (%.1f s train, %.1f s wait)",
                 self.job_id, s, statistics.fmean(t.reward for t in trajs), out["loss"],
                 out["grad_norm"], train_s, self.stats.wait_s)
        self.stats = self.ahead_stats.pop(self.step, None) or StepStats()

    async def publish_metrics(self, s: int, trajs: list[Trajectory], out: dict[str, float],
                              train_s: float, step_s: float) -> None:
        gen_tokens = sum(sum(t.loss_mask) for t in trajs)
        values = {
            **episode_stats(trajs),  # reward_mean/std, correct_frac, lengths, turns, error_frac, episodes
            # reward_mean over the dynamic-sampling groups replaced too; reward_mean_kept without
            **self.stats.reward_means([t.reward for t in trajs]),
            **seat_stats(trajs),     # reward_mean/<seat> of a multi-agent job
            **lag_stats(trajs),      # policy_lag_mean/max
            **token_stats(out),      # kl, entropy, clip_frac, ...: none for a step that forwarded no token
            "loss": out["loss"],
            "grad_norm": out["grad_norm"],
            "tokens_per_s": gen_tokens / max(step_s, 1e-9),
            "step_time_s": step_s,
            "train_time_s": train_s,
            "wait_time_s": self.stats.wait_s,
            "dropped_stale": float(self.stats.dropped_stale),
            "dropped_invalid": float(self.stats.dropped_invalid),
            "dropped_error": float(self.stats.dropped_error),
            "timed_out": float(self.stats.timed_out),
            "refilled": float(self.stats.refilled),
            "failed_over": float(self.stats.failed_over),
            "excluded_frac": out["excluded_frac"],
            # on-policy distillation: the per-token reverse KL to the teacher (step.distill)
            **({"teacher_kl": out["teacher_kl"]} if "teacher_kl" in out else {}),
            # no wasted compute: groups without signal, episodes not forwarded at all
            "zero_variance_frac": out["zero_variance_frac"],
            "skipped_frac": out["skipped_frac"],
            "lr": out["lr"],
            "updates": out["updates"],
            "fwd_bwd_s": out["fwd_bwd_s"],
            "optimizer_s": out["optimizer_s"],
            "weights_s": self.weights_s,
            "learner_ranks": float(self.engine.world_size),
        }
        await self.step_done(s, values, list(dict.fromkeys(t.request_id for t in trajs)))

    async def checkpoint_step(self, s: int) -> None:
        """Checkpoint after step `s` with the trajectory-stream position, then forget
        the sequences it covers."""
        stream = self.ledger.meta(s)
        await self.save_checkpoint(s, stream)
        self.ledger.prune(stream["traj_floor"])
