"""The bus against a real nats-server: dedup, ack-after-work, dead letters."""

import asyncio


from opentinker.schemas import DeadLetter, Metrics, decode
from opentinker.schemas import subjects as S


async def test_publish_dedups_by_msg_id(bus, job_id):
    m = Metrics(job_id=job_id, step=0, policy_version=0, values={"x": 1.0})
    a = await bus.publish(S.job(job_id, "metrics"), m, msg_id=f"{job_id}-m0")
    b = await bus.publish(S.job(job_id, "metrics"), m, msg_id=f"{job_id}-m0")
    assert b.duplicate and not a.duplicate


async def test_undecodable_goes_to_dead_letter_and_consumer_continues(bus, job_id):
    subj = S.job(job_id, "metrics")
    await bus.js.publish(subj, b"\xc1not msgpack")
    await bus.publish(subj, Metrics(job_id=job_id, step=1, policy_version=1))
    dlq = await bus.durable(S.Durable(S.STREAM_DLQ, f"dlq-{job_id}", S.dead_letter("test")),
                            deliver_policy=__import__("nats").js.api.DeliverPolicy.NEW)
    sub = await bus.durable(S.Durable(S.STREAM_METRICS, f"c-{job_id}", subj))
    got: list[Metrics] = []
    stop = asyncio.Event()

    async def handle(m, raw):
        got.append(m)
        stop.set()

    await asyncio.wait_for(bus.consume(sub, Metrics, handle, stop), 10)
    assert [m.step for m in got] == [1]
    msgs = await bus.fetch(dlq, 5, 5)
    recs = [decode(m.data, DeadLetter) for m in msgs]
    assert any(r.subject == subj and "Metrics" in r.reason for r in recs)


async def test_delete_object_removes_it_and_a_missing_one_is_no_error(bus, job_id):
    import pytest
    from nats.js.errors import ObjectNotFoundError

    name = f"{job_id}/v0"
    await bus.put_object(S.OBJ_WEIGHTS, name, b"weights")
    assert await bus.get_object(S.OBJ_WEIGHTS, name) == b"weights"
    await bus.delete_object(S.OBJ_WEIGHTS, name)
    with pytest.raises(ObjectNotFoundError):
        await bus.get_object(S.OBJ_WEIGHTS, name)
    await bus.delete_object(S.OBJ_WEIGHTS, name)  # already gone: nothing to do
    await bus.delete_object(S.OBJ_WEIGHTS, f"{job_id}/never")


async def test_purge_subject_drops_that_subject_only_and_a_missing_stream_is_no_error(bus, job_id):
    mine, other = S.job(job_id, "metrics"), S.job(f"{job_id}-o", "metrics")
    for subj in (mine, other):
        await bus.publish(subj, Metrics(job_id=job_id, step=0, policy_version=0))
    await bus.purge_subject(S.STREAM_METRICS, mine)
    assert await bus.read_subject(mine, Metrics) == []
    assert len(await bus.read_subject(other, Metrics)) == 1
    await bus.purge_subject("NO_SUCH_STREAM", mine)


async def test_a_worker_whose_consumer_the_scheduler_deleted_gets_its_next_assignment(bus, job_id):
    """A worker that missed heartbeats (a CPU-starved learner) is dropped from the pool and
    its assignments consumer deleted (scheduler.forget_worker); when it beats again the
    scheduler places work on it. Its fetch loop, subscribed with `recreate=True`, must
    create the consumer again and receive that work (before, every fetch failed with
    ServiceUnavailableError for as long as the process lived)."""
    d = S.assignments_durable(f"w-{job_id}")
    sub = await bus.durable(d, recreate=True)
    await bus.delete_durable(d)  # the scheduler forgets the worker
    await bus.purge_subject(d.stream, d.subject)
    await bus.publish(d.subject, Metrics(job_id=job_id, step=7, policy_version=0))  # placed again
    got = []
    for _ in range(10):
        got += await bus.fetch(sub, 1, 1.0)
        if got:
            break
    assert [decode(m.data, Metrics).step for m in got] == [7]
    await bus.delete_durable(d)
