"""Placement: which queued jobs start now, and on which workers. Pure functions of the
job records and the live workers; the scheduler service applies what they decide.

Policy: fair share across users, then first in, first out by submit time, with
per-user quotas. The next job considered is always the oldest queued job of the user
whose placed jobs hold the fewest workers now (re-ranked after each placement), so a
user with many queued jobs never keeps another user's job behind them (no head-of-line
blocking by one user). A job over its user's quota waits without holding up other
users' jobs, and so does a training job whose user already holds their share of the
pool's learner slots (`learner_share`, at least one slot) while another user's training
job waits for a learner; with nobody else waiting, a user may use every free learner.
The first job that does not fit the free capacity stops placement for this round, so a
large job is never starved by smaller ones behind it (that job is of the least-served
user, whom the capacity freed next goes to). A job the whole pool could not hold even
when idle (more rollout workers than it has, or no learner at all) waits without
stopping the round: otherwise one tenant's impossible job would stall every job behind
it. A training job takes one free learner offering its `learner_ranks` (data-parallel
ranks on that learner's host) and `rollout_workers` rollout workers with a free slot; an
inference job takes rollout workers only. Among
rollout workers, those already serving the job's base model come first (LoRA jobs of
one base model share a worker and its engine, each with its own adapter), then the
least loaded. Every round starts from the records, so a freed worker is used at the
next round (no stall after capacity frees up).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from opentinker.schemas import JobRecord, RolloutRequest
from opentinker.schemas.pool import Placement, WorkerInfo
from opentinker.schemas.stats import derived_seed


@dataclass(frozen=True)
class Quota:
    """A user's limits: jobs placed at once, workers those jobs hold in all, and the
    share of the pool's learner slots they may hold while others wait for one."""

    max_jobs: int
    max_workers: int
    learner_share: float = 1.0


def rollout_needed(rec: JobRecord) -> int:
    """Rollout workers a job holds: `spec.rollout_workers`, none for SFT (no sampling)."""
    return 0 if rec.kind == "train" and rec.spec.algorithm in ("sft", "tinker") else rec.spec.rollout_workers


def workers_needed(rec: JobRecord) -> int:
    """Workers a job holds: one learner (training jobs) plus its rollout workers."""
    return (1 if rec.kind == "train" else 0) + rollout_needed(rec)


def holders(rec: JobRecord) -> list[str]:
    """The workers of a job's current placement ([] if it has none)."""
    p = rec.placement
    if p is None:
        return []
    return ([p.learner] if p.learner else []) + list(p.rollout)


def lost_workers(rec: JobRecord, live: dict[str, WorkerInfo]) -> list[str]:
    """The workers of a placed job that are no longer in the pool."""
    return [w for w in holders(rec) if w not in live]


def lost_by_job(recs: list[JobRecord], live: dict[str, WorkerInfo]) -> dict[int, list[str]]:
    """{index into `recs`: its lost workers} for each unfinished job that has one."""
    lost = {i: lost_workers(r, live) for i, r in enumerate(recs) if not r.state.terminal}
    return {i: names for i, names in lost.items() if names}


def without_lost_rollout(rec: JobRecord, lost: list[str]) -> Placement | None:
    """The placement a training job keeps when only some of its rollout workers are
    lost: the same attempt and learner, the surviving rollout workers (in order); its
    learner asks the lost workers' groups again on those. None when the job must be
    requeued instead: its learner is lost, no rollout worker survives, or it is an
    inference job (its endpoint names one worker)."""
    p = rec.placement
    if p is None or rec.kind != "train" or not lost or p.learner in lost:
        return None
    kept = [w for w in p.rollout if w not in lost]
    if not kept:
        return None
    return Placement(attempt=p.attempt, learner=p.learner, rollout=kept, placed_s=p.placed_s)


@dataclass
class Load:
    """What the placed (active) jobs hold."""

    learners: Counter = field(default_factory=Counter)
    rollout: Counter = field(default_factory=Counter)
    models: dict[str, set[str]] = field(default_factory=dict)
    user_jobs: Counter = field(default_factory=Counter)
    user_workers: Counter = field(default_factory=Counter)
    user_learners: Counter = field(default_factory=Counter)

    def add(self, rec: JobRecord, p: Placement) -> None:
        if p.learner:
            self.learners[p.learner] += 1
            self.user_learners[rec.user] += 1
        for w in p.rollout:
            self.rollout[w] += 1
            self.models.setdefault(w, set()).add(rec.spec.model)
        self.user_jobs[rec.user] += 1
        self.user_workers[rec.user] += workers_needed(rec)


def current_load(active: list[JobRecord]) -> Load:
    load = Load()
    for rec in active:
        if rec.placement is not None:
            load.add(rec, rec.placement)
    return load


def _supports(info: WorkerInfo, engine: str) -> bool:
    return engine == "auto" or not info.capacity.engines or engine in info.capacity.engines


def plan(queued: list[JobRecord], active: list[JobRecord], live: dict[str, WorkerInfo],
         quota_of, now_s: float) -> list[tuple[JobRecord, Placement]]:
    """Placements for the queued jobs that can start now, in submit order.

    `queued`: records without a placement; `active`: placed, non-terminal records;
    `live`: the pool's live workers by id; `quota_of(user) -> Quota`. A worker still
    reporting a queued job among its `jobs` (a requeued job's old learner that has not
    let go yet) keeps that job waiting.
    """
    load = current_load(active)
    busy_with = {j for info in live.values() for j in info.jobs}
    learner_slots = sum(i.capacity.slots for i in live.values() if i.kind == "learner")
    wants_learner = Counter(r.user for r in queued if r.kind == "train")
    out = []
    left = sorted(queued, key=lambda r: (r.created_s, r.job_id))
    while left:
        # the oldest job of the user holding the fewest workers (min is stable: oldest first)
        rec = min(left, key=lambda r: load.user_workers[r.user])
        left.remove(rec)
        q = quota_of(rec.user)
        need = workers_needed(rec)
        if load.user_jobs[rec.user] + 1 > q.max_jobs or load.user_workers[rec.user] + need > q.max_workers:
            continue  # over quota: waits, and holds up no one else
        others_wait = len(wants_learner) - (rec.user in wants_learner) > 0
        if rec.kind == "train" and others_wait and \
                load.user_learners[rec.user] + 1 > max(1, int(q.learner_share * learner_slots)):
            continue  # over its user's share of learners while another user waits for one
        if rec.job_id in busy_with:
            continue  # the last attempt's worker is still letting go
        could_ever = [w for w, i in live.items() if i.kind == "rollout" and _supports(i, rec.spec.engine)]
        ranks = rec.spec.learner_ranks
        if len(could_ever) < rollout_needed(rec) or (rec.kind == "train" and not any(
                i.kind == "learner" and i.capacity.ranks >= ranks for i in live.values())):
            continue  # the pool cannot hold it even idle: it waits and blocks no one
        learner = ""
        if rec.kind == "train":
            free = sorted(w for w, i in live.items() if i.kind == "learner"
                          and load.learners[w] < i.capacity.slots and i.capacity.ranks >= ranks)
            if not free:
                break
            learner = free[0]
        model = rec.spec.model
        cands = [w for w, i in live.items() if i.kind == "rollout" and load.rollout[w] < i.capacity.slots
                 and _supports(i, rec.spec.engine)]
        cands.sort(key=lambda w: (model not in load.models.get(w, ()), load.rollout[w], w))
        n = rollout_needed(rec)
        if len(cands) < n:
            break
        p = Placement(attempt=rec.attempt + 1, learner=learner, rollout=cands[:n], placed_s=now_s)
        load.add(rec, p)
        out.append((rec, p))
        if rec.kind == "train" and not any(r.user == rec.user and r.kind == "train" for r in left):
            wants_learner.pop(rec.user, None)
    return out


def inference_requests(rec: JobRecord, p: Placement) -> list[RolloutRequest]:
    """The rollout requests of an inference job's plan (JobRecord.plan), at placement
    `p`: group g of `episodes // group_size` is `<job>-g<g>`, seeded
    derived_seed("infer", seed, g) as sdk/infer.py does, sampled by the plan's policy
    version (1: the trained job's policy the scheduler re-announced; 0: the base model)."""
    plan, spec = rec.plan, rec.spec
    assert plan is not None
    return [RolloutRequest(job_id=rec.job_id, request_id=f"{rec.job_id}-g{g}", step=0, group_index=g,
                           group_seed=derived_seed("infer", plan.seed, g), policy_version=plan.policy_version,
                           model=spec.model, sampler_dtype=spec.sampler_dtype,
                           env=spec.env, env_args=dict(spec.env_args), group_size=plan.group_size,
                           sampling=plan.sampling, engine=spec.engine, split=plan.split, purpose="inference",
                           agents=plan.agents, attempt=p.attempt)
            for g in range(plan.episodes // plan.group_size)]
