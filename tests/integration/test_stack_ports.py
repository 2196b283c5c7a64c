"""`opentinker up` (ops/stack.py) binds the REST and Tinker APIs' ports itself and the
services inherit the listening sockets (api_fd / tinker_fd): no other process can take
a port between the stack picking it and the service starting, as one could when the
stack only checked that the port was free (core/http.py serves on the socket)."""

import asyncio
import socket

import httpx
import pytest

from opentinker.ops.stack import Stack
from opentinker.services.core.http import serve_http

from conftest import listeners
from tenants import wait_http_ok

pytestmark = pytest.mark.timeout(300)


async def test_serve_http_on_an_inherited_listening_socket():
    from fastapi import FastAPI

    app = FastAPI()
    app.get("/ping")(lambda: {"ok": True})
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    server = await serve_http(app, "127.0.0.1", 1, fd=sock.detach())  # the port argument only names it
    try:
        assert server.port == port
        async with httpx.AsyncClient() as c:
            assert (await c.get(f"http://127.0.0.1:{port}/ping")).json() == {"ok": True}
    finally:
        await server.stop()
    unbound = socket.socket()
    with pytest.raises(OSError, match="not a listening TCP socket"):
        await serve_http(app, "127.0.0.1", 0, fd=unbound.fileno())
    unbound.close()


def test_the_stack_binds_the_preferred_port_or_another_and_holds_it(tmp_path):
    stack = Stack(tmp_path, nats_url="nats://127.0.0.1:1", services=("scheduler",))
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    sock = stack._listen("scheduler", "api", taken.getsockname()[1])  # the preferred port is taken
    try:
        port = sock.getsockname()[1]
        assert port != taken.getsockname()[1]
        assert stack.overrides["scheduler"] == [f"api_port={port}", f"api_fd={sock.fileno()}"]
        with socket.socket() as thief, pytest.raises(OSError):  # held from now on: nobody else gets it
            thief.bind(("127.0.0.1", port))
        # an operator's own port, fd or --config: the service binds as configured
        for own in (["api_port=9"], ["api_fd=9"], ["--config", "x.toml"]):
            assert Stack(tmp_path, services=("scheduler",), overrides={"scheduler": own})._listen(
                "scheduler", "api", 0) is None
    finally:
        sock.close()
        taken.close()


async def _answers(stack: Stack, *urls: str) -> None:
    async with httpx.AsyncClient(timeout=10) as c:
        for url in urls:
            await wait_http_ok(url, 60)
            assert (await c.get(url)).status_code == 200, f"{url} never answered; logs in {stack.log_dir}"


async def test_up_serves_the_apis_on_the_sockets_it_bound(tmp_path):
    stack = await asyncio.to_thread(Stack(tmp_path / "home", services=("scheduler", "tinker")).start)
    try:
        held = {s: sock.getsockname()[1] for s, sock in stack.sockets.items()}
        assert stack.api_url == f"http://127.0.0.1:{held['scheduler']}/"
        assert stack.tinker_url == f"http://127.0.0.1:{held['tinker']}"
        await _answers(stack, stack.api_url + "v1/health", stack.tinker_url + "/api/v1/healthz")
        for name, port in held.items():  # the service listens on exactly that port, and on loopback only
            ports = {(ip, p) for _, ip, p, _ in listeners(stack.procs[name].pid)}
            assert ("127.0.0.1", port) in ports, (name, ports)
        # a service restarted (`opentinker up` restarts one that exits) serves on the same socket
        old = stack.procs["scheduler"]
        old.kill()
        await asyncio.to_thread(old.wait)
        stack.spawn("scheduler")
        await _answers(stack, stack.api_url + "v1/health")
        assert stack.procs["scheduler"].pid != old.pid
    finally:
        await asyncio.to_thread(stack.stop)
    assert stack.sockets == {}
