"""The NATS JetStream client every service uses.

- `Bus.connect` then `ensure_topology` creates every stream, KV bucket and object
  store in `schemas.subjects` idempotently (safe to call from every process), with
  the limits there (STREAM_LIMITS, KV_MAX_VALUE_BYTES), applied to existing ones too.
- `publish` sets `Nats-Msg-Id` (JetStream deduplication), the schema name, the
  content type and a W3C `traceparent`.
- `consume` runs a durable pull consumer: each message is decoded to its schema and
  handed to the handler; it is acked only after the handler returns. A message that
  cannot be decoded goes to `ot.dlq.<service>` with the reason (and at most its first
  DLQ_PAYLOAD_BYTES), is terminated, and the loop goes on.
- Across a NATS outage (a nats-server restart, a lost connection): nats-py reconnects
  by itself (forever), and every JetStream, KV and object-store call here is retried
  with exponential backoff (tenacity) for up to RETRY_FOR_S before its error is
  raised; a fetch that fails that way returns no messages. A publish retried after a
  lost ack is a no-op when it carries a `Nats-Msg-Id` (JetStream deduplication), so a
  server restart costs time, never a message.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import nats
import tenacity
from nats.aio.msg import Msg
from nats.js import api
from nats.js.errors import APIError, BadRequestError, NotFoundError

from opentinker.schemas import DeadLetter, JobRecord, decode, encode, schema_name
from opentinker.schemas import subjects as S
from opentinker.schemas.job import error_field
from opentinker.services.core import tracing
from opentinker.services.core.streams import DUPLICATE_WINDOW_S, stream_config, streams_of  # noqa: F401 (re-exported)
from opentinker.services.core.config import default_nats_url, server_list, service_credentials
from opentinker.services.core.kvlist import kv_values_once

log = logging.getLogger("opentinker.bus")
T = TypeVar("T", bound=msgspec.Struct)

# Weights and checkpoints go through the object store in large chunks: with the
# default 128 KiB chunks a get of tens of MB is slow (measured).
OBJ_CHUNK_BYTES = 4 * 1024 * 1024
RETRY_FOR_S = 300.0  # how long a bus call is retried across an outage before it fails
# What a dead letter keeps of a bad message, so it fits OT_DLQ whatever the message's size.
DLQ_PAYLOAD_BYTES = 64 * 1024
DLQ_HEADERS = 32
DLQ_HEADER_CHARS = 1024  # of each header's name and of its value
DLQ_REASON_CHARS = 8192
JS_STORAGE_EXHAUSTED = 10047  # JetStream's err_code: "insufficient storage resources available"
JS_NO_PEERS = 10005  # "no suitable peers for placement": a cluster node is still joining (or down)
JS_STREAM_NOT_FOUND = 10059  # also, briefly, a stream just created, asked of a node that has not seen it yet
PLACEMENT_WAIT_S = 120.0  # how long creating a replicated stream waits for the cluster's nodes
KV_BUCKETS = (S.KV_JOBS, S.KV_WORKERS, S.KV_USERS, S.KV_KEYS, S.KV_TINKER, S.KV_ENVS, S.KV_TINKER_SEQS, S.KV_LOCKS)
KV_TTL_S = {S.KV_WORKERS: S.WORKER_TTL_S, S.KV_TINKER_SEQS: S.TINKER_RECORD_TTL_S, S.KV_LOCKS: S.LOCK_TTL_S}

# errors a NATS outage or a JetStream restart produces (the call may succeed later)
TRANSIENT = (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.errors.StaleConnectionError,
             nats.errors.OutboundBufferLimitError, nats.errors.ConnectionReconnectingError,
             nats.js.errors.ServiceUnavailableError, nats.js.errors.NoStreamResponseError,
             asyncio.TimeoutError)


def retrying(what: str, retry_for_s: float | None = None, err_codes: tuple[int, ...] = ()) -> tenacity.AsyncRetrying:
    """A tenacity policy for one bus call `what`: retry TRANSIENT errors (and JetStream
    API errors of `err_codes`) with exponential backoff (0.2 s doubling to 5 s,
    jittered) for up to `retry_for_s` (default RETRY_FOR_S), then re-raise the last error."""
    def note(state: tenacity.RetryCallState) -> None:
        log.warning("%s: %r; retrying (attempt %d)", what, state.outcome.exception(), state.attempt_number)

    return tenacity.AsyncRetrying(
        retry=tenacity.retry_if_exception(lambda e: isinstance(e, TRANSIENT) or getattr(e, "err_code", 0) in err_codes),
        wait=tenacity.wait_exponential_jitter(multiplier=0.2, max=5.0, jitter=0.2),
        stop=tenacity.stop_after_delay(RETRY_FOR_S if retry_for_s is None else retry_for_s),
        before_sleep=note, reraise=True)


class MessageRefused(Exception):
    """A handler's verdict that a well-formed message must never be acted on (it names
    another job than its subject, say): `Bus.consume` dead-letters it with this reason
    and terminates it instead of redelivering it."""


def undecodable(kind: type, e: msgspec.MsgspecError) -> str:
    """The dead-letter reason of a message that does not decode as `kind`, naming the
    field when msgspec's error does."""
    field = error_field(e) if isinstance(e, msgspec.ValidationError) else ""
    return f"cannot decode {kind.__name__}: " + (f"`{field}`: " if field else "") + str(e)


def reply_allowed(subject: str | None) -> bool:
    """Whether a service may answer a request on reply subject `subject`: only a
    client's inbox (`_INBOX.`...). A service publishes with service rights, so a reply
    subject chosen by the sender (a KV bucket's `$KV.`, a stream's subject, another
    service's) would make it a confused deputy."""
    return bool(subject) and subject.startswith("_INBOX.") and " " not in subject


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


class Bus:
    """One NATS connection plus its JetStream context, KV buckets and object stores."""

    def __init__(self, nc: nats.NATS, service: str):
        self.nc = nc
        self.js = nc.jetstream(timeout=30)
        self.service = service
        self._kv: dict[str, Any] = {}
        self._obj: dict[str, Any] = {}
        # id(pull subscription) -> (durable, config) of those made with recreate=True
        self._recreate: dict[int, tuple[S.Durable, api.ConsumerConfig]] = {}
        self.replicas = 1  # of what this connection creates (ensure_topology sets it)
        self.tenant = False  # a user's envhost (envhost/tenant.py): `_R_.` replies, no dead-letter stream

    @classmethod
    async def connect(cls, url: str | None = None, service: str = "client", **kw: Any) -> Bus:
        """Connect to `url` (default `$NATS_URL`, then nats://127.0.0.1:4222).

        Credentials, never from a command line: `token=` (a user's API key), else
        `service_credentials(url)`, else the URL's (nats://user:pass@host).
        Raises nats.errors.NoServersError when no server answers."""
        url = default_nats_url(url)
        if not {"token", "nkeys_seed", "user_credentials"} & kw.keys():
            kw.update(service_credentials(url))
        nc = await nats.connect(server_list(url), name=f"opentinker-{service}", max_reconnect_attempts=-1,
                                connect_timeout=5, allow_reconnect=True, **kw)
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

    async def ensure_topology(self, max_bytes_scale: float = 1.0, max_age_scale: float = 1.0,
                              replicas: int = 1) -> None:
        """Create (or update) every stream, KV bucket and object store. Idempotent.

        Each stream gets `stream_config(name, max_bytes_scale, max_age_scale, replicas)`,
        each KV bucket values of at most S.KV_MAX_VALUE_BYTES, every KV bucket and object
        store `replicas` replicas; existing ones are updated to them. The scales and
        replicas are Settings.stream_max_bytes_scale / stream_max_age_scale /
        nats_replicas: run every service with the same ones, or each start undoes the last.

        Raises ValueError naming a scale that is not a positive number; RuntimeError
        naming the stream when the server's JetStream store cannot reserve its
        max_bytes (raise the server's `max_file_store`, or lower max_bytes_scale).
        """
        for arg, scale in (("max_bytes_scale", max_bytes_scale), ("max_age_scale", max_age_scale)):
            if not (math.isfinite(scale) and scale > 0):
                raise ValueError(f"{arg}: must be a positive number, got {scale!r}")
        if not 1 <= replicas <= 5:
            raise ValueError(f"nats_replicas: must be 1 to 5 (JetStream's limit), got {replicas!r}")
        self.replicas = replicas
        for name in S.STREAMS:
            cfg = stream_config(name, max_bytes_scale, max_age_scale, replicas)
            try:
                await self._place(f"create stream {name}", self._add_or_update, cfg)
            except APIError as e:
                if e.err_code != JS_STORAGE_EXHAUSTED:
                    raise
                raise RuntimeError(
                    f"stream {name}: the JetStream store cannot reserve max_bytes={cfg.max_bytes} "
                    f"({e.description}); give nats-server a larger `jetstream.max_file_store` (or "
                    "more free disk), or set a smaller stream_max_bytes_scale") from e
        for bucket in KV_BUCKETS:
            await self.kv(bucket)
            await self._converge(f"KV_{bucket}", max_msg_size=S.KV_MAX_VALUE_BYTES, num_replicas=replicas)
        for bucket in (S.OBJ_WEIGHTS, S.OBJ_CHECKPOINTS):
            await self.objects(bucket)
            await self._converge(f"OBJ_{bucket}", num_replicas=replicas)

    async def _add_or_update(self, cfg: api.StreamConfig) -> None:
        try:
            await self.js.add_stream(cfg)
        except BadRequestError as e:  # it exists with another config (older limits)
            if e.err_code == JS_NO_PEERS:
                raise
            await self.js.update_stream(cfg)

    async def _place(self, what: str, fn: Callable[..., Awaitable[Any]], *args: Any, **kw: Any) -> Any:
        """`await fn(...)` making, reading or resizing a stream just made, retried for up to
        PLACEMENT_WAIT_S while a cluster's nodes have not all joined (JS_NO_PEERS, timeouts) or seen it."""
        async for attempt in retrying(f"{self.service}: {what}", PLACEMENT_WAIT_S, (JS_NO_PEERS, JS_STREAM_NOT_FOUND)):
            with attempt:
                return await fn(*args, **kw)

    async def kv(self, bucket: str):
        """The KV bucket `bucket`, created if missing. In KV_TTL_S's an entry expires that
        long after its last write (a worker's missed heartbeats; a record unused a day)."""
        if bucket not in self._kv:
            try:
                self._kv[bucket] = await self._retry(f"open KV {bucket}", self.js.key_value, bucket)
            except (NotFoundError, nats.js.errors.BucketNotFoundError):
                history = 1 if (ttl := KV_TTL_S.get(bucket)) else 8
                self._kv[bucket] = await self._place(f"create KV {bucket}", self.js.create_key_value,
                                                     bucket=bucket, history=history, ttl=ttl,
                                                     max_value_size=S.KV_MAX_VALUE_BYTES, replicas=self.replicas)
        return self._kv[bucket]

    async def _converge(self, stream: str, **want: Any) -> None:
        """Update the config of `stream` (a KV bucket's or object store's, made before,
        perhaps by an older version) to the `want`ed StreamConfig fields."""
        info = await self._place(f"read {stream} config", self.js.stream_info, stream)
        if any(getattr(info.config, k) != v for k, v in want.items()):
            await self._place(f"update {stream}", self.js.update_stream, dataclasses.replace(info.config, **want))

    async def job_record(self, job_id: str) -> tuple[JobRecord, int] | None:
        """The scheduler's record of `job_id` and its KV revision, or None when there is
        none. Raises msgspec.MsgspecError for an unreadable record."""
        kv = await self.kv(S.KV_JOBS)
        try:
            entry = await self._retry(f"read job record {job_id}", kv.get, job_id)
        except nats.js.errors.KeyNotFoundError:
            return None
        return (decode(entry.value, JobRecord), entry.revision) if entry.value else None

    async def kv_values(self, bucket: str, prefix: str = "") -> dict[str, tuple[bytes, int]]:
        """Every live key of `bucket` (starting with `prefix`) -> (value, revision), while
        others write (kvlist.kv_values_once: the keys the stream holds, each read from a
        last-per-subject consumer). Never a partial answer: a stalled read (the server or
        connection going away) starts over, its error raised after RETRY_FOR_S.
        (nats-py's `kv.keys()` can end before the first key arrives under load, and a
        consumer's num_pending undercounts keys being rewritten: each once listed too few
        workers and made the scheduler requeue healthy jobs.)"""
        await self.kv(bucket)
        return await self._retry(f"list KV {bucket}", kv_values_once, self.nc, self.js, bucket, prefix)

    async def objects(self, bucket: str):
        """The object store `bucket`, created if missing."""
        if bucket not in self._obj:
            try:
                self._obj[bucket] = await self._retry(f"open object store {bucket}", self.js.object_store, bucket)
            except (NotFoundError, nats.js.errors.BucketNotFoundError):
                self._obj[bucket] = await self._place(
                    f"create object store {bucket}", self.js.create_object_store,
                    bucket=bucket, config=api.ObjectStoreConfig(bucket=bucket, replicas=self.replicas))
        return self._obj[bucket]

    async def put_object(self, bucket: str, name: str, data: bytes) -> None:
        """Store `data` under `name` in large chunks."""
        store = await self.objects(bucket)
        meta = api.ObjectMeta(name=name, options=api.ObjectMetaOptions(max_chunk_size=OBJ_CHUNK_BYTES))
        await self._retry(f"put object {bucket}/{name}", store.put, name, data, meta=meta)

    async def has_object(self, bucket: str, name: str) -> bool:
        """Whether `bucket` holds an object `name` (a deleted one is not there)."""
        with contextlib.suppress(NotFoundError):
            store = await self.objects(bucket)
            return not (await self._retry(f"object info {bucket}/{name}", store.get_info, name)).deleted
        return False

    async def get_object(self, bucket: str, name: str) -> bytes:
        """The bytes stored under `name`. Raises nats.js.errors.ObjectNotFoundError."""
        store = await self.objects(bucket)
        return (await self._retry(f"get object {bucket}/{name}", store.get, name)).data

    async def delete_object(self, bucket: str, name: str) -> None:
        """Delete `name` from `bucket`; one that is not there is no error."""
        with contextlib.suppress(NotFoundError):
            await self._retry(f"delete object {bucket}/{name}", (await self.objects(bucket)).delete, name)

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
                    raw = await self._retry(f"read {stream}", self.js.get_msg, stream, seq=seq, subject=subject,
                                            next=True)
                except NotFoundError:
                    break
                out.append(raw)
                seq = raw.seq + 1
        return out

    async def last_message(self, subject: str):
        """The newest message a stream holds on `subject` (RawStreamMsg), or None."""
        for stream in streams_of(subject):
            with contextlib.suppress(NotFoundError):
                return await self._retry(f"read {stream}", self.js.get_last_msg, stream, subject)
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
        window. Retried across an outage (module docstring); raises the last transient
        error after RETRY_FOR_S (no stream holding `subject` looks the same as JetStream
        being down: NoRespondersError), nats.js.errors.APIError for a refusal (a message
        over the stream's size limit, say)."""
        data, headers = encode(msg), self.headers(msg, msg_id, traceparent)
        return await self._retry(f"publish to {subject}", self.js.publish, subject, data, headers=headers)

    async def _retry(self, what: str, fn: Callable[..., Awaitable[Any]], *args: Any, **kw: Any) -> Any:
        """`await fn(*args, **kw)`, retried across an outage (see `retrying`)."""
        async for attempt in retrying(f"{self.service}: {what}"):
            with attempt:
                return await fn(*args, **kw)

    async def publish_core(self, subject: str, msg: msgspec.Struct) -> None:
        """Publish on core NATS (no persistence), for replies and notifications."""
        await self.nc.publish(subject, encode(msg), headers=self.headers(msg, None, None))

    async def request(self, subject: str, msg: msgspec.Struct, reply_type: type[T],
                      timeout_s: float = 10.0, traceparent: str | None = None) -> T:
        """Core request/reply: send `msg`, decode the answer as `reply_type`. Raises
        nats.errors.NoRespondersError when nothing serves `subject`,
        nats.errors.TimeoutError after `timeout_s`."""
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
        if m.reply and not (reply_allowed(m.reply) or (self.tenant and m.reply.startswith("_R_."))):
            # refused before anything is done: the request is not acted on either
            await self.dead_letter(m, f"{kind.__name__}: reply subject {m.reply!r} refused "
                                      "(a service answers only to an _INBOX. subject)")
            return
        try:
            req = decode(m.data, kind)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            await self.dead_letter(m, undecodable(kind, e))
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

    reply_allowed = staticmethod(reply_allowed)  # see the module's `reply_allowed`

    async def dead_letter(self, m: Msg, reason: str) -> None:
        """Record an unprocessable message on `ot.dlq.<service>` with the reason.

        Whatever the message's size, the dead letter fits OT_DLQ: it keeps the first
        DLQ_PAYLOAD_BYTES of the payload (`payload_bytes` is the original size), the
        first DLQ_HEADERS headers with names and values cut to DLQ_HEADER_CHARS, and the
        reason cut to DLQ_REASON_CHARS; `truncated` says whether anything was cut.
        Never raises for a dead letter that cannot be published (it is logged): the
        caller still terminates the message.
        """
        data = bytes(m.data or b"")
        if self.tenant:  # a user's connection publishes nothing but replies: the log keeps it
            return log.warning("refused %s (%d bytes): %s", m.subject, len(data), reason[:DLQ_REASON_CHARS])
        headers = {str(k): str(v) for k, v in (m.headers or {}).items()}
        kept = {k[:DLQ_HEADER_CHARS]: v[:DLQ_HEADER_CHARS] for k, v in list(headers.items())[:DLQ_HEADERS]}
        truncated = (len(data) > DLQ_PAYLOAD_BYTES or len(reason) > DLQ_REASON_CHARS or len(headers) > DLQ_HEADERS
                     or any(len(k) > DLQ_HEADER_CHARS or len(v) > DLQ_HEADER_CHARS for k, v in headers.items()))
        reason = reason[:DLQ_REASON_CHARS]
        log.warning("dead-letter %s (%d bytes): %s", m.subject, len(data), reason)
        rec = DeadLetter(service=self.service, subject=m.subject, reason=reason,
                         payload=data[:DLQ_PAYLOAD_BYTES], headers=kept, time_s=time.time(),
                         payload_bytes=len(data), truncated=truncated)
        try:
            await self.publish(S.dead_letter(self.service), rec)
        except (nats.errors.Error, asyncio.TimeoutError) as e:
            log.error("could not dead-letter %s (%s): %r", m.subject, reason[:200], e)

    # -- consume --------------------------------------------------------------

    async def durable(self, d: S.Durable, ack_wait_s: float = 60.0, max_deliver: int = -1,
                      deliver_policy: api.DeliverPolicy = api.DeliverPolicy.ALL,
                      max_ack_pending: int = 10_000, opt_start_seq: int | None = None, update: bool = False,
                      recreate: bool = False):
        """A pull subscription bound to the durable consumer `d` (schemas.subjects makes
        every service's), created if missing (from stream sequence `opt_start_seq` when
        given). With `update` its config is also applied to an existing consumer (a
        changed ack wait takes effect on restart). With `recreate`, `fetch` creates the
        consumer again when another process deleted it (a worker's work queue, which the
        scheduler deletes when the worker misses heartbeats while it is still alive)."""
        if opt_start_seq is not None:
            deliver_policy = api.DeliverPolicy.BY_START_SEQUENCE
        cfg = api.ConsumerConfig(
            durable_name=d.name, ack_policy=api.AckPolicy.EXPLICIT, ack_wait=ack_wait_s,
            max_deliver=max_deliver, filter_subject=d.subject, deliver_policy=deliver_policy,
            max_ack_pending=max_ack_pending, opt_start_seq=opt_start_seq,
        )
        if update:
            await self._retry(f"consumer {d.name} on {d.stream}", self.js.add_consumer, d.stream,
                              config=dataclasses.replace(cfg, name=d.name))
        sub = await self._retry(f"consumer {d.name} on {d.stream}", self.js.pull_subscribe, d.subject,
                                durable=d.name, stream=d.stream, config=cfg)
        if recreate:
            self._recreate[id(sub)] = (d, cfg)
        return sub

    async def _consumer_again(self, sub) -> None:
        """Create `sub`'s consumer again if it was made with `recreate` and is gone."""
        known = self._recreate.get(id(sub))
        if known is None:
            return
        d, cfg = known
        try:
            await self.js.consumer_info(d.stream, d.name)
            return  # it exists: the failure was transient
        except NotFoundError:
            pass
        await self.js.add_consumer(d.stream, config=dataclasses.replace(cfg, name=d.name))
        log.warning("%s: consumer %s on %s had been deleted (this worker was dropped from the pool); "
                    "created it again", self.service, d.name, d.stream)

    async def delete_durable(self, d: S.Durable) -> None:
        """Delete the durable consumer `d`; nothing when it does not exist."""
        with contextlib.suppress(NotFoundError):
            await self._retry(f"delete consumer {d.name}", self.js.delete_consumer, d.stream, d.name)

    async def purge_subject(self, stream: str, subject: str) -> None:
        """Drop what `stream` holds on `subject` (wildcards allowed); no stream is no error."""
        with contextlib.suppress(NotFoundError):
            await self._retry(f"purge {stream} {subject}", self.js.purge_stream, stream, subject=subject)

    async def fetch(self, sub, batch: int = 1, timeout_s: float = 1.0) -> list[Msg]:
        """Up to `batch` messages, or [] when none arrive within `timeout_s` (or the
        connection is down: the caller's loop simply asks again after reconnecting)."""
        try:
            return await sub.fetch(batch, timeout=timeout_s)
        except asyncio.TimeoutError:  # nats.py raises its own subclass or, at times, this base
            return []
        except TRANSIENT as e:
            log.warning("%s: fetch failed (%r); asking again", self.service, e)
            if isinstance(e, nats.js.errors.ServiceUnavailableError):
                with contextlib.suppress(*TRANSIENT):
                    await self._consumer_again(sub)
            await asyncio.sleep(1.0)
            return []

    async def decode_or_dead_letter(self, m: Msg, kind: type[T], report: bool = True) -> T | None:
        """Decode `m` as `kind`, or dead-letter it (if `report`), term it and return None."""
        try:
            return decode(m.data, kind)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            if report:
                await self.dead_letter(m, undecodable(kind, e))
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
                except MessageRefused as e:
                    await self.dead_letter(m, str(e))
                    await m.term()
                    continue
                except Exception:
                    log.exception("handler failed on %s; will be redelivered", m.subject)
                    with contextlib.suppress(nats.errors.Error):  # else redelivered after ack_wait
                        await m.nak(delay=2.0)
                    continue
                with contextlib.suppress(nats.errors.Error):  # an ack lost in an outage: redelivered
                    await m.ack()
