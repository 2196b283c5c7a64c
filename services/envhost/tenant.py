"""A tenant's own envhost: the user's environment classes, served from the user's own
machine to the user's own jobs, with an API key and the client install only.

The connection is an ordinary tenant connection (account TENANTS, services/core/
natsauth.py): the auth callout lets it subscribe to `ot.env.user.<user>.>` and nowhere
else, and publish nothing but one reply to each request it received (NATS response
permissions), of at most TENANT_PAYLOAD_BYTES. So it serves the jobs of that user only
(the scheduler resolves a job's `env` to the user's own served env at submit, and the
rollout sends that job's requests under `ot.env.user.<user>.`), it can answer no one
else's requests, and no tenant code runs on a service host. What it sends is
untrusted input to the rollout, which bounds and checks every reply.

Subjects (core request/reply, served by service.serve_envs):
- `ot.env.user.<user>.<env>.init` / `.reset` / `.info` (queue group `envhost-<env>`, so a
  user may run several hosts of one env)
- `ot.env.user.<user>.host.<host_id>.step` / `.close`

Run: `opentinker envhost --env my_env.py:MyGame` with `OPENTINKER_API_KEY`,
`OPENTINKER_API_URL` (the scheduler's REST API: it tells whose key this is) and
`NATS_URL`; or, from Python, `start_in_thread({"mygame": MyGame})` (what
`opentinker.environment.base_game_environment.GameEnvironment` does while `fit` runs).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import nats.errors

from opentinker.environment.base_game import AbstractGame
from opentinker.schemas.env import ENV_REPLY_BYTES
from opentinker.services.core.bus import Bus
from opentinker.services.core.config import default_api_key, default_api_url, default_nats_url
from opentinker.services.envhost.service import EnvHost, hold, new_host_id, serve_envs

log = logging.getLogger("opentinker.envhost")


def whoami(api_url: str, api_key: str, timeout_s: float = 30.0) -> str:
    """The user name of `api_key`, from the scheduler's REST API (`GET /v1/me`).

    Raises PermissionError when the key is refused, RuntimeError naming the URL when
    the API cannot be reached or no URL is known."""
    if not api_url:
        raise RuntimeError("no REST API URL: set OPENTINKER_API_URL (the scheduler's API, e.g. "
                           "http://host:8470) so the envhost can tell whose key it holds")
    try:
        with httpx.Client(timeout=timeout_s, transport=httpx.HTTPTransport(retries=3)) as http:
            r = http.get(f"{api_url.rstrip('/')}/v1/me", headers={"Authorization": f"Bearer {api_key}"})
    except httpx.HTTPError as e:
        raise RuntimeError(f"cannot reach the REST API at {api_url}: {e}") from None
    if r.status_code in (401, 403):
        raise PermissionError(f"the API key was refused by {api_url}: {r.text[:300]}")
    r.raise_for_status()
    return str(r.json()["name"])


async def serve(envs: dict[str, type[AbstractGame]], *, stop: asyncio.Event, nats_url: str | None = None,
                api_key: str | None = None, api_url: str | None = None, max_concurrency: int = 16,
                episode_ttl_s: float = 600.0, on_ready: Callable[[EnvHost], None] | None = None) -> None:
    """Serve `envs` (name -> class) as the key's user's own envs until `stop` is set.

    Connects with the API key as the NATS token; `on_ready(host)` is called once the
    subscriptions are live. Raises PermissionError for a refused key, RuntimeError for
    a missing key or REST API, nats errors when NATS cannot be reached."""
    key = api_key or default_api_key()
    if not key:
        raise RuntimeError("no API key: set OPENTINKER_API_KEY (or OPENTINKER_API_KEY_FILE)")
    user = await asyncio.to_thread(whoami, default_api_url(api_url), key)
    bus = await Bus.connect(default_nats_url(nats_url), "envhost", token=key)
    bus.tenant = True
    try:
        host = EnvHost(envs, new_host_id(), max_concurrency, episode_ttl_s, owner=user,
                       max_reply_bytes=ENV_REPLY_BYTES)
        subs = await serve_envs(bus, host)
        log.info("envhost %s serving %s as user %r's own envs", host.host_id, ", ".join(envs), user)
        if on_ready is not None:
            on_ready(host)
        await hold(host, subs, stop)
    finally:
        await bus.close()


@dataclass
class TenantEnvHost:
    """A tenant envhost running in a background thread (start_in_thread)."""

    user: str = ""
    names: list[str] = field(default_factory=list)
    host_id: str = ""
    _loop: asyncio.AbstractEventLoop | None = None
    _stop: asyncio.Event | None = None
    _thread: threading.Thread | None = None

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving: unsubscribe, drop the episodes, close the connection."""
        if self._loop is not None and self._stop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


def start_in_thread(envs: dict[str, type[AbstractGame]], *, nats_url: str | None = None,
                    api_key: str | None = None, api_url: str | None = None, max_concurrency: int = 16,
                    timeout_s: float = 60.0) -> TenantEnvHost:
    """Serve `envs` from this process (a daemon thread with its own event loop) as the
    API key's user's own envs; returns once the subscriptions are live.

    Raises PermissionError (key refused), RuntimeError (no key, no REST API, NATS not
    reachable, or not ready within `timeout_s`), each naming the problem."""
    handle = TenantEnvHost(names=list(envs))
    ready = threading.Event()
    failed: list[BaseException] = []

    def on_ready(host: EnvHost) -> None:
        handle.user, handle.host_id = host.owner, host.host_id
        ready.set()

    def run() -> None:
        loop = asyncio.new_event_loop()
        handle._loop, handle._stop = loop, asyncio.Event()
        try:
            loop.run_until_complete(serve(envs, stop=handle._stop, nats_url=nats_url, api_key=api_key,
                                          api_url=api_url, max_concurrency=max_concurrency, on_ready=on_ready))
        except BaseException as e:  # reported to the caller of start_in_thread
            failed.append(e)
        finally:
            ready.set()
            loop.close()

    handle._thread = threading.Thread(target=run, name="opentinker-envhost", daemon=True)
    handle._thread.start()
    ready.wait(timeout_s)
    if failed:
        e = failed[0]
        raise e if isinstance(e, (PermissionError, RuntimeError)) else RuntimeError(
            f"the envhost could not start: {type(e).__name__}: {e}") from e
    if not handle.host_id:
        handle.stop()
        raise RuntimeError(f"the envhost was not serving within {timeout_s:.0f} s")
    return handle


def run_cli(envs: dict[str, type[AbstractGame]], argv: list[str] | None = None) -> None:
    """`opentinker envhost --env ...` as a tenant (no service credentials, an API key):
    serve until SIGINT/SIGTERM. Settings as every service: [--config FILE] [KEY=VALUE]."""
    from opentinker.services.core.config import main_settings
    from opentinker.services.core.runner import install_signal_handlers

    settings = main_settings("envhost", argv)

    async def _main() -> None:
        stop = asyncio.Event()
        install_signal_handlers(stop, "envhost")
        await serve(envs, stop=stop, nats_url=default_nats_url(_explicit_url(settings)),
                    max_concurrency=settings.envhost_max_concurrency,
                    episode_ttl_s=settings.envhost_episode_ttl_s)

    try:
        asyncio.run(_main())
    except (PermissionError, RuntimeError, OSError, nats.errors.Error) as e:
        sys.exit(f"opentinker envhost: {e}")


def _explicit_url(settings: Any) -> str | None:
    return settings.nats_url if settings.nats_url != "nats://127.0.0.1:4222" else None
