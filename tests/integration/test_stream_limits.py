"""Streams and KV buckets are bounded on a real nats-server, and a dead letter of any
size bad message fits the dead-letter stream."""

import asyncio
import logging

import pytest
from nats.js.api import DeliverPolicy, DiscardPolicy
from nats.js.errors import APIError

from opentinker.schemas import DeadLetter, JobState, JobStateChanged, Metrics, decode
from opentinker.schemas import subjects as S
from opentinker.services.core.bus import DLQ_PAYLOAD_BYTES, Bus

KiB, MiB = 1024, 1024 * 1024


async def core_message(b: Bus, subject: str, data: bytes):
    """One core NATS message on `subject` as a subscriber receives it (a Msg)."""
    got: asyncio.Queue = asyncio.Queue()

    async def cb(m):
        await got.put(m)

    sub = await b.nc.subscribe(subject, cb=cb)
    await b.nc.publish(subject, data)
    m = await asyncio.wait_for(got.get(), 5)
    await sub.unsubscribe()
    return m


async def test_every_stream_has_the_limits_of_its_table(bus):
    assert set(S.STREAM_LIMITS) == set(S.STREAMS)
    for name, (_, retention) in S.STREAMS.items():
        lim = S.STREAM_LIMITS[name]
        cfg = (await bus.js.stream_info(name)).config
        assert cfg.max_msg_size == lim.max_msg_size > 0, name
        assert cfg.max_bytes == lim.max_bytes > 0, name
        assert cfg.max_age == pytest.approx(lim.max_age_s), name
        assert cfg.max_msgs_per_subject == lim.max_msgs_per_subject, name
        # an over-full work queue refuses new work; a log forgets its oldest entries
        assert cfg.discard == (DiscardPolicy.NEW if retention == "workqueue" else DiscardPolicy.OLD), name
        assert cfg.duplicate_window == pytest.approx(120.0), name
    assert S.STREAM_LIMITS["OT_EVENTS"].max_msg_size == 256 * KiB
    assert S.STREAM_LIMITS["OT_TRAJ"].max_msg_size == 4 * MiB
    assert S.STREAM_LIMITS["OT_DLQ"].max_age_s == 7 * 86400
    for bucket in (S.KV_JOBS, S.KV_WORKERS, S.KV_USERS, S.KV_KEYS):
        assert (await bus.js.stream_info(f"KV_{bucket}")).config.max_msg_size == S.KV_MAX_VALUE_BYTES


async def test_an_over_size_message_is_refused_by_the_server(bus, job_id):
    subj = S.job(job_id, "events")
    ev = JobStateChanged(job_id=job_id, state=JobState.RUNNING, reason="r" * (200 * KiB))
    assert not (await bus.publish(subj, ev)).duplicate  # under the limit
    with pytest.raises(APIError, match="maximum"):
        await bus.publish(subj, JobStateChanged(job_id=job_id, state=JobState.RUNNING, reason="r" * (256 * KiB)))
    with pytest.raises(APIError, match="maximum"):
        await bus.js.publish(subj, b"x" * (256 * KiB + 1))
    kv = await bus.kv(S.KV_JOBS)
    with pytest.raises(APIError, match="maximum"):
        await kv.put(f"{job_id}-big", b"x" * (S.KV_MAX_VALUE_BYTES + 1))


async def test_existing_streams_and_buckets_get_the_limits(bus):
    # as a stream made before the limits existed: no limits at all
    for name in ("OT_DLQ", "OT_ROLLOUT"):
        cfg = (await bus.js.stream_info(name)).config
        cfg.max_msg_size, cfg.max_bytes, cfg.max_age, cfg.max_msgs_per_subject = -1, -1, 0, -1
        cfg.discard, cfg.discard_new_per_subject = DiscardPolicy.OLD, False
        await bus.js.update_stream(cfg)
    kv_cfg = (await bus.js.stream_info(f"KV_{S.KV_JOBS}")).config
    kv_cfg.max_msg_size = -1
    await bus.js.update_stream(kv_cfg)
    assert (await bus.js.stream_info("OT_DLQ")).config.max_msg_size == -1

    # what an operator with a bigger disk sets (Settings.stream_max_bytes_scale)
    await bus.ensure_topology(max_bytes_scale=2.0, max_age_scale=0.5)
    cfg = (await bus.js.stream_info("OT_DLQ")).config
    lim = S.STREAM_LIMITS["OT_DLQ"]
    assert (cfg.max_msg_size, cfg.max_bytes) == (lim.max_msg_size, 2 * lim.max_bytes)
    assert cfg.max_age == pytest.approx(lim.max_age_s / 2)
    cfg = (await bus.js.stream_info("OT_ROLLOUT")).config
    assert cfg.discard == DiscardPolicy.NEW and cfg.discard_new_per_subject
    assert (await bus.js.stream_info(f"KV_{S.KV_JOBS}")).config.max_msg_size == S.KV_MAX_VALUE_BYTES

    await bus.ensure_topology()  # back to the defaults
    assert (await bus.js.stream_info("OT_DLQ")).config.max_bytes == lim.max_bytes
    with pytest.raises(ValueError, match="max_bytes_scale"):
        await bus.ensure_topology(max_bytes_scale=0)


async def test_a_huge_bad_message_is_dead_lettered_truncated_and_terminated(bus, job_id):
    """A 3 MiB undecodable trajectory (OT_TRAJ holds up to 4 MiB; OT_DLQ 1 MiB) is
    dead-lettered with its first 64 KiB, and the consume loop goes on."""
    subj = S.job(job_id, "traj")
    payload = b"\xc1" + b"z" * (3 * MiB)
    await bus.js.publish(subj, payload, headers={"Big": "h" * (20 * KiB), "Small": "s"})
    await bus.publish(S.job(job_id, "metrics"), Metrics(job_id=job_id, step=0, policy_version=0))
    dlq = await bus.durable(S.Durable(S.STREAM_DLQ, f"dlq-{job_id}", S.dead_letter("test")),
                            deliver_policy=DeliverPolicy.NEW)
    sub = await bus.durable(S.Durable(S.STREAM_TRAJ, f"c-{job_id}", subj))
    stop = asyncio.Event()

    async def handle(item, raw):
        raise AssertionError("an undecodable message reached the handler")

    task = asyncio.create_task(bus.consume(sub, Metrics, handle, stop, timeout_s=0.5))
    recs: list[DeadLetter] = []
    for _ in range(20):
        recs += [decode(m.data, DeadLetter) for m in await bus.fetch(dlq, 5, 0.5)]
        if any(r.subject == subj for r in recs):
            break
    stop.set()
    await asyncio.wait_for(task, 10)  # the loop neither died nor hung
    (rec,) = [r for r in recs if r.subject == subj]
    assert rec.truncated and rec.payload_bytes == len(payload)
    assert rec.payload == payload[:DLQ_PAYLOAD_BYTES]
    assert rec.headers["Small"] == "s" and len(rec.headers["Big"]) < 20 * KiB
    info = await bus.js.consumer_info("OT_TRAJ", f"c-{job_id}")
    assert info.num_pending == 0 and info.num_ack_pending == 0  # terminated, never redelivered


async def test_a_small_bad_message_is_kept_whole(bus, job_id):
    m = await core_message(bus, f"core.{job_id}", b"\xc1 small")
    dlq = await bus.durable(S.Durable(S.STREAM_DLQ, f"dlq-{job_id}", S.dead_letter("test")),
                            deliver_policy=DeliverPolicy.NEW)
    await bus.dead_letter(m, "bad")
    recs = [decode(x.data, DeadLetter) for x in await bus.fetch(dlq, 5, 2)]
    (rec,) = [r for r in recs if r.subject == f"core.{job_id}"]
    assert (rec.payload, rec.payload_bytes, rec.truncated) == (b"\xc1 small", 7, False)


async def test_a_dead_letter_that_cannot_be_published_is_logged_not_raised(nats_url, job_id, caplog):
    b = await Bus.connect(nats_url, "test")
    m = await core_message(b, f"core.{job_id}", b"\xc1")
    await b.nc.close()
    with caplog.at_level(logging.ERROR, logger="opentinker.bus"):
        await b.dead_letter(m, "bad")  # the connection is gone: logged, not raised
    assert any("could not dead-letter" in r.getMessage() for r in caplog.records)
