"""The shared `main` of every service: settings, logging, signals, bus, run."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from opentinker.services.core import tracing
from opentinker.services.core.bus import Bus, install_signal_handlers
from opentinker.services.core.config import Settings, main_settings

Body = Callable[[Settings, Bus, asyncio.Event], Awaitable[None]]


def run_service(service: str, body: Body, argv: list[str] | None = None) -> None:
    """Parse settings, connect to NATS, create the topology, run `body` until
    SIGINT/SIGTERM sets the stop event, then flush and close the connection (Bus.close)."""
    settings = main_settings(service, argv)
    tracing.setup(service)

    async def _main() -> None:
        stop = asyncio.Event()
        install_signal_handlers(stop)
        bus = await Bus.connect(settings.nats_url, service)
        try:
            await bus.ensure_topology(settings.stream_max_bytes_scale, settings.stream_max_age_scale)
            await body(settings, bus, stop)
        finally:
            await bus.close()

    try:
        asyncio.run(_main())
    finally:
        tracing.shutdown()
