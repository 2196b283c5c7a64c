"""Which finished job records the scheduler deletes (settings `job_retention_days`,
`finished_jobs_per_user`), and their deletion. The scheduler (service.py,
`forget_finished`, every RETENTION_EVERY_S) reads the records, asks `expired_records`
(pure), and deletes each one it names with the job's objects (`forget_jobs`).

Without this, records grew without bound (a submit-then-cancel loop counted against
nothing) and every one of them was re-read each placement round and at every NATS
connect (the auth callout's grant).
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING

from nats.js.errors import NotFoundError

from opentinker.schemas import JobRecord
from opentinker.schemas import subjects as S

if TYPE_CHECKING:
    from opentinker.services.core.bus import Bus

log = logging.getLogger("opentinker.scheduler")

DAY_S = 86_400.0


def named_jobs(recs: Iterable[JobRecord]) -> set[str]:
    """The jobs that unfinished records depend on: a `tinker_init` source
    (`<job>/<checkpoint>`), an `init_from` job, the `opponents` whose policies play a
    seat and a distillation `teacher_job`."""
    out: set[str] = set()
    for r in recs:
        if not r.state.terminal:
            out.update(r.spec.opponents.values())
            if r.spec.tinker_init:
                out.add(r.spec.tinker_init.partition("/")[0])
            if r.spec.init_from:
                out.add(r.spec.init_from)
            if r.spec.teacher_job:
                out.add(r.spec.teacher_job)
    return out


def expired_records(recs: Iterable[JobRecord], now: float, days: float, per_user: int,
                    in_use: Iterable[str] = ()) -> list[JobRecord]:
    """The finished records (COMPLETED, FAILED, CANCELLED) of `recs` to delete at unix time
    `now`: those last changed (`updated_s`) more than `days` ago, and those past the newest
    `per_user` finished records of their user (newest by `updated_s`, when it finished).
    `days` or `per_user` <= 0: no such limit. An unfinished record is never named, nor a
    job in `in_use` or named by an unfinished record of `recs` (named_jobs). Oldest first."""
    recs = list(recs)
    keep = named_jobs(recs) | set(in_use)
    finished = sorted((r for r in recs if r.state.terminal),
                      key=lambda r: (r.updated_s, r.created_s, r.job_id), reverse=True)
    seen: dict[str, int] = defaultdict(int)
    out = []
    for r in finished:
        seen[r.user] += 1
        too_old = days > 0 and now - r.updated_s > days * DAY_S
        too_many = per_user > 0 and seen[r.user] > per_user
        if (too_old or too_many) and r.job_id not in keep:
            out.append(r)
    return out[::-1]


async def forget_jobs(bus: "Bus", jobs: list[tuple[str, int]]) -> tuple[int, int]:
    """Delete each job of `jobs` (job id, KV revision of its record read): its objects
    (`<job>/...` in the weights and checkpoints object stores), its weight events and
    rollout work, then its record. The record's key is purged up to that revision, never
    past it (a record written since stays), so no delete marker and no old revision is
    left to be re-read. A job that fails is logged and left for the next round. Returns
    (jobs deleted, objects deleted)."""
    stores = {b: await object_names(bus, b) for b in (S.OBJ_WEIGHTS, S.OBJ_CHECKPOINTS)}
    await bus.kv(S.KV_JOBS)
    deleted = objects = 0
    for job_id, rev in jobs:
        try:
            for bucket, names in stores.items():
                for name in (n for n in names if n.startswith(f"{job_id}/")):
                    await bus.delete_object(bucket, name)
                    objects += 1
            await bus.purge_subject(S.STREAM_ROLLOUT, S.rollout_all(job_id))
            await bus.purge_subject(S.STREAM_WEIGHTS, S.job(job_id, "weights"))
            await bus.js.purge_stream(f"KV_{S.KV_JOBS}", seq=rev + 1, subject=f"$KV.{S.KV_JOBS}.{job_id}")
        except Exception as e:  # the next round tries it again
            log.warning("could not delete finished job %s: %s", job_id, e)
        else:
            deleted += 1
    return deleted, objects


async def object_names(bus: "Bus", bucket: str) -> list[str]:
    """The names of the objects in store `bucket` (deleted ones left out)."""
    store = await bus.objects(bucket)
    try:
        infos = await asyncio.wait_for(store.list(ignore_deletes=True), 60)
    except NotFoundError:  # nats-py: an empty store
        return []
    return [i.name for i in infos]
