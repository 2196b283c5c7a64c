"""The NATS JetStream client every service uses.

- `Bus.connect` then `ensure_topology` creates every stream, KV bucket and object
  store in `schemas.subjects` idempotently (safe to call from every process).
- `publish` sets `Nats-Msg-Id` (JetStream deduplication), the schema name, the
  content type and a W3C `traceparent`.
- `consume` runs a durable pull consumer: each message is decoded to its schema and
  handed to the handler; it is acked only after the handler returns. A message that
  cannot be decoded goes to `ot.dlq.<service>` with the reason, is terminated, and the
  loop goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import nats
from nats.aio.msg import Msg
from nats.js import api
from nats.js.errors import BadRequestError, NotFoundError

from opentinker.schemas import DeadLetter, JobRecord, decode, encode, schema_name
from opentinker.schemas import subjects as S
from opentinker.services.core import tracing

log = logging.getLogger("opentinker.bus")
T = TypeVar("T", bound=msgspec.Struct)

# Weights and checkpoints go through the object store in large chunks: with the
# default 128 KiB chunks a get of tens of MB is slow (DESIGN.md, measured).
OBJ_CHUNK_BYTES = 4 * 1024 * 1024
DUPLICATE_WINDOW_S = 120.0


def new_traceparent() -> str:
    """A fresh W3C trace-context `traceparent` (version 00, sampled)."""
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


def child_traceparent(parent: str | None) -> str:
    """Same trace id as `parent` with a new span id; a new trace if parent is unusable."""
    parts = (parent or "").split("-")
    if len(parts) == 4 and len(parts[1]) == 32:
        return f"00-{parts[1]}-{secrets.token_hex(8)}-{parts[3]}"
    return new_traceparent()


def _episode_attr(msg: Any) -> dict[str, str]:
    """`ot.episode_id` for a span about a message that names an episode."""
    eid = getattr(msg, "episode_id", "")
    return {"ot.episode_id": eid} if eid else {}


def _overlap(a: str, b: str) -> bool:
    """Whether NATS subjects/wildcards `a` and `b` can match a common subject."""
    ta, tb = a.split("."), b.split(".")
    for i in range(max(len(ta), len(tb))):
        x = ta[i] if i < len(ta) else None
        y = tb[i] if i < len(tb) else None
        if x == ">" or y == ">":
            return x is not None and y is not None
        if x is None or y is None:
            return False
        if x != y and "*" not in (x, y):
            return False
    return True


def default_nats_url(url: str | None = None) -> str:
    """`url`, else $NATS_URL, else nats://127.0.0.1:4222."""
    return url or os.environ.get("NATS_URL") or "nats://127.0.0.1:4222"


def streams_of(subject: str) -> list[str]:
    """The streams (schemas.subjects.STREAMS) that can hold messages on `subject`."""
    return [stream for stream, (subjects, _) in S.STREAMS.items() if any(_overlap(subject, x) for x in subjects)]


def service_credentials(url: str) -> dict[str, str]:
    """nats.connect arguments of the service identity (natsauth.py): `$NATS_NKEY` (an
    nkey seed file), `$NATS_CREDS` (a creds file), or, when `url` is the NATS of the
    local `opentinker up` stack, that stack's service nkey (named in
    `<home>/stack.json`; only its owner can read it). {} when there is none."""
    import json
    from pathlib import Path

    from opentinker.services.core.config import default_home

    if os.environ.get("NATS_NKEY"):
        return {"nkeys_seed": os.environ["NATS_NKEY"]}
    if os.environ.get("NATS_CREDS"):
        return {"user_credentials": os.environ["NATS_CREDS"]}
    f = Path(default_home()) / "stack.json"
    if f.is_file():
        with contextlib.suppress(ValueError, OSError):
            stack = json.loads(f.read_text())
            if stack.get("nats_url") == url and stack.get("service_nkey") and Path(stack["service_nkey"]).is_file():
                return {"nkeys_seed": stack["service_nkey"]}
    return {}


class Bus:
    """One NATS connection plus its JetStream context, KV buckets and object stores."""

    def __init__(self, nc: nats.NATS, service: str):
        self.nc = nc
        self.js = nc.jetstream(timeout=30)
        self.service = service
        self._kv: dict[str, Any] = {}
        self._obj: dict[str, Any] = {}

    @classmethod
    async def connect(cls, url: str | None = None, service: str = "client", **kw: Any) -> Bus:
        """Connect to `url` (default `$NATS_URL`, then nats://127.0.0.1:4222).

        Credentials, never from a command line: `token=` (a user's API key), else
        `service_credentials(url)`, else the URL's (nats://user:pass@host).
        Raises nats.errors.NoServersError when no server answers.
        """
        url = default_nats_url(url)
        if not {"token", "nkeys_seed", "user_credentials"} & kw.keys():
            kw.update(service_credentials(url))
        nc = await nats.connect(
            url, name=f"opentinker-{service}", max_reconnect_attempts=-1,
            connect_timeout=5, allow_reconnect=True, **kw,
        )
        return cls(nc, service)

    async def close(self) -> None:
        """Flush pending publishes and close. (Not drain: nats-py's drain waits forever on
        a pull subscription that has fetched; our work is acked explicitly anyway.)"""
        if not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.flush(), 5)
            except (asyncio.TimeoutError, nats.errors.ConnectionClosedError):
                pass
            await self.nc.close()

    # -- topology -------------------------------------------------------------

    async def ensure_topology(self) -> None:
        """Create (or update) every stream, KV bucket and object store. Idempotent."""
        for name, (subjects, retention) in S.STREAMS.items():
            cfg = api.StreamConfig(
                name=name, subjects=subjects,
                retention=api.RetentionPolicy.WORK_QUEUE if retention == "workqueue"
                else api.RetentionPolicy.LIMITS,
                storage=api.StorageType.FILE,
                duplicate_window=DUPLICATE_WINDOW_S,
                max_msg_size=-1,
            )
            try:
                await self.js.add_stream(cfg)
            except BadRequestError:
                await self.js.update_stream(cfg)
        await self.kv(S.KV_JOBS)
        await self.kv(S.KV_WORKERS)
        await self.kv(S.KV_USERS)
        await self.kv(S.KV_KEYS)
        await self.objects(S.OBJ_WEIGHTS)
        await self.objects(S.OBJ_CHECKPOINTS)

    async def kv(self, bucket: str):
        """The KV bucket `bucket`, created if missing. In `ot_workers` an entry expires
        WORKER_TTL_S after its last write (a worker's missed heartbeats)."""
        if bucket not in self._kv:
            try:
                self._kv[bucket] = await self.js.key_value(bucket)
            except (NotFoundError, nats.js.errors.BucketNotFoundError):
                ttl = S.WORKER_TTL_S if bucket == S.KV_WORKERS else None
                history = 1 if bucket == S.KV_WORKERS else 8
                self._kv[bucket] = await self.js.create_key_value(bucket=bucket, history=history, ttl=ttl)
        return self._kv[bucket]

    async def job_record(self, job_id: str) -> tuple[JobRecord, int] | None:
        """The scheduler's record of `job_id` and its KV revision, or None when there is
        none. Raises msgspec.MsgspecError for an unreadable record."""
        try:
            entry = await (await self.kv(S.KV_JOBS)).get(job_id)
        except nats.js.errors.KeyNotFoundError:
            return None
        return (decode(entry.value, JobRecord), entry.revision) if entry.value else None

    async def kv_values(self, bucket: str, prefix: str = "") -> dict[str, tuple[bytes, int]]:
        """Every live key of `bucket` (starting with `prefix`) -> (value, revision).

        One ephemeral pull consumer over the bucket's stream delivering the last
        message per key, read until the count it started with. (nats-py's `kv.keys()`
        can end before the first key arrives under load, which once listed no workers
        at all and made the scheduler requeue healthy jobs.)"""
        await self.kv(bucket)
        stream, base = f"KV_{bucket}", f"$KV.{bucket}."
        sub = await self.js.pull_subscribe(
            f"{base}{prefix}>" if prefix else f"{base}>", stream=stream,
            config=api.ConsumerConfig(deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
                                      ack_policy=api.AckPolicy.NONE, inactive_threshold=10.0,
                                      mem_storage=True))
        out: dict[str, tuple[bytes, int]] = {}
        info = await sub.consumer_info()
        try:
            left = info.num_pending
            while left > 0:
                try:
                    msgs = await sub.fetch(min(left, 256), timeout=5)
                except nats.errors.TimeoutError:
                    break  # entries that expired (or were purged) since the count
                for m in msgs:
                    left -= 1
                    key = m.subject[len(base):]
                    if (m.headers or {}).get("KV-Operation") in ("DEL", "PURGE") or not m.data:
                        out.pop(key, None)
                    else:
                        out[key] = (m.data, m.metadata.sequence.stream)
                    if m.metadata.num_pending == 0:
                        left = 0
        finally:
            with contextlib.suppress(nats.errors.Error, NotFoundError):
                await sub.unsubscribe()
                await self.js.delete_consumer(stream, info.name)
        return out

    async def objects(self, bucket: str):
        """The object store `bucket`, created if missing."""
        if bucket not in self._obj:
            try:
                self._obj[bucket] = await self.js.object_store(bucket)
            except (NotFoundError, nats.js.errors.BucketNotFoundError):
                self._obj[bucket] = await self.js.create_object_store(bucket=bucket)
        return self._obj[bucket]

    async def put_object(self, bucket: str, name: str, data: bytes) -> None:
        """Store `data` under `name` in large chunks."""
        store = await self.objects(bucket)
        meta = api.ObjectMeta(name=name, options=api.ObjectMetaOptions(max_chunk_size=OBJ_CHUNK_BYTES))
        await store.put(name, data, meta=meta)

    async def get_object(self, bucket: str, name: str) -> bytes:
        """The bytes stored under `name`. Raises nats.js.errors.ObjectNotFoundError."""
        store = await self.objects(bucket)
        return (await store.get(name)).data

    async def read_subject(self, subject: str, kind: type[T], limit: int = 10_000) -> list[T]:
        """The messages the streams hold on `subject`, oldest first, decoded as `kind`
        (at most `limit`; undecodable ones skipped). See `read_raw`."""
        out: list[T] = []
        for raw in await self.read_raw(subject, limit):
            with contextlib.suppress(msgspec.MsgspecError):
                out.append(decode(raw.data, kind))
        return out

    async def read_raw(self, subject: str, limit: int = 100_000) -> list:
        """Every message the streams hold on `subject` (wildcards allowed), oldest first
        within each stream, undecoded (RawStreamMsg: subject, headers, data, seq). No
        consumer is made: each is a direct "next by subject" get."""
        out: list = []
        for stream in streams_of(subject):
            seq = 1
            while len(out) < limit:
                try:
                    raw = await self.js.get_msg(stream, seq=seq, subject=subject, next=True)
                except NotFoundError:
                    break
                out.append(raw)
                seq = raw.seq + 1
        return out

    async def last_message(self, subject: str):
        """The newest message a stream holds on `subject` (RawStreamMsg), or None."""
        for stream in streams_of(subject):
            with contextlib.suppress(NotFoundError):
                return await self.js.get_last_msg(stream, subject)
        return None

    # -- publish / request ----------------------------------------------------

    def headers(self, msg: msgspec.Struct, msg_id: str | None, traceparent: str | None) -> dict[str, str]:
        """The headers of `msg`: schema, content type, `msg_id`, and the trace context
        of the current span (tracing.py); with no span current, a child of
        `traceparent` (or a new trace)."""
        h = {S.H_SCHEMA: schema_name(type(msg)), S.H_CONTENT_TYPE: S.CONTENT_TYPE}
        tracing.inject(h)
        if S.H_TRACEPARENT not in h:
            h[S.H_TRACEPARENT] = child_traceparent(traceparent)
        if msg_id:
            h[S.H_MSG_ID] = msg_id
        return h

    async def publish(self, subject: str, msg: msgspec.Struct, msg_id: str | None = None,
                      traceparent: str | None = None) -> api.PubAck:
        """Publish `msg` to a JetStream subject and wait for the stream's ack.

        `msg_id` (Nats-Msg-Id) makes a retried publish a no-op within the duplicate
        window. Raises nats.js.errors.NoStreamResponseError if no stream holds `subject`.
        """
        return await self.js.publish(subject, encode(msg), headers=self.headers(msg, msg_id, traceparent))

    async def publish_core(self, subject: str, msg: msgspec.Struct) -> None:
        """Publish on core NATS (no persistence), for replies and notifications."""
        await self.nc.publish(subject, encode(msg), headers=self.headers(msg, None, None))

    async def request(self, subject: str, msg: msgspec.Struct, reply_type: type[T],
                      timeout_s: float = 10.0, traceparent: str | None = None) -> T:
        """Core request/reply: send `msg`, decode the answer as `reply_type`.

        Raises nats.errors.NoRespondersError when nothing serves `subject`,
        nats.errors.TimeoutError after `timeout_s`.
        """
        resp = await self.nc.request(subject, encode(msg), timeout=timeout_s,
                                     headers=self.headers(msg, None, traceparent))
        return decode(resp.data, reply_type)

    async def serve(self, subject: str, kind: type[T],
                    handler: Callable[[T, Msg], Awaitable[msgspec.Struct]],
                    queue: str = "") -> Any:
        """Answer requests on `subject` (queue group `queue`): decode to `kind`, reply
        with what `handler` returns. Undecodable requests are dead-lettered and get no
        reply; a handler exception is logged and the service keeps serving."""

        async def cb(m: Msg) -> None:
            await self._answer(subject, kind, handler, m)

        return await self.nc.subscribe(subject, queue=queue, cb=cb)

    async def serve_concurrently(self, subject: str, kind: type[T],
                                 handler: Callable[[T, Msg], Awaitable[msgspec.Struct]],
                                 queue: str = "", max_in_flight: int = 64) -> Any:
        """Like `serve`, but up to `max_in_flight` requests are handled at once.

        nats.py runs one subscription's callbacks one after another, so with `serve` a
        slow handler holds up every request behind it. Beyond `max_in_flight`, new
        requests wait in the subscription's pending queue (backpressure)."""
        slots = asyncio.Semaphore(max_in_flight)
        running: set[asyncio.Task] = set()  # strong refs: the loop keeps only weak ones

        async def run(m: Msg) -> None:
            try:
                await self._answer(subject, kind, handler, m)
            finally:
                slots.release()

        async def cb(m: Msg) -> None:
            await slots.acquire()
            task = asyncio.create_task(run(m))
            running.add(task)
            task.add_done_callback(running.discard)

        return await self.nc.subscribe(subject, queue=queue, cb=cb)

    async def _answer(self, subject: str, kind: type[T],
                      handler: Callable[[T, Msg], Awaitable[msgspec.Struct]], m: Msg) -> None:
        try:
            req = decode(m.data, kind)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            await self.dead_letter(m, f"cannot decode {kind.__name__}: {e}")
            return
        # a server span continuing the requester's trace (e.g. rollout -> envhost)
        with tracing.span(f"{self.service} {kind.__name__}", parent=tracing.extract(m.headers),
                          kind=tracing.SpanKind.SERVER,
                          attrs={"messaging.destination.name": m.subject, **_episode_attr(req)}):
            try:
                reply = await handler(req, m)
            except Exception:
                log.exception("handler for %s failed", subject)
                return
            if m.reply:
                await self.nc.publish(m.reply, encode(reply),
                                      headers=self.headers(reply, None, (m.headers or {}).get(S.H_TRACEPARENT)))

    async def dead_letter(self, m: Msg, reason: str) -> None:
        """Record an unprocessable message on `ot.dlq.<service>` with the reason."""
        log.warning("dead-letter %s: %s", m.subject, reason)
        rec = DeadLetter(service=self.service, subject=m.subject, reason=reason,
                         payload=bytes(m.data), headers=dict(m.headers or {}), time_s=time.time())
        await self.publish(S.dead_letter(self.service), rec)

    # -- consume --------------------------------------------------------------

    async def pull(self, stream: str, durable: str, filter_subject: str,
                   ack_wait_s: float = 60.0, max_deliver: int = -1,
                   deliver_policy: api.DeliverPolicy = api.DeliverPolicy.ALL):
        """A durable pull subscription on `stream` (created or bound)."""
        cfg = api.ConsumerConfig(
            durable_name=durable, ack_policy=api.AckPolicy.EXPLICIT, ack_wait=ack_wait_s,
            max_deliver=max_deliver, filter_subject=filter_subject, deliver_policy=deliver_policy,
            max_ack_pending=10_000,
        )
        return await self.js.pull_subscribe(filter_subject, durable=durable, stream=stream, config=cfg)

    async def fetch(self, sub, batch: int = 1, timeout_s: float = 1.0) -> list[Msg]:
        """Up to `batch` messages, or [] when none arrive within `timeout_s`."""
        try:
            return await sub.fetch(batch, timeout=timeout_s)
        except asyncio.TimeoutError:  # nats.py raises its own subclass or, at times, this base
            return []

    async def decode_or_dead_letter(self, m: Msg, kind: type[T]) -> T | None:
        """Decode `m` as `kind`; on failure dead-letter it, terminate it (no
        redelivery), and return None."""
        try:
            return decode(m.data, kind)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            await self.dead_letter(m, f"cannot decode {kind.__name__}: {e}")
            await m.term()
            return None

    async def consume(self, sub, kind: type[T], handler: Callable[[T, Msg], Awaitable[None]],
                      stop: asyncio.Event, batch: int = 16, timeout_s: float = 1.0) -> None:
        """Run `handler` on every message of `sub` until `stop` is set. Acks after the
        handler returns; a handler exception naks the message (JetStream redelivers)."""
        while not stop.is_set():
            for m in await self.fetch(sub, batch, timeout_s):
                item = await self.decode_or_dead_letter(m, kind)
                if item is None:
                    continue
                try:
                    await handler(item, m)
                except Exception:
                    log.exception("handler failed on %s; will be redelivered", m.subject)
                    await m.nak(delay=2.0)
                    continue
                await m.ack()


def install_signal_handlers(stop: asyncio.Event) -> None:
    """SIGINT/SIGTERM set `stop` (nats.py's examples' pattern)."""
    import signal

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
