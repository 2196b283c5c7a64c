"""The recorder's flush: a job's part that cannot be written is written message by
message, the message at fault dead-lettered and terminated, the others recorded; a
disk error still stops the recorder with nothing acked (JetStream redelivers)."""

import asyncio
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from opentinker.schemas import Metrics
from opentinker.services.recorder import service, store

TABLE = next(t for t in service.TABLES if t.name == "metrics")


class FakeMsg:
    def __init__(self, seq: int):
        self.metadata = SimpleNamespace(sequence=SimpleNamespace(stream=seq))
        self.subject = "ot.job.j.metrics"
        self.acked = self.termed = False

    async def ack(self):
        self.acked = True

    async def term(self):
        self.termed = True


class FakeBus:
    def __init__(self):
        self.dead: list[tuple[FakeMsg, str]] = []

    async def dead_letter(self, m, reason):
        self.dead.append((m, reason))


def buffer(jobs: dict[str, list[float]]) -> tuple[service.Buffer, dict[tuple[str, float], FakeMsg]]:
    buf, msgs, seq = service.Buffer(), {}, 0
    for job_id, values in jobs.items():
        for v in values:
            seq += 1
            m = FakeMsg(seq)
            rows = store.to_table("metrics", store.metrics_rows(
                Metrics(job_id=job_id, step=seq, policy_version=0, values={"x": v}), seq))
            buf.add(m, seq, job_id, rows)
            msgs[job_id, v] = m
    return buf, msgs


def poisoned(real):
    """write_part failing for any part holding the value 13 (as a write the schema
    check could not foresee would)."""
    def write(log_dir, table, job_id, rows):
        if 13.0 in rows.column("value").to_pylist():
            raise pa.ArrowInvalid("cannot write 13")
        return real(log_dir, table, job_id, rows)
    return write


def values(tmp_path, job_id):
    files = sorted((tmp_path / "metrics" / f"job_id={job_id}").glob("part-*.parquet"))
    return sorted(v for f in files for v in pq.read_table(f).column("value").to_pylist()), len(files)


def test_a_part_that_fails_is_written_message_by_message(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "write_part", poisoned(store.write_part))
    buf, msgs = buffer({"a": [1.0, 13.0, 2.0], "b": [3.0, 4.0]})
    bus = FakeBus()
    assert asyncio.run(service.flush(bus, TABLE, tmp_path, buf)).msgs == []
    assert values(tmp_path, "a") == ([1.0, 2.0], 2)  # one part per good message
    assert values(tmp_path, "b") == ([3.0, 4.0], 1)  # another job: one part, untouched
    bad = msgs["a", 13.0]
    assert [m for m, _ in bus.dead] == [bad] and "cannot write 13" in bus.dead[0][1]
    assert bad.termed and not bad.acked
    assert all(m.acked and not m.termed for m in msgs.values() if m is not bad)


def test_a_disk_error_stops_the_recorder_with_nothing_acked(tmp_path, monkeypatch):
    def full(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "write_part", full)
    buf, msgs = buffer({"a": [1.0, 2.0]})
    bus = FakeBus()
    with pytest.raises(OSError):
        asyncio.run(service.flush(bus, TABLE, tmp_path, buf))
    assert not bus.dead and not any(m.acked or m.termed for m in msgs.values())
