"""An HTTP app (FastAPI) served by uvicorn inside a service's own event loop: the
scheduler's REST API and dashboard, a rollout worker's OpenAI-compatible endpoint."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

import uvicorn


class HttpServer(uvicorn.Server):
    """uvicorn without its signal handlers: the service's own SIGINT/SIGTERM handlers
    stop it (core/runner.py). `port` is the bound port (useful with port 0)."""

    task: asyncio.Task
    port: int = 0

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    async def stop(self) -> None:
        self.should_exit = True
        await self.task


async def serve_http(app: Any, host: str, port: int, fd: int = -1) -> HttpServer:
    """Start `app` on host:port (0: a free port) in this event loop, or, with `fd` >= 0,
    on that listening socket (inherited from the process that started this one, which
    bound it: `opentinker up`, so no other process can take the port in between);
    `await server.stop()` ends it. Raises OSError if the port cannot be bound or `fd` is
    no listening TCP socket."""
    server = HttpServer(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                       lifespan="off", access_log=False))
    sockets = None
    if fd >= 0:
        sock = socket.socket(fileno=fd)
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6) \
                or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            sock.detach()
            raise OSError(f"fd {fd} is not a listening TCP socket")
        sockets = [sock]
    task = asyncio.create_task(server.serve(sockets=sockets))
    while not server.started:
        if task.done():
            task.result()
            raise OSError(f"could not listen on {host}:{port}")
        await asyncio.sleep(0.05)
    server.task = task
    server.port = server.servers[0].sockets[0].getsockname()[1]
    return server
