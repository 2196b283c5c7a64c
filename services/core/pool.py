"""Joining the worker pool: a worker's identity and its heartbeat in the `ot_workers`
KV bucket.

A worker writes its WorkerInfo every WORKER_HEARTBEAT_S; the bucket expires an entry
WORKER_TTL_S after its last write, so a worker that dies (even by SIGKILL) leaves the
pool within WORKER_TTL_S and the scheduler requeues its jobs. A worker that stops
cleanly deletes its entry at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import os
import re
import socket
import sys
import time
from collections.abc import Callable
from typing import TextIO

import msgspec
import nats.errors

from opentinker.schemas import decode, encode
from opentinker.schemas import subjects as S
from opentinker.schemas.pool import WorkerCapacity, WorkerInfo, WorkerKind
from opentinker.services.core.bus import Bus

log = logging.getLogger("opentinker.pool")


def default_worker_id(kind: str) -> str:
    """`<kind>-<host>-<pid>` as a subject token (lower case, [a-z0-9_-])."""
    host = re.sub(r"[^a-z0-9_-]", "-", socket.gethostname().lower())[:40].strip("-") or "host"
    return f"{kind}-{host}-{os.getpid()}"


def machine_capacity(slots: int, engines: list[str]) -> WorkerCapacity:
    """This machine's GPUs, CPU cores and memory, with the worker's slots and engines."""
    gpus = 0
    with contextlib.suppress(ImportError):
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return WorkerCapacity(slots=slots, gpus=gpus, cpu_cores=os.cpu_count() or 1,
                          memory_gb=round(mem, 1), engines=engines)


#: a gap between two heartbeats written this long is logged (half the way to WORKER_TTL_S)
LATE_HEARTBEAT_S = S.WORKER_TTL_S / 2


class Heartbeat:
    """Keep one worker's entry in `ot_workers` fresh until `stop()`.

    A beat later than LATE_HEARTBEAT_S is logged. Before that, when the event loop is
    held up past the mark, faulthandler writes every thread's Python stack to
    `stacks` (default: stderr, the service's log): what held the loop, caught while it
    holds it (faulthandler's timer runs in a thread of its own, outside the GIL's
    reach; one timer a process, so a second Heartbeat in one process takes it over)."""

    def __init__(self, bus: Bus, kind: WorkerKind, worker_id: str, pool: str,
                 capacity: WorkerCapacity, jobs: Callable[[], list[str]], serve_url: str = "",
                 stacks: TextIO | None = None):
        self.bus = bus
        self.key = S.worker_key(pool, worker_id)
        self.info = WorkerInfo(worker_id=worker_id, kind=kind, pool=pool, capacity=capacity,
                               host=socket.gethostname(), pid=os.getpid(), started_s=time.time(),
                               serve_url=serve_url)
        self.jobs = jobs
        self.stacks = stacks
        self._task: asyncio.Task | None = None

    def _watch(self) -> None:
        """Arm the stack dump for LATE_HEARTBEAT_S after this beat (no-op when the stream
        has no file descriptor, as under pytest's capture)."""
        with contextlib.suppress(ValueError, OSError, AttributeError):
            faulthandler.dump_traceback_later(LATE_HEARTBEAT_S,
                                              file=self.stacks or sys.stderr)

    async def beat(self) -> None:
        info = msgspec.structs.replace(self.info, jobs=self.jobs(), time_s=time.time())
        await (await self.bus.kv(S.KV_WORKERS)).put(self.key, encode(info))

    async def start(self) -> None:
        await self.beat()
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        last = time.monotonic()
        while True:
            self._watch()
            await asyncio.sleep(S.WORKER_HEARTBEAT_S)
            try:
                await self.beat()
            except (nats.errors.Error, asyncio.TimeoutError) as e:
                log.warning("heartbeat of %s failed: %r", self.key, e)
                continue
            finally:
                faulthandler.cancel_dump_traceback_later()
            now = time.monotonic()
            gap, last = now - last, now
            if gap > LATE_HEARTBEAT_S:
                # past WORKER_TTL_S the scheduler counts this worker gone and requeues its jobs
                log.warning("heartbeat of %s written %.1f s after the one before (every %.0f s; gone after %.0f s): "
                            "this process's event loop was held up, or the bus was slow (the threads' stacks "
                            "at the mark, if it was the loop, are in this log above)", self.key, gap,
                            S.WORKER_HEARTBEAT_S, S.WORKER_TTL_S)

    async def stop(self) -> None:
        """Stop beating and leave the pool."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            faulthandler.cancel_dump_traceback_later()
        with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
            await (await self.bus.kv(S.KV_WORKERS)).delete(self.key)


async def live_workers(bus: Bus, pool: str) -> dict[str, WorkerInfo]:
    """The pool's workers with a heartbeat younger than WORKER_TTL_S, by worker id.

    Age is the server's business, not a clock comparison: the bucket's TTL (max age)
    makes nats-server itself drop an entry WORKER_TTL_S after its last write, by the
    server's clock, so a worker whose clock runs ahead or behind the scheduler's is
    neither kept alive nor declared lost by that skew."""
    out = {}
    for _key, (value, _rev) in (await bus.kv_values(S.KV_WORKERS, f"{pool}.")).items():
        try:
            info = decode(value, WorkerInfo)
        except msgspec.MsgspecError as e:
            log.warning("ignoring an unreadable worker entry %s: %s", _key, e)
            continue
        if _key == f"{info.pool}.{info.worker_id}":
            out[info.worker_id] = info
        else:
            log.warning("ignoring worker entry %s: it describes %s.%s", _key, info.pool, info.worker_id)
    return out
