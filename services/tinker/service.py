"""The tinker service: Thinking Machines' Tinker API over HTTP, backed by the bus.

Role: answer the official `tinker` SDK (api.py) as the calling user. A training
client's model is a tinker job (`algorithm = "tinker"`) the scheduler places on a
learner, which executes the client's operations in order (learner/tinker_run.py).
Nothing here trains or holds model state: a restarted service picks up every session
and future from the bus.

Reads:  KV `ot_jobs` (a model's owner and state), `ot_users` / `ot_keys` (API keys),
        `ot_tinker` (sessions, run and save metadata), `ot_tinker_seqs` (recorded samples);
        `ot.job.<id>.results.<seq>` (OT_TINKER, by direct get);
        the object stores `ot_checkpoints` / `ot_weights` (a model's saves, runs.py).
Writes: `ot.ctl.submit` (request/reply: a model's job, as the user); `ot.job.<id>.ops.<seq>`
        and `.ops.close` (OT_TINKER); KV `ot_tinker`, `ot_tinker_seqs` (records.py).
        Purges retrieved futures' messages from OT_TINKER (sessions.py); deletes a
        save's object when its owner deletes the checkpoint or its ttl passes (runs.py).
Listens: http://<tinker_host>:<tinker_port>/api/v1 (X-API-Key authenticated; loopback
        by default).

Run: `python -m opentinker.services.tinker [tinker_port=8471] [KEY=VALUE ...]`
(`opentinker serve tinker`), then `TINKER_BASE_URL=http://127.0.0.1:8471
TINKER_API_KEY=tml-<your OpenTinker API key>`.
"""

from __future__ import annotations

import asyncio
import json
import os
import logging
import time
from pathlib import Path

from opentinker.services.core.bus import Bus
from opentinker.services.core.config import Settings
from opentinker.services.core.http import serve_http
from opentinker.services.core.runner import run_service
from opentinker.services.tinker.api import make_app
from opentinker.services.tinker.runs import EXPIRE_EVERY_S, Runs
from opentinker.services.tinker.sessions import Gateway

log = logging.getLogger("opentinker.tinker")

SERVICE = "tinker"


async def body(settings: Settings, bus: Bus, stop: asyncio.Event) -> None:
    admin_key = ""
    if os.environ.get("OPENTINKER_ADMIN_KEY_FILE"):  # the reaper cancels idle sessions' sampling jobs with it
        admin_key = Path(os.environ["OPENTINKER_ADMIN_KEY_FILE"]).read_text().strip()
    gw = Gateway(bus, settings.home, admin_key=admin_key or os.environ.get("OPENTINKER_ADMIN_KEY", ""),
                 settings=settings)
    runs = Runs(bus)
    server = await serve_http(make_app(gw, runs), settings.tinker_host, settings.tinker_port, settings.tinker_fd)
    url = f"http://{settings.tinker_host}:{server.port}"
    (Path(settings.home) / "tinker.json").write_text(json.dumps({"base_url": url}))
    log.info("Tinker API on %s (TINKER_BASE_URL)", url)
    next_expiry = 0.0
    try:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), reap_every_s(settings))
            except TimeoutError:
                try:
                    reaped = await gw.reap()
                    expired = []
                    if time.monotonic() >= next_expiry:
                        expired, next_expiry = await runs.expire(), time.monotonic() + EXPIRE_EVERY_S
                except Exception:  # the bus blinked: the next round tries again
                    log.exception("reaping sessions failed")
                    continue
                if reaped:
                    log.info("finished %d sessions and jobs: %s", len(reaped), ", ".join(reaped))
                if expired:
                    log.info("deleted %d saves past their ttl_seconds: %s", len(expired), ", ".join(expired))
    finally:
        await server.stop()


def reap_every_s(settings: Settings) -> float:
    """How often sessions are reaped: a tenth of the shortest of their limits, 1 s to 30 s."""
    return min(30.0, max(1.0, min(settings.tinker_heartbeat_timeout_s, settings.tinker_session_idle_s) / 10))


def main(argv: list[str] | None = None) -> None:
    run_service(SERVICE, body, argv)
