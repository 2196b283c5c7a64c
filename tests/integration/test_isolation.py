"""Tenant isolation on NATS, against an authenticating nats-server (auth callout
answered by the scheduler) and every service on it with the service nkey: a user
connects with an API key and reaches only their own jobs' subjects; another user can
neither read nor publish there, nor use JetStream or the services' subjects; a wrong,
revoked or missing key is refused at connect. The job itself runs and is followed
through the SDK as that user (REST history, live NATS subscriptions)."""

import asyncio

import httpx
import nats
import pytest

from opentinker.schemas import JobState, Metrics
from opentinker.sdk import Client
from opentinker.services.core.bus import Bus
from opentinker.services.core.nats_server import NatsServer, free_port
from opentinker.services.core.natsauth import user_inbox_prefix
from opentinker.services.scheduler.users import key_id

from conftest import Services, follow
from test_api import ADMIN, make_user


@pytest.fixture
def secured(tmp_path, home):
    server = NatsServer(tmp_path / "nats", auth=True).start()
    services = Services(server.url, home, tmp_path)
    env = {"NATS_NKEY": str(server.service_seed_file),
           "OPENTINKER_NATS_CALLOUT_ISSUER_FILE": str(server.issuer_seed_file)}
    yield server, services, env
    services.stop_all()
    server.stop()


async def connect_raw(url: str, key: str) -> tuple[nats.NATS, list[str]]:
    """A user's own NATS connection with `key`; returns it and the errors it is told."""
    errors: list[str] = []

    async def on_error(e):
        errors.append(str(e))

    nc = await nats.connect(url, token=key, inbox_prefix=user_inbox_prefix(key_id(key)),
                            error_cb=on_error, allow_reconnect=False, connect_timeout=5)
    return nc, errors


async def refused(url: str, key: str | None) -> str:
    with pytest.raises(nats.errors.Error) as e:
        await nats.connect(url, token=key, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=5)
    return str(e.value)


async def test_users_reach_only_their_own_job_subjects(secured, tiny_model, job_id):
    server, services, env = secured
    api_port = free_port()
    services.start("scheduler", f"api_port={api_port}", env=env)
    services.start("envhost", env=env)
    services.start("learner", f"worker_id=l-{job_id}", env=env)
    services.start("rollout", "engine=hf", f"worker_id=r-{job_id}", env=env)
    api_url = f"http://127.0.0.1:{api_port}"
    async with httpx.AsyncClient(base_url=api_url, timeout=30) as api:
        for _ in range(150):
            try:
                if (await api.get("/v1/health")).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.2)
        alice_key = await make_user(api, "alice")
        bob_key = await make_user(api, "bob")
        r = await api.post("/v1/users/bob/keys", json={"label": "revoked"}, headers=ADMIN)
        revoked = r.json()["key"]
        assert (await api.delete(f"/v1/keys/{r.json()['key_id']}", headers=ADMIN)).status_code == 200

    # a bare connection (no credentials) is refused, and so is a wrong or revoked key
    assert "Authorization Violation" in await refused(server.url, None)
    assert "Authorization Violation" in await refused(server.url, "otk-" + "x" * 43)
    assert "Authorization Violation" in await refused(server.url, revoked)

    alice = await Client.connect(server.url, api_key=alice_key, api_url=api_url)
    bob = await Client.connect(server.url, api_key=bob_key, api_url=api_url)
    service = await Bus.connect(server.url, "test", nkeys_seed=str(server.service_seed_file))
    try:
        assert alice.is_user and bob.is_user
        spec = {"name": "iso", "model": tiny_model, "env": "arith", "engine": "hf", "steps": 2,
                "prompts_per_step": 2, "group_size": 2, "checkpoint_every": 100,
                "sampling": {"max_new_tokens": 8, "max_total_tokens": 256}}
        job = await alice.submit(spec, job_id=job_id)
        follower = asyncio.ensure_future(follow(job, 300, services))

        # bob, connected after alice's job exists, may touch none of it
        nc, errors = await connect_raw(server.url, bob_key)
        got: list[str] = []

        async def took(m):
            got.append(m.subject)

        for subject in (f"ot.job.{job_id}.>", f"ot.job.{job_id}.metrics", "ot.job.*.events", "_INBOX.>",
                        "ot.ctl.>", "$JS.API.>"):
            await nc.subscribe(subject, cb=took)
        for subject in (f"ot.job.{job_id}.events", f"ot.job.{job_id}.rollout.r-{job_id}",
                        f"ot.job.{job_id}.traj", f"ot.ctl.assign.learner.l-{job_id}"):
            await nc.publish(subject, b"forged")
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await nc.request("$JS.API.STREAM.INFO.OT_METRICS", b"", timeout=2)
        await nc.flush()
        await asyncio.sleep(1.0)
        for subject in (f"ot.job.{job_id}.>", f"ot.job.{job_id}.metrics", "ot.job.*.events", "_INBOX.>",
                        "ot.ctl.>", "$JS.API.>"):
            assert any(f'subscription to "{subject}"'.lower() in e.lower() for e in errors), (subject, errors)
        for subject in (f"ot.job.{job_id}.events", f"ot.job.{job_id}.rollout.r-{job_id}",
                        f"ot.job.{job_id}.traj", f"ot.ctl.assign.learner.l-{job_id}", "$JS.API.STREAM.INFO.OT_METRICS"):
            assert any(f'publish to "{subject}"'.lower() in e.lower() for e in errors), (subject, errors)

        # nor through the SDK and the REST API
        with pytest.raises(KeyError):
            await bob.job(job_id).record()
        assert [r.job_id for r in await bob.jobs()] == []
        assert [r.job_id for r in await alice.jobs()] == [job_id]

        # alice follows her job to the end as a user: history over REST, live over NATS
        metrics = await follower
        rec = await job.wait(timeout_s=60)
        assert rec.state == JobState.COMPLETED
        assert sorted(m.step for m in metrics if m.split == "train") == [0, 1]
        events = [e.state async for e in job.events()]
        assert events[-1] == JobState.COMPLETED and JobState.RUNNING in events

        # a service saw alice's metrics on the bus; bob's connection was given none of them
        on_bus = await service.read_subject(f"ot.job.{job_id}.metrics", Metrics)
        assert sorted(m.step for m in on_bus if m.split == "train") == [0, 1]
        assert got == [], got
        await nc.close()
    finally:
        await alice.close()
        await bob.close()
        await service.close()
