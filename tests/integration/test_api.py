"""The scheduler's REST API against a running scheduler process: users and keys,
per-user isolation, refusals with clear 401/403/404/422, and fuzzing from its own
OpenAPI spec (schemathesis)."""

import asyncio
import os
import re
import subprocess
import sys
import uuid

import httpx
import pytest

from opentinker.schemas import decode
from opentinker.schemas import subjects as S
from opentinker.schemas.users import ApiKey
from opentinker.services.core.bus import Bus
from opentinker.services.core.nats_server import NatsServer, free_port

from conftest import Services

ADMIN = {"Authorization": f"Bearer {os.environ['OPENTINKER_ADMIN_KEY']}"}


async def start_api(services) -> str:
    """A scheduler with its REST API on a free loopback port; returns the base URL."""
    port = free_port()
    services.start("scheduler", f"api_port={port}")
    url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient() as c:
        for _ in range(100):
            try:
                if (await c.get(f"{url}/v1/health")).status_code == 200:
                    return url
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.2)
    pytest.fail(f"no API at {url}\n{services.logs()}")


@pytest.fixture
async def api(services):
    url = await start_api(services)
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        yield c


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


async def make_user(api, name: str, **kw) -> str:
    r = await api.post("/v1/users", json={"name": name, **kw}, headers=ADMIN)
    assert r.status_code == 201, r.text
    r = await api.post(f"/v1/users/{name}/keys", json={"label": "test"}, headers=ADMIN)
    assert r.status_code == 201, r.text
    return r.json()["key"]


async def test_keys_are_checked_and_users_see_only_their_own_jobs(api, bus, job_id):
    assert (await api.get("/v1/health")).json()["status"] == "ok"  # no key needed

    r = await api.get("/v1/jobs")
    assert r.status_code == 401 and "missing API key" in r.json()["detail"]["error"]
    assert r.headers["www-authenticate"] == "Bearer"
    r = await api.get("/v1/jobs", headers=bearer("otk-" + "x" * 43))
    assert r.status_code == 401 and r.json()["detail"]["error"] == "invalid API key"

    alice, bob = f"alice-{job_id}", f"bob-{job_id}"
    ka, kb = await make_user(api, alice), await make_user(api, bob)
    r = await api.post("/v1/users", json={"name": "eve"}, headers=bearer(kb))
    assert r.status_code == 403 and "not an admin" in r.json()["detail"]["error"]
    r = await api.post("/v1/users", json={"name": alice}, headers=ADMIN)
    assert r.status_code == 409

    # keys are stored as argon2id hashes, never the key itself
    raw = b"".join(v for v, _ in (await bus.kv_values(S.KV_KEYS)).values())
    assert ka.encode() not in raw and kb.encode() not in raw
    mine = [decode(v, ApiKey) for v, _ in (await bus.kv_values(S.KV_KEYS)).values()]
    assert all(k.hash.startswith("$argon2id$") for k in mine if k.user in (alice, bob))

    # a bad spec names the field; a good one is accepted for alice
    r = await api.post("/v1/jobs", json={"spec": {"env": "arith", "group_size": 1}}, headers=bearer(ka))
    assert r.status_code == 422 and r.json()["detail"]["field"] == "spec.group_size"
    r = await api.post("/v1/jobs", json={"spec": {"env": "arith", "steps": 2}, "job_id": job_id},
                       headers=bearer(ka))
    assert r.status_code == 201 and r.json()["job_id"] == job_id
    got = (await api.get(f"/v1/jobs/{job_id}", headers=bearer(ka))).json()
    assert got["user"] == alice and got["state"] == "queued"

    # bob can neither see nor cancel it; the admin sees it
    assert (await api.get(f"/v1/jobs/{job_id}", headers=bearer(kb))).status_code == 404
    assert job_id not in [j["job_id"] for j in (await api.get("/v1/jobs", headers=bearer(kb))).json()]
    assert (await api.post(f"/v1/jobs/{job_id}/cancel", headers=bearer(kb))).status_code == 404
    assert (await api.get(f"/v1/jobs/{job_id}/metrics", headers=bearer(kb))).status_code == 404
    assert job_id in [j["job_id"] for j in (await api.get("/v1/jobs", headers=ADMIN)).json()]

    r = await api.post(f"/v1/jobs/{job_id}/cancel", json={"reason": "done testing"}, headers=bearer(ka))
    assert r.status_code == 200 and r.json()["state"] == "cancelled"
    events = (await api.get(f"/v1/jobs/{job_id}/events", headers=bearer(ka))).json()
    assert [e["state"] for e in events][-1] == "cancelled"

    # bob may not revoke alice's key; alice may, and then it is refused
    kid = next(k["key_id"] for k in (await api.get(f"/v1/users/{alice}/keys", headers=bearer(ka))).json())
    assert (await api.delete(f"/v1/keys/{kid}", headers=bearer(kb))).status_code == 404
    assert (await api.get(f"/v1/users/{alice}/keys", headers=bearer(kb))).status_code == 403
    assert (await api.delete(f"/v1/keys/{kid}", headers=bearer(ka))).status_code == 200
    r = await api.get("/v1/me", headers=bearer(ka))
    assert r.status_code == 401 and "revoked" in r.json()["detail"]["error"]
    assert (await api.get("/v1/me", headers=bearer(kb))).json()["name"] == bob


async def test_the_sdk_refuses_a_wrong_key(services, nats_url):
    from opentinker.sdk import AuthenticationError, Client

    services.start("scheduler")
    async with await Client.connect(nats_url, api_key="otk-not-a-key") as c:
        for _ in range(50):
            try:
                await c.submit({"env": "arith"})
            except AuthenticationError as e:
                assert "invalid API key" in str(e)
                break
            except Exception:  # the scheduler is still starting
                await asyncio.sleep(0.2)
        else:
            pytest.fail("no refusal")


@pytest.mark.timeout(600)
async def test_rest_api_fuzzed_from_its_openapi_spec(home, tmp_path):
    """Every operation, with bodies and parameters generated from /openapi.json, as an
    admin: no answer is a 5xx. On a NATS server of its own: the fuzzer may revoke any key
    it can list (the bootstrap admin's too), which later tests must not inherit."""
    server = NatsServer(tmp_path / "nats").start()
    services = Services(server.url, home, tmp_path)
    try:
        await fuzz(services, tmp_path)
    finally:
        services.stop_all()
        server.stop()


async def fuzz(services, tmp_path) -> None:
    url = await start_api(services)
    async with httpx.AsyncClient(base_url=url, timeout=30) as api:
        fuzz_key = await make_user(api, f"fuzz-{uuid.uuid4().hex[:8]}", role="admin")
    config = tmp_path / "schemathesis.toml"
    # the key reaches schemathesis through its environment, never its command line
    config.write_text('headers = { Authorization = "Bearer ${OT_FUZZ_KEY}" }\n')
    env = dict(os.environ, OT_FUZZ_KEY=fuzz_key)
    cmd = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run",
           f"{url}/openapi.json", "--checks", "not_a_server_error", "--max-examples", "25",
           "--generation-deterministic", "--report", "junit", "--report-dir", str(tmp_path / "report")]
    out = await asyncio.to_thread(subprocess.run, cmd, env=env, capture_output=True, text=True, timeout=540,
                                  cwd=tmp_path)  # its cache stays out of the repo
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:] + services.logs()
    # every generated case passed (schemathesis may warn that most generated jobs are
    # refused: their `env` names no env anyone serves, which the scheduler checks)
    counts = re.search(r"(\d+) generated, (\d+) passed", out.stdout)
    assert "Tested: 16" in out.stdout and counts and counts[1] == counts[2], out.stdout
    # the key reached the handlers: the fuzzer made users and jobs
    bus = await Bus.connect(services.nats_url, "test")
    try:
        assert len(await bus.kv_values(S.KV_USERS)) > 2  # admin, fuzz-..., the fuzzer's
        assert await bus.kv_values(S.KV_JOBS)
    finally:
        await bus.close()
