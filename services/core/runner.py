"""The shared `main` of every service: settings, logging, signals, threads, bus, run."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Awaitable, Callable

from opentinker.services.core import tracing
from opentinker.services.core.bus import Bus, install_signal_handlers
from opentinker.services.core.config import Settings, main_settings, thread_count, thread_env

Body = Callable[[Settings, Bus, asyncio.Event], Awaitable[None]]


def run_service(service: str, body: Body, argv: list[str] | None = None) -> None:
    """Parse settings, set the thread count (limit_threads), connect to NATS, create the
    topology, run `body` until SIGINT/SIGTERM sets the stop event, then flush and close
    the connection (Bus.close)."""
    settings = main_settings(service, argv)
    limit_threads(service, settings)
    tracing.setup(service)

    async def _main() -> None:
        stop = asyncio.Event()
        install_signal_handlers(stop)
        bus = await Bus.connect(settings.nats_url, service)
        try:
            await bus.ensure_topology(settings.stream_max_bytes_scale, settings.stream_max_age_scale,
                                      settings.nats_replicas)
            await body(settings, bus, stop)
        finally:
            await bus.close()

    try:
        asyncio.run(_main())
    finally:
        tracing.shutdown()


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
