"""Recorder: writes the trajectory log (Parquet, partitioned by job) from the bus.

Role: the durable record of every job: trajectories, metrics and state changes, for
`opentinker query` (DuckDB views in query.py) and for replay. A message is acked only
after its rows are in a Parquet file on disk, so a crash loses nothing (JetStream
redelivers after `recorder_ack_wait_s`); a message written but not yet acked when the
recorder died is written again, and the query views keep one copy.

Reads (durable pull consumers, from the start of each stream):
- `ot.job.*.traj`    (OT_TRAJ, durable "recorder-traj"): Trajectory
- `ot.job.*.metrics` (OT_METRICS, durable "recorder-metrics"): Metrics
- `ot.job.*.events`  (OT_EVENTS, durable "recorder-events"): JobStateChanged
Writes:
- `<log_dir>/{trajectories,metrics,events}/job_id=<id>/part-<unix_ms>-<uuid8>.parquet`,
  flushed every `recorder_flush_rows` rows or `recorder_flush_s` seconds
  (log_dir = settings.data_dir, default <home>/data)
- `ot.dlq.recorder`: messages that do not decode, or whose job id is invalid or does
  not match their subject

Run: `opentinker serve recorder [KEY=VALUE ...]` or `python -m opentinker.services.recorder`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nats.aio.msg import Msg
from nats.js import api

from opentinker.schemas import JobStateChanged, Metrics, Trajectory
from opentinker.schemas import subjects as S
from opentinker.services.core.bus import Bus
from opentinker.services.core.config import Settings
from opentinker.services.core.runner import run_service
from opentinker.services.recorder import store

log = logging.getLogger("opentinker.recorder")

FETCH_BATCH = 256


@dataclass(frozen=True)
class Table:
    """One recorded table: where its messages come from and how they become rows."""

    name: str
    stream: str
    durable: str
    kind: type
    rows: Callable[[Any, int], list[dict[str, Any]]]

    @property
    def subject(self) -> str:
        return S.STREAMS[self.stream][0][0]


TABLES = (
    Table("trajectories", "OT_TRAJ", "recorder-traj", Trajectory, store.trajectory_rows),
    Table("metrics", "OT_METRICS", "recorder-metrics", Metrics, store.metrics_rows),
    Table("events", "OT_EVENTS", "recorder-events", JobStateChanged, store.event_rows),
)


@dataclass
class Buffer:
    """Rows waiting for the next Parquet part, and the messages to ack after it."""

    rows: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    msgs: list[Msg] = field(default_factory=list)
    seqs: set[int] = field(default_factory=set)
    n_rows: int = 0
    since: float = 0.0

    def add(self, m: Msg, seq: int, job_id: str, rows: list[dict[str, Any]]) -> None:
        if not self.msgs:
            self.since = time.monotonic()
        self.msgs.append(m)
        # A redelivery of a message still buffered (its ack wait ran out) is acked
        # with it, not written twice.
        if seq not in self.seqs:
            self.seqs.add(seq)
            self.rows[job_id].extend(rows)
            self.n_rows += len(rows)


async def durable_pull(bus: Bus, t: Table, ack_wait_s: float, max_ack_pending: int):
    """Create or update the table's durable consumer (so a changed ack wait applies to
    an existing one too) and bind a pull subscription to it."""
    cfg = api.ConsumerConfig(
        name=t.durable, durable_name=t.durable, ack_policy=api.AckPolicy.EXPLICIT,
        ack_wait=ack_wait_s, max_deliver=-1, filter_subject=t.subject,
        deliver_policy=api.DeliverPolicy.ALL, max_ack_pending=max_ack_pending,
    )
    await bus.js.add_consumer(t.stream, config=cfg)
    return await bus.pull(t.stream, t.durable, t.subject, ack_wait_s=ack_wait_s)


async def record(bus: Bus, settings: Settings, t: Table, stop: asyncio.Event) -> None:
    """Consume one table's stream into Parquet parts until `stop` is set, then flush."""
    sub = await durable_pull(bus, t, settings.recorder_ack_wait_s,
                             max(10_000, 2 * settings.recorder_flush_rows))
    log_dir = settings.log_dir
    buf = Buffer()
    wait_s = max(0.05, min(1.0, settings.recorder_flush_s))
    while not stop.is_set():
        for m in await bus.fetch(sub, FETCH_BATCH, wait_s):
            await take(bus, t, m, buf)
        if buf.msgs and (buf.n_rows >= settings.recorder_flush_rows
                         or time.monotonic() - buf.since >= settings.recorder_flush_s):
            buf = await flush(t, log_dir, buf)
    if buf.msgs:
        await flush(t, log_dir, buf)


async def take(bus: Bus, t: Table, m: Msg, buf: Buffer) -> None:
    """Decode `m` into `buf`, or dead-letter it (and never see it again)."""
    item = await bus.decode_or_dead_letter(m, t.kind)
    if item is None:
        return
    try:
        S.check_job_id(item.job_id)  # it becomes a folder name
        if item.job_id != S.job_id_of(m.subject):
            raise ValueError(f"job_id {item.job_id!r} does not match subject {m.subject!r}")
    except ValueError as e:
        await bus.dead_letter(m, f"{t.kind.__name__}: {e}")
        await m.term()
        return
    buf.add(m, m.metadata.sequence.stream, item.job_id, t.rows(item, m.metadata.sequence.stream))


async def flush(t: Table, log_dir: Path, buf: Buffer) -> Buffer:
    """Write the buffer's rows (one part per job), then ack its messages. Returns a
    fresh buffer. A write error propagates: the service exits and, unacked, every
    buffered message is redelivered to its successor."""
    for job_id, rows in buf.rows.items():
        if rows:
            path = await asyncio.to_thread(store.write_part, log_dir, t.name, job_id, rows)
            log.debug("wrote %d %s rows to %s", len(rows), t.name, path)
    for m in buf.msgs:
        await m.ack()
    return Buffer()


async def body(settings: Settings, bus: Bus, stop: asyncio.Event) -> None:
    log.info("recording to %s", settings.log_dir)
    await asyncio.gather(*(record(bus, settings, t, stop) for t in TABLES))


def main(argv: list[str] | None = None) -> None:
    run_service("recorder", body, argv)
