"""The shared `main` of every service: settings, logging, signals, threads, bus, run."""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import os
import shutil
import signal
import sys
import tempfile
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

from opentinker.services.core import tracing
from opentinker.services.core.bus import Bus
from opentinker.services.core.config import Settings, main_settings, thread_count, thread_env
from opentinker.services.core.tmpdir import private_tmpdir

Body = Callable[[Settings, Bus, asyncio.Event], Awaitable[None]]
log = logging.getLogger("opentinker.runner")
# After SIGTERM, how long a service's work may take to wind down before it is cancelled:
# a bus call retried across a NATS outage (bus.RETRY_FOR_S) would otherwise hold the
# process for minutes, past any orchestrator's stop timeout.
STOP_GRACE_S = 5.0  # so that a service stops within docker stop's default 10 s
STACKS_SIGNAL = signal.SIGUSR1  # `kill -USR1 <pid>`: the service logs where it waits (dump_stacks)


def run_service(service: str, body: Body, argv: list[str] | None = None) -> None:
    """Parse settings, set the thread count (limit_threads), connect to NATS, create the
    topology, run `body` until SIGINT/SIGTERM sets the stop event, then flush and close
    the connection (Bus.close); `body` still running STOP_GRACE_S after the signal is
    cancelled. STACKS_SIGNAL logs where the service waits (dump_stacks). The process's
    temporary files go to a folder of its own, removed when it stops
    (tmpdir.private_tmpdir)."""
    settings = main_settings(service, argv)
    limit_threads(service, settings)
    scratch = private_tmpdir(service)
    tracing.setup(service)

    async def _main() -> None:
        stop = asyncio.Event()
        install_signal_handlers(stop, service)
        bus = await Bus.connect(settings.nats_url, service)
        try:
            await bus.ensure_topology(settings.stream_max_bytes_scale, settings.stream_max_age_scale,
                                      settings.nats_replicas)
            await run_until_stopped(body(settings, bus, stop), stop, STOP_GRACE_S, service)
        finally:
            await bus.close()

    try:
        asyncio.run(_main())
    finally:
        tracing.shutdown()
        shutil.rmtree(scratch, ignore_errors=True)


def install_signal_handlers(stop: asyncio.Event, service: str) -> None:
    """SIGINT/SIGTERM set `stop` (nats.py's examples' pattern); STACKS_SIGNAL logs
    where `service` waits (dump_stacks)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(STACKS_SIGNAL, dump_stacks, service)


def await_chain(task: asyncio.Task) -> list[str]:
    """Where `task` waits: its coroutine's frame, then the frame of each coroutine or
    generator it awaits in turn (`cr_await`), as traceback lines, outermost first, and
    last the future the task is suspended on. asyncio's own `Task.get_stack` stops at
    the task's first frame."""
    frames: list[tuple[Any, int]] = []
    aw: Any = task.get_coro()
    while aw is not None:
        frame = getattr(aw, "cr_frame", None) or getattr(aw, "gi_frame", None) or getattr(aw, "ag_frame", None)
        if frame is None:
            break
        frames.append((frame, frame.f_lineno))
        aw = getattr(aw, "cr_await", None) or getattr(aw, "gi_yieldfrom", None) or getattr(aw, "ag_await", None)
    lines = traceback.StackSummary.extract(iter(frames), lookup_lines=True).format()
    waiter = getattr(task, "_fut_waiter", None)  # asyncio's, in its C and Python tasks alike
    return lines + ([f"  suspended on {waiter!r}\n"] if waiter is not None and not task.done() else [])


def dump_stacks(service: str) -> None:
    """Log every thread's Python stack (faulthandler) and every asyncio task's await
    chain (await_chain) at WARNING: what a service alive but silent is waiting for, e.g.
    a rollout worker that stopped serving while its heartbeat went on. Runs in the event
    loop (STACKS_SIGNAL's handler), so a loop blocked for good shows nothing here; the
    late-heartbeat dump (core.pool) covers that case."""
    with tempfile.TemporaryFile("w+") as f:  # faulthandler writes to a real file
        faulthandler.dump_traceback(f, all_threads=True)
        f.seek(0)
        threads = f.read()
    tasks = "".join(f"task {t.get_name()}:\n" + "".join(await_chain(t))
                    for t in sorted(asyncio.all_tasks(), key=lambda t: t.get_name()))
    log.warning("%s (pid %d): stacks on request (%s)\n%s\n%s", service, os.getpid(), STACKS_SIGNAL.name,
                threads, tasks)


async def run_until_stopped(work: Awaitable[None], stop: asyncio.Event, grace_s: float, service: str) -> None:
    """Await `work`; once `stop` is set, give it `grace_s` seconds more to finish, then
    cancel it. Raises what `work` raises (not its cancellation)."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done() and not (await asyncio.wait({task}, timeout=grace_s))[0]:
            log.warning("%s: still winding down %.0f s after the stop signal; cancelled", service, grace_s)
            for _ in range(3):  # its cleanup may wait on the bus again: cancel that too
                task.cancel()
                if (await asyncio.wait({task}, timeout=5.0))[0]:
                    break
        if task.done() and not task.cancelled():
            task.result()
    finally:
        stopped.cancel()


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op thread count set to `n` for the block on this thread, then back
    to what it was (n <= 0: left alone). torch's own setter (`torch._C`): vLLM's CPU
    worker replaces torch.set_num_threads by a no-op in its process (rollout/policy.py
    single_threaded)."""
    if n <= 0:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch._C.set_num_threads(n)
    try:
        yield
    finally:
        torch._C.set_num_threads(before)


def limit_threads(service: str, settings: Settings) -> int | None:
    """Apply config.thread_count to this process: OMP_NUM_THREADS and MKL_NUM_THREADS
    for libraries started later (and child processes, e.g. envhost sandboxes), and
    torch.set_num_threads when torch is already imported. Returns the count (None: the
    libraries' defaults, nothing changed). Raises ValueError for a bad count."""
    n = thread_count(service, os.environ, settings.threads)
    os.environ.update(thread_env(n))
    if n is not None and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(n)
    return n
