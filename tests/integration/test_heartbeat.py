"""A worker's heartbeat (core/pool.py) says when it was held up: a gap between two
heartbeats written past LATE_HEARTBEAT_S is logged with its length, so a worker the
scheduler counted gone (no heartbeat for WORKER_TTL_S) leaves its reason in its log."""

import asyncio
import logging
import time

from opentinker.schemas import subjects as S
from opentinker.schemas.pool import WorkerCapacity
from opentinker.services.core import pool
from opentinker.services.core.pool import Heartbeat, live_workers


async def test_a_held_up_heartbeat_is_logged_with_its_gap(bus, monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(pool, "LATE_HEARTBEAT_S", S.WORKER_HEARTBEAT_S + 1.0)
    stacks = open(tmp_path / "stacks.txt", "w+")  # noqa: SIM115 (faulthandler writes to its descriptor)
    beat = Heartbeat(bus, "rollout", "r-late", "hb-pool", WorkerCapacity(slots=1), list, stacks=stacks)
    with caplog.at_level(logging.WARNING, logger="opentinker.pool"):
        await beat.start()
        try:
            await asyncio.sleep(2 * S.WORKER_HEARTBEAT_S + 0.5)  # beats on time: nothing said
            assert not [r for r in caplog.records if "heartbeat" in r.getMessage()]
            assert (tmp_path / "stacks.txt").read_text() == ""
            time.sleep(4.0)  # this event loop held up (as a worker's busy loop would hold it) past the mark
            await asyncio.sleep(S.WORKER_HEARTBEAT_S + 0.5)
            assert "r-late" in await live_workers(bus, "hb-pool")
        finally:
            await beat.stop()
    late = [r.getMessage() for r in caplog.records if "written" in r.getMessage()]
    assert len(late) == 1 and "hb-pool.r-late" in late[0] and "event loop was held up" in late[0], late
    gap = float(late[0].split("written ")[1].split(" s")[0])
    assert S.WORKER_HEARTBEAT_S + 1.0 < gap < S.WORKER_HEARTBEAT_S + 4.0, late
    # the stacks at the mark name what held the loop: this test's time.sleep
    stacks.close()
    dump = (tmp_path / "stacks.txt").read_text()
    assert "test_a_held_up_heartbeat_is_logged_with_its_gap" in dump and dump.count("Timeout (") == 1, dump
