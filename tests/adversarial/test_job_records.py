"""Job records are bounded, tried by user bob as a hostile tenant would while user alice's
job trains (the shared stack of tests/tenants.py):

- a burst of parallel submits, over the REST API and `ot.ctl.submit` at once, gets no
  more unfinished jobs past `max_unfinished_jobs_per_user` (before: the count was read
  outside the scheduler's lock, so every submit of a burst passed the same count);
- a submit-then-cancel loop leaves only the newest `finished_jobs_per_user` finished
  records of his (before: every record was kept for ever, and re-read every second and
  at every NATS connect).

Each attack ends in an answer naming the limit, and no service exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from nats.js.errors import NotFoundError

from opentinker.schemas import SubmitJob, SubmitReply
from opentinker.schemas import subjects as S
from opentinker.schemas.job import spec_from_dict

from tenants import FINISHED_KEPT as FINISHED_PER_USER, MAX_UNFINISHED, World, alice_completed, alice_trains, bearer

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
async def alice(world):
    """Alice's job, training while this module's attacks run (her first may be over)."""
    return await alice_trains(world, "alice-records", 8)

FINISHED = ("completed", "failed", "cancelled")
LOOP = FINISHED_PER_USER + 5
RETENTION_WAIT_S = 120  # the scheduler deletes finished records every 60 s


def unplaceable(w: World, name: str) -> dict:
    """A job the pool can never hold (two rollout workers; it has one): it stays queued."""
    return {"name": name, "model": w.tiny_model, "env": "arith", "rollout_workers": 2}


async def bobs_jobs(w: World) -> list[dict]:
    r = await w.api.get("/v1/jobs", headers=bearer(w.bob_key))
    assert r.status_code == 200, r.text
    return r.json()


async def answering(w: World, pool: str) -> None:
    """Wait until `pool`'s scheduler answers on its submit subject (an empty submit,
    refused); AssertionError with the services' logs after 60 s."""
    for _ in range(300):
        with contextlib.suppress(Exception):
            await w.service.nc.request(S.submit_subject(pool), b"", timeout=0.5)
            return
        await asyncio.sleep(0.2)
    raise AssertionError(w.services.logs())


def nothing_exited(w: World) -> None:
    assert all(code is None for code in w.alive().values()), (w.alive(), w.services.logs())


async def test_a_burst_of_parallel_submits_gets_no_more_than_the_unfinished_jobs_limit(world, alice):
    already = sum(1 for j in await bobs_jobs(world) if j["state"] not in FINISHED)
    room = max(0, MAX_UNFINISHED - already)
    body = {"spec": unplaceable(world, "bob-burst")}
    rest = [world.api.post("/v1/jobs", json=body, headers=bearer(world.bob_key)) for _ in range(9)]
    cmd = SubmitJob(spec=spec_from_dict(unplaceable(world, "bob-burst"), "train"), api_key=world.bob_key)
    over_nats = [world.service.request(S.SUBMIT, cmd, SubmitReply, timeout_s=30) for _ in range(3)]
    answers = await asyncio.gather(*rest, *over_nats)
    accepted, refusals = [], []
    for a in answers:
        if isinstance(a, SubmitReply):
            (accepted.append(a.job_id) if a.ok else refusals.append((a.field, a.error)))
        elif a.status_code == 201:
            accepted.append(a.json()["job_id"])
        else:
            assert a.status_code == 409, a.text
            refusals.append((a.json()["detail"].get("field"), a.json()["detail"]["error"]))
    try:
        # bob's jobs from earlier tests may end meanwhile (more room), none start
        assert room <= len(accepted) <= MAX_UNFINISHED, (already, accepted, refusals)
        assert len(refusals) == len(answers) - len(accepted)
        for field, error in refusals:
            assert field == "job_id" and "max_unfinished_jobs_per_user" in error, (field, error)
        unfinished = [j for j in await bobs_jobs(world) if j["state"] not in FINISHED]
        assert len(unfinished) <= MAX_UNFINISHED, unfinished
    finally:
        for job_id in accepted:
            r = await world.api.post(f"/v1/jobs/{job_id}/cancel", json={"reason": "burst over"},
                                     headers=bearer(world.bob_key))
            assert r.status_code == 200, r.text
    nothing_exited(world)


async def test_a_burst_over_two_pools_schedulers_gets_no_more_than_the_unfinished_jobs_limit(world, alice):
    """The limit counts a user's jobs in every pool: a burst split between this pool's
    scheduler (REST) and another pool's (its own submit subject) passes no more than it
    (before: each scheduler counted under a lock of its own process, and the two let
    each other's submits through)."""
    other = world.services.pool + "-b"
    b = world.services.start("scheduler", "api_port=0", env={**world.env, "OPENTINKER_POOL": other})
    accepted: list[str] = []
    try:
        cmd = SubmitJob(spec=spec_from_dict(unplaceable(world, "bob-pools"), "train"), api_key=world.bob_key)
        await answering(world, other)
        already = sum(1 for j in await bobs_jobs(world) if j["state"] not in FINISHED)  # none in the other
        body = {"spec": unplaceable(world, "bob-pools")}
        for _ in range(10):  # rounds of 20 submits; at c3c7ade, 3 runs of 3 each let a fourth job through
            rest = [world.api.post("/v1/jobs", json=body, headers=bearer(world.bob_key)) for _ in range(10)]
            over_nats = [world.service.request(S.submit_subject(other), cmd, SubmitReply, timeout_s=30)
                         for _ in range(10)]
            for a in await asyncio.gather(*rest, *over_nats):
                if isinstance(a, SubmitReply):
                    assert a.ok or "max_unfinished_jobs_per_user" in a.error, a
                    accepted += [a.job_id] if a.ok else []
                else:
                    assert a.status_code in (201, 409), a.text
                    accepted += [a.json()["job_id"]] if a.status_code == 201 else []
            # (the REST API lists its own pool's jobs: the count is of the answers)
            assert len(accepted) == MAX_UNFINISHED - already, (already, accepted)
            for job_id in accepted:
                r = await world.api.post(f"/v1/jobs/{job_id}/cancel", json={"reason": "burst over"},
                                         headers=bearer(world.bob_key))
                assert r.status_code == 200, r.text
            accepted.clear()
    finally:
        for job_id in accepted:
            await world.api.post(f"/v1/jobs/{job_id}/cancel", json={"reason": "burst over"},
                                 headers=bearer(world.bob_key))
        b.terminate()
        await asyncio.to_thread(b.wait, 30)
    nothing_exited(world)


async def test_a_submit_that_outlives_its_lease_on_the_users_lock_writes_nothing(world):
    """A scheduler whose submits hold the user's lock past their lease (here
    submit_lease_s=0: every one) refuses them instead of writing after the lock's TTL
    may have let another scheduler count the same jobs."""
    from opentinker.schemas import JobRecord
    from opentinker.schemas.codec import decode

    other = world.services.pool + "-lease"
    b = world.services.start("scheduler", "api_port=0", "submit_lease_s=0", env={**world.env, "OPENTINKER_POOL": other})
    try:
        await answering(world, other)
        cmd = SubmitJob(spec=spec_from_dict(unplaceable(world, "bob-lease"), "train"), api_key=world.bob_key)
        reply = await world.service.request(S.submit_subject(other), cmd, SubmitReply, timeout_s=30)
        assert not reply.ok and reply.field == "job_id" and "took too long" in reply.error, reply
        records = [decode(v, JobRecord) for v, _ in (await world.service.kv_values(S.KV_JOBS)).values()]
        assert not [r for r in records if r.spec.name == "bob-lease"]
        assert b.poll() is None
    finally:
        b.terminate()
        await asyncio.to_thread(b.wait, 30)
    nothing_exited(world)


async def test_a_submit_then_cancel_loop_keeps_only_the_newest_finished_records(world, alice):
    loop: list[str] = []
    for i in range(LOOP):
        r = await world.api.post("/v1/jobs", json={"spec": unplaceable(world, f"bob-loop-{i}")},
                                 headers=bearer(world.bob_key))
        assert r.status_code == 201, r.text
        loop.append(r.json()["job_id"])
        r = await world.api.post(f"/v1/jobs/{loop[-1]}/cancel", json={"reason": "loop"}, headers=bearer(world.bob_key))
        assert r.status_code == 200, r.text
    # objects of the first and the last job of the loop (as a learner would have stored)
    for job_id in (loop[0], loop[-1]):
        await world.service.put_object(S.OBJ_WEIGHTS, f"{job_id}/v1", b"weights")
        await world.service.put_object(S.OBJ_CHECKPOINTS, f"{job_id}/latest", b"checkpoint")
    deadline = time.monotonic() + RETENTION_WAIT_S
    while True:
        finished = [j["job_id"] for j in await bobs_jobs(world) if j["state"] in FINISHED]
        if len(finished) <= FINISHED_PER_USER:
            break
        assert time.monotonic() < deadline, (f"bob still has {len(finished)} finished job records after "
                                             f"{RETENTION_WAIT_S} s", world.services.logs())
        await asyncio.sleep(2)
    # the oldest of the loop are gone, records and all; the newest stays
    for job_id in loop[:LOOP - FINISHED_PER_USER]:
        r = await world.api.get(f"/v1/jobs/{job_id}", headers=bearer(world.bob_key))
        assert r.status_code == 404 and r.json()["detail"]["error"] == f"no job {job_id}", r.text
    assert loop[-1] in finished, finished
    # with their objects; those of a job kept stay
    for bucket, name in ((S.OBJ_WEIGHTS, "v1"), (S.OBJ_CHECKPOINTS, "latest")):
        with pytest.raises(NotFoundError):
            await world.service.get_object(bucket, f"{loop[0]}/{name}")
        assert await world.service.get_object(bucket, f"{loop[-1]}/{name}")
    # the deletion names the limit (the scheduler's log)
    logs = "".join(p.read_text() for p in world.services.log_dir.glob("scheduler-*.log"))
    assert f"finished_jobs_per_user = {FINISHED_PER_USER}" in logs, logs[-4000:]
    # alice's job, and its record, are untouched
    r = await world.api.get(f"/v1/jobs/{world.a_job}", headers=bearer(world.alice_key))
    assert r.status_code == 200 and r.json()["user"] == "alice", r.text
    nothing_exited(world)


async def test_zz_alices_job_completed_meanwhile(world, alice):
    await alice_completed(world, alice)
