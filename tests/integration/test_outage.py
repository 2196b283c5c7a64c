"""A nats-server killed (SIGKILL) mid-job and restarted 40 s later costs time,
never the job: every service reconnects by itself, every bus call in flight is retried
with backoff (services/core/bus.py), the scheduler requeues no healthy job while the
workers' heartbeats come back, and the job completes with every step and every
trajectory in the log.

Before: the first publish that failed in the outage failed the job (learner) or ended
the rollout process."""

import asyncio
import signal
import time

import pytest

from opentinker.schemas import JobState, Metrics
from opentinker.schemas import subjects as S
from opentinker.sdk import Client
from opentinker.services.core.logdb import run_query
from opentinker.services.core.nats_server import NatsServer

from conftest import Services, submit_when_ready

STEPS = 10


@pytest.mark.timeout(900)
async def test_a_nats_server_restart_mid_job_costs_time_not_the_job(tmp_path, home, tiny_model, monkeypatch):
    server = NatsServer(tmp_path / "nats", auth=True).start()
    monkeypatch.setenv("NATS_NKEY", str(server.service_seed_file))  # this test's client is a service
    services = Services(server.url, home, tmp_path)
    env = {"NATS_NKEY": str(server.service_seed_file), **server.scheduler_env(),
           "OPENTINKER_DATA_DIR": str(tmp_path / "data")}
    procs = [services.start(name, *extra, env=env) for name, extra in
             (("scheduler", ()), ("envhost", ()), ("recorder", ("recorder_flush_s=0.5",)), ("learner", ()),
              ("rollout", ("engine=hf",)))]
    client = await Client.connect(server.url)
    try:
        spec = {"name": "outage", "model": tiny_model, "env": "arith", "engine": "hf", "lora_rank": 4,
                "prompts_per_step": 2, "group_size": 2, "steps": STEPS, "checkpoint_every": 5,
                "micro_batch_size": 4, "sampling": {"max_new_tokens": 8, "max_total_tokens": 256}}
        job = await submit_when_ready(client, spec, f"outage-{int(time.time())}")
        deadline = time.monotonic() + 300
        while not any(m.step >= 3 for m in await client.bus.read_subject(S.job(job.id, "metrics"), Metrics)):
            assert time.monotonic() < deadline, services.logs()
            await asyncio.sleep(0.3)
        server.proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(server.proc.wait, 10)
        # longer than JetStream's publish timeout (30 s: a publish in flight fails) and
        # than a heartbeat's life (10 s), shorter than the bus's retries (300 s)
        await asyncio.sleep(40.0)
        server.start()

        rec = await job.wait(timeout_s=600, raise_on_failure=False)
        assert rec.state == JobState.COMPLETED, (rec.reason, services.logs())
        assert rec.attempt == 1, rec.history  # no healthy job requeued over the outage
        assert all(p.poll() is None for p in procs), services.logs()
        for _ in range(60):  # the recorder's last flush
            _, rows = run_query(f"SELECT count(DISTINCT step) FROM metrics WHERE job_id = '{job.id}' "
                                "AND split = 'train'", tmp_path / "data")
            if rows[0][0] == STEPS:
                break
            await asyncio.sleep(0.5)
        assert rows[0][0] == STEPS
        on_stream = len(await client.bus.read_raw(S.job(job.id, "traj")))
        for _ in range(60):
            _, rows = run_query(f"SELECT count(DISTINCT episode_id) FROM trajectories WHERE job_id = '{job.id}'",
                                tmp_path / "data")
            if rows[0][0] == on_stream:
                break
            await asyncio.sleep(0.5)
        assert rows[0][0] == on_stream > 0  # every trajectory the stream holds is in the log
    finally:
        await client.close()
        services.stop_all()
        server.stop()
