"""Listing a KV bucket whole (Bus.kv_values): every live key with its value and revision,
never a partial answer, while other clients write.

A consumer with DeliverPolicy LAST_PER_SUBJECT delivers each key's last message as of
its creation, then every later message. Its num_pending is not a count of the keys to
come: on a bucket with history 1 (the worker pool's heartbeats) a key rewritten while
the consumer is made loses the message the consumer meant to deliver, and nats-server
answered num_pending 5 for 6 live keys, at times 1. A listing that stopped at that count
missed a live key in 1 to 6 of 100 listings of 6-8 keys each rewritten every 2 ms
(tests/integration/test_kv_listing.py), and the scheduler once requeued a job off a
worker that beat on time.

So the keys come from the stream itself: after making the consumer, the stream's
subjects (STREAM.INFO with subjects_filter; paged past the server's 100,000 a page) are
the keys to wait for. Each one present then is delivered by the consumer (its last
message as of the consumer's creation, or a later one: every later message is delivered
in order), unless it is deleted first (its TTL ran out, a purge): a read that stalls
asks the stream again and stops waiting for the keys gone.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import nats
from nats.js import api
from nats.js.errors import APIError, NotFoundError

# a fetch that waits this long for a delivery counts as stalled (the keys are checked again)
FETCH_WAIT_S = 5.0
FETCH_BATCH = 256


async def stream_subjects(nc: Any, stream: str, subjects_filter: str) -> set[str]:
    """The subjects of `stream` matching `subjects_filter` that hold a message now (a
    KV bucket's keys, delete markers included). Raises nats.js.errors.APIError (its
    NotFoundError for a stream that does not exist) and nats.errors.TimeoutError."""
    out: set[str] = set()
    while True:
        req = json.dumps({"subjects_filter": subjects_filter, "offset": len(out)}).encode()
        resp = json.loads((await nc.request(f"$JS.API.STREAM.INFO.{stream}", req, timeout=10)).data)
        if "error" in resp:
            raise APIError.from_error(resp["error"])
        page = (resp.get("state") or {}).get("subjects") or {}
        out.update(page)
        if not page or len(out) >= int(resp.get("total") or 0):
            return out


async def kv_values_once(nc: Any, js: Any, bucket: str, prefix: str = "") -> dict[str, tuple[bytes, int]]:
    """One listing of KV bucket `bucket` (the keys starting with `prefix`): key ->
    (value, revision), the keys whose last operation is a delete or purge left out.
    Raises nats.errors.TimeoutError when a key the stream still holds is not delivered
    within FETCH_WAIT_S (Bus.kv_values starts over), and what stream_subjects raises."""
    stream, base = f"KV_{bucket}", f"$KV.{bucket}."
    filt = f"{base}{prefix}>" if prefix else f"{base}>"
    sub = await js.pull_subscribe(filt, stream=stream, config=api.ConsumerConfig(
        deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT, ack_policy=api.AckPolicy.NONE,
        inactive_threshold=10.0, mem_storage=True))
    out: dict[str, tuple[bytes, int]] = {}
    name = ""
    try:
        name = (await sub.consumer_info()).name
        waiting = await stream_subjects(nc, stream, filt)  # after the consumer: each is delivered
        latest: dict[str, int] = {}
        while waiting:
            try:
                msgs = await sub.fetch(FETCH_BATCH, timeout=FETCH_WAIT_S)
            except nats.errors.TimeoutError:
                waiting &= await stream_subjects(nc, stream, filt)  # deleted meanwhile: not coming
                if waiting:
                    raise
                break
            for m in msgs:
                seq = m.metadata.sequence.stream
                waiting.discard(m.subject)
                if seq < latest.get(m.subject, 0):
                    continue
                latest[m.subject] = seq
                key = m.subject[len(base):]
                if (m.headers or {}).get("KV-Operation") in ("DEL", "PURGE") or not m.data:
                    out.pop(key, None)
                else:
                    out[key] = (m.data, seq)
    finally:
        with contextlib.suppress(nats.errors.Error, NotFoundError):
            await sub.unsubscribe()
            if name:  # else the server drops it after inactive_threshold
                await js.delete_consumer(stream, name)
    return out
