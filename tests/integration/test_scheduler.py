"""Scheduler + SDK against a real nats-server, the scheduler as a real subprocess."""

import asyncio

import pytest

from opentinker.schemas import JobAssigned, JobState, decode
from opentinker.schemas import subjects as S
from opentinker.schemas.job import SpecError
from opentinker.sdk import Client, JobFailed

from opentinker.schemas.pool import WorkerCapacity
from opentinker.services.core.pool import Heartbeat


async def until_a_scheduler_answers(c, subject: str = S.SUBMIT) -> None:
    """Wait (up to ~70 s) until a scheduler answers a submit on `subject`."""
    for _ in range(100):
        try:
            await c.bus.nc.request(subject, b"", timeout=0.5)
            return
        except Exception:
            await asyncio.sleep(0.2)


@pytest.fixture
async def client(services, nats_url):
    services.start("scheduler")
    c = await Client.connect(nats_url)
    await until_a_scheduler_answers(c)
    yield c
    await c.close()


async def test_bad_spec_refused_naming_the_field(client):
    # a range the type system cannot catch, checked by the scheduler itself: send the raw
    # command past the SDK's own local validation
    import msgspec

    raw = msgspec.msgpack.encode({"spec": {"group_size": 1, "env": "arith"}})
    reply = await client.bus.nc.request(S.SUBMIT, raw, timeout=5)
    from opentinker.schemas import SubmitReply

    r = decode(reply.data, SubmitReply)
    assert not r.ok and r.field == "group_size" and "group_size" in r.error

    raw = msgspec.msgpack.encode({"spec": {"lr": "fast"}})
    r = decode((await client.bus.nc.request(S.SUBMIT, raw, timeout=5)).data, SubmitReply)
    assert not r.ok and r.field == "lr"

    with pytest.raises(SpecError) as e:
        await client.submit({"env": "arith", "sampling": {"temperature": -1.0}})
    assert e.value.field == "sampling.temperature"


async def test_submit_records_assigns_and_cancels(client, bus, job_id, services):
    job = await client.submit({"env": "arith", "steps": 3}, job_id=job_id)
    assert job.id == job_id
    rec = await job.record()
    assert rec.state == JobState.QUEUED and rec.spec.steps == 3

    # no worker in the pool: the job waits. Then a learner and a rollout worker join
    # (this test plays their part with their heartbeats) and the job is placed on them
    await asyncio.sleep(1.5)
    assert (await job.record()).placement is None
    sub = await bus.durable(S.Durable(S.STREAM_CTL, f"peek-{job_id}", S.assign_learner(f"l-{job_id}")))
    beats = [Heartbeat(bus, kind, f"{kind[0]}-{job_id}", services.pool, WorkerCapacity(slots=1), list)
             for kind in ("learner", "rollout")]
    for b in beats:
        await b.start()
    try:
        msgs = await bus.fetch(sub, 1, 10)
        assert msgs, f"no assignment\n{services.logs()}"
        a = decode(msgs[0].data, JobAssigned)
        assert a.job_id == job_id and a.rollout_workers == [f"r-{job_id}"] and a.attempt == 1
        await msgs[0].ack()  # taken, as a learner would
        rec = await job.record()
        assert rec.placement.learner == f"l-{job_id}" and rec.placement.rollout == [f"r-{job_id}"]
    finally:
        for b in beats:
            await b.stop()

    # attach by id from a second client, cancel, and wait
    other = await Client.connect(client.bus.nc.connected_url.geturl())
    try:
        reply = await other.job(job_id).cancel("test")
        assert reply.ok
        with pytest.raises(JobFailed, match="cancelled"):
            await other.job(job_id).wait(timeout_s=10)
    finally:
        await other.close()
    again = await job.cancel()
    assert not again.ok and "already cancelled" in again.error

    # a duplicate job id is refused naming the field
    with pytest.raises(SpecError) as e:
        await client.submit({"env": "arith"}, job_id=job_id)
    assert e.value.field == "job_id"


async def test_scheduler_restart_keeps_jobs(services, client, job_id):
    job = await client.submit({"env": "arith", "steps": 2}, job_id=job_id)
    name, proc = services.procs[0]
    proc.terminate()
    proc.wait(10)
    services.start("scheduler")
    rec = await job.record()
    assert rec.job_id == job_id and rec.state == JobState.QUEUED
    for _ in range(50):
        try:
            reply = await job.cancel()
            break
        except Exception:
            await asyncio.sleep(0.2)
    assert reply.ok


def test_sync_client_and_cli(services, nats_url, job_id):
    """The notebook API and the CLI reach the same jobs."""
    import subprocess
    import sys
    import time

    from opentinker.sdk import SyncClient

    services.start("scheduler")
    sc = SyncClient(nats_url)
    try:
        for _ in range(100):
            try:
                job = sc.submit({"env": "arith", "steps": 2}, job_id=job_id)
                break
            except Exception:
                time.sleep(0.2)
        assert job.record().state == JobState.QUEUED
        assert job_id in [r.job_id for r in sc.jobs()]
        cli = [sys.executable, "-m", "opentinker.cli", "--nats-url", nats_url]
        out = subprocess.run([*cli, "jobs"], capture_output=True, text=True, check=True).stdout
        assert job_id in out and "queued" in out
        out = subprocess.run([*cli, "cancel", job_id], capture_output=True, text=True)
        assert out.returncode == 0 and "cancelled" in out.stdout
        rec = job.wait(timeout_s=10, raise_on_failure=False)
        assert rec.state == JobState.CANCELLED
    finally:
        sc.close()


async def test_a_submit_naming_a_pool_is_taken_by_that_pools_scheduler_alone(services, nats_url):
    """Two pools' schedulers on one NATS: a client naming a pool (`pool=`, else
    $OPENTINKER_POOL) has its jobs recorded in that pool, every time; a pool with no
    scheduler fails at once. (On the plain `ot.ctl.submit`, which both schedulers also
    answer, a submit lands in either pool.)"""
    import nats

    pools = (services.pool, services.pool + "-b")
    for pool in pools:
        services.start("scheduler", env={"OPENTINKER_POOL": pool})
    clients = {pool: await Client.connect(nats_url, pool=pool) for pool in pools}
    jobs = []
    try:
        for pool, c in clients.items():
            await until_a_scheduler_answers(c, S.submit_subject(pool))
        for _ in range(6):
            for pool, c in clients.items():
                job = await c.submit({"env": "arith", "steps": 2})
                jobs.append(job)
                assert (await job.record()).pool == pool
        nowhere = await Client.connect(nats_url, pool=services.pool + "-none")
        try:
            with pytest.raises(nats.errors.NoRespondersError):
                await nowhere.submit({"env": "arith", "steps": 2}, timeout_s=5)
        finally:
            await nowhere.close()
        with pytest.raises(ValueError, match="invalid worker id"):
            await Client.connect(nats_url, pool="a.b")
    finally:
        for job in jobs:
            await job.cancel()
        for c in clients.values():
            await c.close()
