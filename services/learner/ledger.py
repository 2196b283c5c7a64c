"""The trajectory bookkeeping of one GRPO run on the learner, with no I/O: which
trajectories it holds for which step and group, which stream sequences it has seen
or trained on, each group's attempt, and the stream position a checkpoint records.
job.py does the NATS side around it (decoding, acks, rollout requests).

Terms. A step trains `prompts_per_step` groups (GRPO, arXiv 2402.03300) of
`group_size` episodes. A group whose current attempt is dropped (stale, invalid,
failed, timed out) is asked for again: a new attempt with a new request id
(`request_id`). A trajectory is known by its OT_TRAJ stream sequence (`seq`), its
step, its request id (one attempt of one group, asked by one learner run) and its
episode id; only the current attempt of this run's request counts toward a group.

Stream position (checkpoint.py). Every sequence <= `floor` was consumed or discarded
before the last checkpoint; `used` lists the sequences above it that trained a
checkpointed step. A resumed run replays from floor + 1 and skips `used`, so it
neither loses nor repeats a trajectory. In a checkpoint's metadata these are the
keys "traj_floor", "traj_used" and "attempts" (the attempt of every group of the
steps after the checkpointed one).

StepStats counts what the run dropped or asked again while it waited for a step.
"""

from __future__ import annotations

import enum
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

H = TypeVar("H")  # what the caller keeps per trajectory (job.py: the message, to ack)


def request_id(job_id: str, step: int, group_index: int, attempt: int, run: str = "") -> str:
    """`<job>-s<step>-g<group>`, plus `-a<n>` when a dropped group is asked again, plus
    `-r<run>` for the learner run asking (unique per run: episode ids and the stream's
    deduplication ids derive from it)."""
    base = f"{job_id}-s{step}-g{group_index}"
    if attempt:
        base += f"-a{attempt}"
    return f"{base}-r{run}" if run else base


def no_stream_meta() -> dict[str, Any]:
    """The checkpoint keys of a run that reads no trajectories (SFT): nothing consumed."""
    return {"traj_floor": 0, "traj_used": [], "attempts": {}}


class Delivery(enum.Enum):
    """What a delivery of a stream sequence is to this run."""

    NEW = "new"                  # first seen: decode it and offer it
    REDELIVERED = "redelivered"  # seen before and still held: its first delivery is acked with its step
    USED = "used"                # trained a checkpointed step (a resume): ack it, never train on it again


class TrajectoryLedger(Generic[H]):
    """Held trajectories, seen and used stream sequences, and group attempts of one
    run of job `job_id` (learner run `run`, see request_id) with `steps` steps of
    `prompts_per_step` groups of `group_size` episodes."""

    def __init__(self, job_id: str, run: str, steps: int, prompts_per_step: int, group_size: int):
        self.job_id = job_id
        self.run = run
        self.steps = steps
        self.prompts_per_step = prompts_per_step
        self.group_size = group_size
        self.floor = 0
        self.attempts: dict[int, list[int]] = {}  # step -> each group's current attempt
        # step -> request id -> episode id -> (seq, item), in arrival order
        self.held: dict[int, dict[str, dict[str, tuple[int, H]]]] = {}
        self.seen: set[int] = set()   # delivered this run
        self.skip: set[int] = set()   # used by a checkpointed step of a lost run (restore)
        self.used: set[int] = set()   # trained on by this run
        self.asked_s: dict[tuple[int, int], float] = {}  # (step, group) -> when its attempt was asked

    # -- requests ---------------------------------------------------------------

    def open(self, step: int) -> None:
        """Start counting the attempts of `step`'s groups (idempotent)."""
        self.attempts.setdefault(step, [0] * self.prompts_per_step)

    def attempt(self, step: int, group_index: int) -> int:
        """The current attempt of a group (0: the first). KeyError for a step not open."""
        return self.attempts[step][group_index]

    def current_request_id(self, step: int, group_index: int) -> str:
        """The request id of a group's current attempt by this run."""
        return request_id(self.job_id, step, group_index, self.attempt(step, group_index), self.run)

    def ask(self, step: int, group_index: int, now_s: float) -> None:
        """Record that the group's current attempt was asked for at `now_s` (monotonic)."""
        self.asked_s[(step, group_index)] = now_s

    def asked_at(self, step: int, group_index: int, default_s: float) -> float:
        """When the group's current attempt was asked for, or `default_s` if not by this run."""
        return self.asked_s.get((step, group_index), default_s)

    def drop(self, step: int, group_index: int) -> list[H]:
        """Discard the group's current attempt and start the next; returns the items
        it held (for the caller to ack)."""
        rid = self.current_request_id(step, group_index)
        dropped = [item for _, item in self.held.get(step, {}).pop(rid, {}).values()]
        self.attempts[step][group_index] += 1
        return dropped

    # -- trajectories -----------------------------------------------------------

    def deliver(self, seq: int) -> Delivery:
        """Note a delivery of stream sequence `seq` (before decoding it)."""
        if seq in self.seen:
            return Delivery.REDELIVERED
        self.seen.add(seq)
        return Delivery.USED if seq in self.skip else Delivery.NEW

    def admit(self, step: int, group_index: int, next_step: int) -> bool:
        """Is a trajectory of (step, group) still wanted, `next_step` being the next
        step to train? False: its step is trained, or it is no step or group of the
        job. True opens the step: a step not asked for yet is possible after a resume
        (the lost run asked)."""
        if not (next_step <= step < self.steps and 0 <= group_index < self.prompts_per_step):
            return False
        self.open(step)
        return True

    def hold(self, seq: int, step: int, request_id: str, episode_id: str, item: H) -> bool:
        """Keep a trajectory of an admitted step until the step is trained. False (not
        kept) for an episode already held or one more than its group needs."""
        group = self.held.setdefault(step, {}).setdefault(request_id, {})
        if episode_id in group or len(group) >= self.group_size:
            return False
        group[episode_id] = (seq, item)
        return True

    def group(self, step: int, group_index: int) -> list[H]:
        """The items held for the group's current attempt, in arrival order."""
        rid = self.current_request_id(step, group_index)
        return [item for _, item in self.held.get(step, {}).get(rid, {}).values()]

    def complete(self, step: int) -> bool:
        """Does every group of `step` hold `group_size` episodes of its current attempt?"""
        return all(len(self.group(step, i)) >= self.group_size for i in range(self.prompts_per_step))

    def take_step(self, step: int) -> list[H]:
        """Forget `step` once it is trained: its groups' current attempts become used
        (a checkpoint records them). Returns every other item held for it (late
        arrivals of dropped attempts, another run's) for the caller to ack."""
        current = {self.current_request_id(step, i) for i in range(self.prompts_per_step)}
        rest = []
        for rid, group in self.held.pop(step, {}).items():
            for seq, item in group.values():
                if rid in current:
                    self.used.add(seq)
                else:
                    rest.append(item)
        for i in range(self.prompts_per_step):
            self.asked_s.pop((step, i), None)
        return rest

    # -- checkpoints ------------------------------------------------------------

    def position(self) -> tuple[int, list[int]]:
        """(floor, used above floor): every sequence <= floor is consumed or discarded;
        held trajectories of later steps stay above the floor, to be replayed."""
        pending = [seq for by_request in self.held.values() for group in by_request.values()
                   for seq, _ in group.values()]
        floor = (min(pending) - 1) if pending else max(self.seen, default=self.floor)
        floor = max(floor, self.floor)
        return floor, sorted(q for q in (self.used | self.skip) if q > floor)

    def meta(self, step: int) -> dict[str, Any]:
        """The checkpoint keys of this ledger after training `step`: the stream
        position and the attempts of later steps."""
        floor, used = self.position()
        return {"traj_floor": floor, "traj_used": used,
                "attempts": {k: list(v) for k, v in self.attempts.items() if k > step}}

    def restore(self, meta: dict[str, Any]) -> None:
        """Continue from a checkpoint's keys (as `meta` wrote them): the stream replays
        from its floor, and the sequences it used are skipped."""
        self.floor = meta["traj_floor"]
        self.skip = set(meta["traj_used"])
        self.attempts = {int(k): list(v) for k, v in meta["attempts"].items()}

    def prune(self, floor: int) -> None:
        """A checkpoint at `floor` is stored: forget the sequences at or below it."""
        self.floor = floor
        self.used = {q for q in self.used if q > floor}
        self.seen = {q for q in self.seen if q > floor}
        self.skip = {q for q in self.skip if q > floor}


@dataclass
class StepStats:
    """What a run dropped or asked again while it waited for one step (its metrics)."""

    dropped_stale: int = 0
    dropped_invalid: int = 0
    dropped_error: int = 0   # groups whose every episode ended on an error
    timed_out: int = 0       # groups asked again after rollout_timeout_s
    refilled: int = 0        # zero-variance groups replaced by a fresh prompt (dynamic_sampling)
    failed_over: int = 0     # groups asked again because their rollout worker left the pool
    wait_s: float = 0.0
    # the episode rewards of the groups replaced by dynamic sampling: sampled, not trained
    refilled_rewards: list[float] = field(default_factory=list)

    def reward_means(self, trained: Sequence[float]) -> dict[str, float]:
        """`reward_mean` over every episode sampled for the step, the trained ones
        (`trained`, their rewards) and those of the groups dynamic sampling replaced,
        and `reward_mean_kept` over the trained ones (0.0 for none). Dynamic sampling
        (DAPO, arXiv 2503.14476 §3.2) replaces the groups whose rewards are all equal,
        all solved as often as all failed; the mean of the kept groups alone is not the
        policy's reward (on a task it mostly solves, it reads lower; on one it mostly
        fails, higher), and it moves with how many groups were replaced."""
        sampled = [*trained, *self.refilled_rewards]
        return {"reward_mean": statistics.fmean(sampled) if sampled else 0.0,
                "reward_mean_kept": statistics.fmean(trained) if trained else 0.0}


def by_seat(held: list[H]) -> list[H]:
    """A complete group's items in training order: by seat, then by episode (a
    single-agent group's seat is "" for all), so each seat of a multi-agent group is a
    block of group_size consecutive items. Items have `.traj` (a Trajectory)."""
    return sorted(held, key=lambda h: (h.traj.agent, h.traj.episode_id))


def seats_complete(trajs: list[Any], group_size: int) -> bool:
    """Does every seat of a complete group hold exactly `group_size` trajectories (one
    per game)? False for a group mixing seat counts, which cannot be split into
    per-seat GRPO groups."""
    counts: dict[str, int] = {}
    for t in trajs:
        counts[t.agent] = counts.get(t.agent, 0) + 1
    return all(n == group_size for n in counts.values())
