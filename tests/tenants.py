"""A shared stack for the adversarial tests (tests/adversarial/): an authenticating
nats-server and every service, two users (alice, bob) and alice's training job running
while bob attacks. The `world` fixture (tests/conftest.py) starts it once per session."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import Any
from pathlib import Path

import httpx
import msgspec
import nats

from opentinker.schemas import DeadLetter
from opentinker.schemas import subjects as S
from opentinker.sdk import Client
from opentinker.services.core.bus import Bus
from opentinker.services.core.nats_server import NatsServer, free_port

ADMIN_KEY = os.environ["OPENTINKER_ADMIN_KEY"]
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
A_STEPS = 24
MAX_UNFINISHED = 3  # the scheduler's max_unfinished_jobs_per_user in this stack
FINISHED_KEPT = 10  # and its finished_jobs_per_user
# the tinker service's and learners' per-user limits in this stack (Settings)
TINKER_IDLE_S = 40
TINKER_POLLS = 8
TINKER_INFLIGHT_BYTES = 6 * 1024 * 1024
STORE_BYTES = 1024 * 1024


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@dataclass
class World:
    server: NatsServer
    services: Any  # conftest.Services
    procs: dict
    api: httpx.AsyncClient
    api_url: str
    tinker_url: str
    data_dir: Path
    tiny_model: str
    alice_key: str
    bob_key: str
    alice: Client
    bob: Client
    service: Bus
    a_job: str
    env: dict = field(default_factory=dict)  # what every service of the stack was started with
    a_metrics: list = field(default_factory=list)
    follower: asyncio.Task | None = None

    def alive(self) -> dict[str, int | None]:
        return {name: p.poll() for name, p in self.procs.items()}


async def wait_http_ok(url: str, timeout_s: float = 40.0) -> None:
    """Wait until GET `url` answers 200 (a service's health route), at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=5) as http:
        while time.monotonic() < deadline:
            try:
                if (await http.get(url)).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.2)


async def make_user(api: httpx.AsyncClient, name: str) -> str:
    r = await api.post("/v1/users", json={"name": name}, headers=ADMIN)
    assert r.status_code == 201, r.text
    r = await api.post(f"/v1/users/{name}/keys", json={"label": "adversarial"}, headers=ADMIN)
    assert r.status_code == 201, r.text
    return r.json()["key"]


async def start_world(tmp: Path, home: Path, tiny_model: str, services_cls):
    """Start the stack, make alice and bob, submit alice's job; yields the World, then
    stops everything it started (by PID)."""
    server = NatsServer(tmp / "nats", auth=True).start()
    services = services_cls(server.url, home, tmp)
    data_dir = tmp / "data"
    env = {"NATS_NKEY": str(server.service_seed_file), **server.scheduler_env(),
           "OPENTINKER_DATA_DIR": str(data_dir),
           "OPENTINKER_MAX_UNFINISHED_JOBS_PER_USER": str(MAX_UNFINISHED),
           "OPENTINKER_FINISHED_JOBS_PER_USER": str(FINISHED_KEPT),
           "OPENTINKER_TINKER_SESSION_IDLE_S": str(TINKER_IDLE_S),
           "OPENTINKER_TINKER_POLLS_PER_USER": str(TINKER_POLLS),
           "OPENTINKER_TINKER_INFLIGHT_BYTES_PER_USER": str(TINKER_INFLIGHT_BYTES),
           "OPENTINKER_STORE_BYTES_PER_USER": str(STORE_BYTES)}
    port, tinker_port = free_port(), free_port()
    procs = {"scheduler": services.start("scheduler", f"api_port={port}", env=env),
             "envhost": services.start("envhost", env=env),
             "recorder": services.start("recorder", "recorder_flush_s=0.5", env=env),
             "learner-1": services.start("learner", "worker_id=adv-l1", env=env),
             "learner-2": services.start("learner", "worker_id=adv-l2", env=env),
             "rollout": services.start("rollout", "engine=hf", "worker_id=adv-r1", "env_step_timeout_s=10", env=env),
             "tinker": services.start("tinker", f"tinker_port={tinker_port}", env=env)}
    api_url = f"http://127.0.0.1:{port}"
    tinker_url = f"http://127.0.0.1:{tinker_port}"
    api = httpx.AsyncClient(base_url=api_url, timeout=30)
    await wait_http_ok(api_url + "/v1/health")
    await wait_http_ok(tinker_url + "/api/v1/healthz")
    alice_key, bob_key = await make_user(api, "alice"), await make_user(api, "bob")
    alice = await Client.connect(server.url, api_key=alice_key, api_url=api_url)
    bob = await Client.connect(server.url, api_key=bob_key, api_url=api_url)
    service = await Bus.connect(server.url, "attacker", nkeys_seed=str(server.service_seed_file))
    job = await alice.submit(alice_spec(tiny_model, "alice", A_STEPS))
    for _ in range(600):  # the attacks begin once alice's job trains
        if (await job.record()).placement is not None:
            break
        await asyncio.sleep(0.2)
    w = World(server, services, procs, api, api_url, tinker_url, data_dir, tiny_model, alice_key, bob_key, alice, bob,
              service, job.id, env)

    async def follow() -> None:
        async for m in job.metrics():
            w.a_metrics.append(m)

    w.follower = asyncio.create_task(follow())
    yield w
    w.follower.cancel()
    for c in (alice, bob):
        await c.close()
    await service.close()
    await api.aclose()
    services.stop_all()
    server.stop()


def alice_spec(model: str, name: str, steps: int) -> dict:
    """The training job alice runs while bob attacks."""
    return {"name": name, "model": model, "env": "arith", "engine": "hf", "steps": steps,
            "prompts_per_step": 2, "group_size": 2, "lora_rank": 4, "checkpoint_every": 8,
            "micro_batch_size": 4, "sampling": {"max_new_tokens": 8, "max_total_tokens": 256}}


@dataclass
class Training:
    """A job of alice's training while a test module's attacks run, and its metrics."""

    job: Any
    steps: int
    metrics: list = field(default_factory=list)
    follower: asyncio.Task | None = None


async def alice_trains(w: World, name: str, steps: int) -> Training:
    """Submit a training job of alice's and follow its metrics."""
    t = Training(await w.alice.submit(alice_spec(w.tiny_model, name, steps)), steps)

    async def follow() -> None:
        async for m in t.job.metrics():
            t.metrics.append(m)

    t.follower = asyncio.create_task(follow())
    return t


async def alice_completed(w: World, t: Training, timeout_s: float = 600) -> None:
    """Assert alice's job completed with every step reported once, and no service exited."""
    from opentinker.schemas import JobState

    rec = await t.job.wait(timeout_s=timeout_s, raise_on_failure=False)
    assert rec.state == JobState.COMPLETED, (rec.reason, w.services.logs())
    await asyncio.wait_for(t.follower, 60)
    steps = sorted(m.step for m in t.metrics if m.split == "train")
    assert steps == list(range(t.steps)), steps
    assert all(code is None for code in w.alive().values()), (w.alive(), w.services.logs())


async def user_connection(url: str, key: str) -> tuple[nats.NATS, list[str]]:
    """A tenant's own raw NATS connection (what a hostile SDK could do); returns it and
    the errors the server tells it."""
    errors: list[str] = []

    async def on_error(e):
        errors.append(str(e))

    nc = await nats.connect(url, token=key, error_cb=on_error, allow_reconnect=False, connect_timeout=5)
    return nc, errors


async def dead_letters(service: Bus, name: str, since_s: float, want, timeout_s: float = 30) -> list[DeadLetter]:
    """The dead letters of service `name` (every service with name "*") published after
    `since_s` (unix time), once `want(letters)` holds or after `timeout_s`. Read with an
    ephemeral consumer starting at that time (the dead-letter stream may hold many)."""
    import datetime

    from nats.js import api

    start = datetime.datetime.fromtimestamp(since_s - 1, datetime.timezone.utc).isoformat()
    sub = await service.js.pull_subscribe(
        S.dead_letter(name) if name != "*" else "ot.dlq.>", stream="OT_DLQ",
        config=api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_TIME, opt_start_time=start,
                                  ack_policy=api.AckPolicy.NONE, inactive_threshold=30.0))
    got: list[DeadLetter] = []
    deadline = time.monotonic() + timeout_s
    try:
        while not (want(got) or time.monotonic() > deadline):
            for m in await service.fetch(sub, 512, 0.5):
                d = msgspec.msgpack.decode(m.data, type=DeadLetter)
                if d.time_s >= since_s:
                    got.append(d)
    finally:
        await sub.unsubscribe()
    return got
