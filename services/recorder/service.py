"""Recorder: writes the trajectory log (Parquet, partitioned by job) from the bus.

Role: the durable record of every job: trajectories, metrics and state changes, for
`opentinker query` (DuckDB views in services/core/logdb.py) and for replay. A message is acked only
after its rows are in a Parquet file on disk, so a crash loses nothing (JetStream
redelivers after `recorder_ack_wait_s`); a message written but not yet acked when the
recorder died is written again, and the query views keep one copy.

Reads (durable pull consumers, from the start of each stream):
- `ot.job.*.traj`    (OT_TRAJ, durable "recorder-traj"): Trajectory
- `ot.job.*.metrics` (OT_METRICS, durables "recorder-metrics" and "recorder-steps"):
  Metrics, as metric values and as the groups each train step was trained on
- `ot.job.*.events`  (OT_EVENTS, durable "recorder-events"): JobStateChanged
Writes:
- `<log_dir>/{trajectories,metrics,events,steps}/job_id=<id>/part-<unix_ms>-<uuid8>.parquet`,
  flushed every `recorder_flush_rows` rows or `recorder_flush_s` seconds
  (log_dir = settings.data_dir, default <home>/data)
- `ot.dlq.recorder`: messages that do not decode, whose job id is invalid or does not
  match their subject, or whose values the Parquet columns cannot hold (a step >= 2**63,
  a token id >= 2**31): each is terminated, so one bad message never stops the others

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

import msgspec
import pyarrow as pa
from nats.aio.msg import Msg

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
    durable: S.Durable
    kind: type
    rows: Callable[[Any, int], list[dict[str, Any]]]
    # a second table of a stream leaves dead-lettering a message that does not decode or
    # names another job to the first one (one bad message, one dead letter), and only
    # drops it from its own consumer; rows that do not fit its own table it dead-letters
    dead_letters: bool = True


TABLES = (
    Table("trajectories", S.recorder_durable("traj", S.STREAM_TRAJ), Trajectory, store.trajectory_rows),
    Table("metrics", S.recorder_durable("metrics", S.STREAM_METRICS), Metrics, store.metrics_rows),
    Table("events", S.recorder_durable("events", S.STREAM_EVENTS), JobStateChanged, store.event_rows),
    # the same metrics messages, a second consumer: which groups each step trained on
    Table("steps", S.recorder_durable("steps", S.STREAM_METRICS), Metrics, store.step_rows, dead_letters=False),
    # the same trajectory messages, a second consumer: their images, once each by hash
    Table("images", S.recorder_durable("images", S.STREAM_TRAJ), Trajectory, store.image_rows, dead_letters=False),
)


@dataclass
class Buffer:
    """Rows waiting for the next Parquet part (per job: each message's rows, already
    checked against the table's schema), and the messages to ack after it."""

    parts: dict[str, list[tuple[Msg, pa.Table]]] = field(default_factory=lambda: defaultdict(list))
    msgs: list[Msg] = field(default_factory=list)
    seqs: set[int] = field(default_factory=set)
    n_rows: int = 0
    since: float = 0.0

    def add(self, m: Msg, seq: int, job_id: str, rows: pa.Table) -> None:
        if not self.msgs:
            self.since = time.monotonic()
        self.msgs.append(m)
        # A redelivery of a message still buffered (its ack wait ran out) is acked
        # with it, not written twice.
        if seq not in self.seqs:
            self.seqs.add(seq)
            if rows.num_rows:
                self.parts[job_id].append((m, rows))
            self.n_rows += rows.num_rows


async def record(bus: Bus, settings: Settings, t: Table, stop: asyncio.Event) -> None:
    """Consume one table's stream into Parquet parts until `stop` is set, then flush."""
    # pyarrow's first conversion imports pandas (seconds): done now, not while a fetched
    # batch's ack wait runs (which would see its messages redelivered)
    await asyncio.to_thread(store.to_table, t.name, [])
    # updated on start, so that a changed ack wait applies to an existing consumer too
    sub = await bus.durable(t.durable, ack_wait_s=settings.recorder_ack_wait_s,
                            max_ack_pending=max(10_000, 2 * settings.recorder_flush_rows), update=True)
    log_dir = settings.log_dir
    buf = Buffer()
    wait_s = max(0.05, min(1.0, settings.recorder_flush_s))
    while not stop.is_set():
        for m in await bus.fetch(sub, FETCH_BATCH, wait_s):
            await take(bus, t, m, buf)
        if buf.msgs and (buf.n_rows >= settings.recorder_flush_rows
                         or time.monotonic() - buf.since >= settings.recorder_flush_s):
            buf = await flush(bus, t, log_dir, buf)
    if buf.msgs:
        await flush(bus, t, log_dir, buf)


async def take(bus: Bus, t: Table, m: Msg, buf: Buffer) -> None:
    """Decode `m` and convert its rows to the table's Parquet columns into `buf`, or
    dead-letter it naming the field (and never see it again)."""
    item = await bus.decode_or_dead_letter(m, t.kind, report=t.dead_letters)
    if item is None:
        return
    seq = m.metadata.sequence.stream
    try:
        S.check_job_id(item.job_id)  # it becomes a folder name
        if item.job_id != S.job_id_of(m.subject):
            raise ValueError(f"job_id {item.job_id!r} does not match subject {m.subject!r}")
    except ValueError as e:
        if t.dead_letters:
            await bus.dead_letter(m, f"{t.kind.__name__}: {e}")
        await m.term()
        return
    try:
        # checked here, not at flush: a value the columns cannot hold (a step >= 2**63)
        # would otherwise fail the whole part, and the recorder with it, at every restart
        rows = store.to_table(t.name, t.rows(item, seq))
    except (*store.MISFIT, msgspec.EncodeError) as e:
        await bus.dead_letter(m, f"{t.kind.__name__}: {e}")
        await m.term()
        return
    buf.add(m, seq, item.job_id, rows)


async def flush(bus: Bus, t: Table, log_dir: Path, buf: Buffer) -> Buffer:
    """Write the buffer's rows (one part per job), then ack its messages. Returns a
    fresh buffer.

    A job's part that cannot be written for its data (store.MISFIT) is written again
    message by message, and a message that still fails is dead-lettered and terminated,
    so one bad message never holds up the others. Any other write error (an OSError:
    the disk) propagates: the service exits and, unacked, every buffered message is
    redelivered to its successor."""
    dead: set[int] = set()
    for job_id, parts in buf.parts.items():
        whole = pa.concat_tables([rows for _, rows in parts])
        try:
            path = await asyncio.to_thread(store.write_part, log_dir, t.name, job_id, whole)
            log.debug("wrote %d %s rows to %s", whole.num_rows, t.name, path)
            continue
        except store.MISFIT as e:
            log.warning("%s part of job %s failed (%s); writing it message by message", t.name, job_id, e)
        for m, rows in parts:
            try:
                await asyncio.to_thread(store.write_part, log_dir, t.name, job_id, rows)
            except store.MISFIT as e:
                await bus.dead_letter(m, f"{t.kind.__name__}: cannot be written to the {t.name} table: {e}")
                dead.add(m.metadata.sequence.stream)
    for m in buf.msgs:
        if m.metadata.sequence.stream in dead:
            await m.term()
        else:
            await m.ack()
    return Buffer()


async def body(settings: Settings, bus: Bus, stop: asyncio.Event) -> None:
    log.info("recording to %s", settings.log_dir)
    await asyncio.gather(*(record(bus, settings, t, stop) for t in TABLES))


def main(argv: list[str] | None = None) -> None:
    run_service("recorder", body, argv)
