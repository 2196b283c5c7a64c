"""The scheduler counts a worker lost only when two listings of the pool's heartbeats
miss it: one listing once missed a rollout worker that beat on time, and its job was
requeued between two placements on that same worker (a CI run's upstream ALFWorld
test). A worker that is really gone still costs its job at once."""

import time

from opentinker.schemas import JobRecord, JobSpec, JobState
from opentinker.schemas import subjects as S
from opentinker.schemas.pool import Placement, WorkerCapacity
from opentinker.services.core.config import Settings
from opentinker.services.core.pool import Heartbeat
from opentinker.services.scheduler import service


async def test_a_worker_one_listing_misses_keeps_its_job_and_a_gone_one_loses_it(bus, job_id, monkeypatch):
    pool = f"p-{job_id}"
    sched = service.Scheduler(bus, Settings(pool=pool))
    sched._trust_after = 0.0  # the pool's heartbeats are trusted (no reconnect just now)
    beats = [Heartbeat(bus, kind, wid, pool, WorkerCapacity(slots=1), list)
             for kind, wid in (("learner", "l1"), ("rollout", "r1"))]
    for b in beats:
        await b.start()
    listings = []
    real = service.live_workers

    async def first_misses_r1(b, p):
        live = await real(b, p)
        listings.append(sorted(live))
        return {w: i for w, i in live.items() if w != "r1" or len(listings) > 1}

    monkeypatch.setattr(service, "live_workers", first_misses_r1)
    placed = Placement(attempt=1, learner="l1", rollout=["r1"], placed_s=time.time())
    rev = await sched.put(JobRecord(job_id=job_id, spec=JobSpec(), state=JobState.RUNNING, pool=pool,
                                    placement=placed), None)
    try:
        await sched.reconcile()
        (rec, got), = [(r, v) for r, v in await sched.records() if r.job_id == job_id]
        assert (rec.state, rec.placement, got) == (JobState.RUNNING, placed, rev), rec
        assert listings == [["l1", "r1"], ["l1", "r1"]]  # asked twice, as r1 looked lost once
        # r1 really gone (its heartbeat deleted, as a stopped worker's): requeued at once
        await beats[1].stop()
        await sched.reconcile()
        (rec, _), = [(r, v) for r, v in await sched.records() if r.job_id == job_id]
        assert rec.state == JobState.QUEUED and rec.placement is None and "r1 left the pool" in rec.reason, rec
    finally:
        for b in beats:
            await b.stop()
        await (await bus.kv(S.KV_JOBS)).purge(job_id)
