"""A nats-server killed (SIGKILL) mid-job and restarted 40 s later costs time,
never the job: every service reconnects by itself, every bus call in flight is retried
with backoff (services/core/bus.py), the scheduler requeues no healthy job while the
workers' heartbeats come back, and the job completes with every step and every
trajectory in the log.

Before: the first publish that failed in the outage failed the job (learner) or ended
the rollout process."""

import asyncio
import signal
import subprocess
import time

import pytest

from opentinker.schemas import JobState, Metrics
from opentinker.schemas import subjects as S
from opentinker.sdk import Client
from opentinker.services.core.nats_server import NatsServer

from conftest import start_logged_stack, stream_and_log, submit_when_ready, until

STEPS = 10


@pytest.mark.timeout(900)
async def test_a_nats_server_restart_mid_job_costs_time_not_the_job(tmp_path, home, tiny_model, monkeypatch):
    server = NatsServer(tmp_path / "nats", auth=True).start()
    services, procs, spec = start_logged_stack(server, home, tmp_path, monkeypatch, STEPS, "outage")
    client = await Client.connect(server.url)
    try:
        job = await submit_when_ready(client, {**spec, "model": tiny_model}, f"outage-{int(time.time())}", services)
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
        on_stream, in_log = await stream_and_log(client, job.id, tmp_path / "data", STEPS)
        assert in_log == on_stream > 0  # every trajectory the stream holds is in the log
    finally:
        await client.close()
        services.stop_all()
        server.stop()


@pytest.mark.timeout(300)
async def test_every_service_stops_on_sigterm_while_the_nats_server_is_gone(tmp_path, home, monkeypatch):
    """SIGTERM with no server to talk to: each service's work, stuck retrying a bus call
    (for up to bus.RETRY_FOR_S), is cancelled STOP_GRACE_S (5 s) after the signal and
    the process exits, within docker stop's 10 s. Before, the learner took 30 s and more
    (and in one CI run, minutes)."""
    from opentinker.services.core.runner import STOP_GRACE_S

    server = NatsServer(tmp_path / "nats", auth=True).start()
    services, procs, _ = start_logged_stack(server, home, tmp_path, monkeypatch, 1, "gone")
    try:
        async def all_ready() -> bool:
            logs = [f.read_text() for f in tmp_path.glob("*-*.log")]
            return len(logs) == len(procs) and all(("ready" in t or "serving" in t or "recording to" in t)
                                                   for t in logs)

        await until(all_ready, 180, services, "every service ready")
        server.proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(server.proc.wait, 10)
        await asyncio.sleep(3.0)  # each service's next bus call is now being retried
        t0 = time.monotonic()
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                await asyncio.to_thread(p.wait, max(1.0, STOP_GRACE_S + 10 - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{p.args} still running {time.monotonic() - t0:.0f} s after SIGTERM\n{services.logs()}")
        print(f"every service stopped {time.monotonic() - t0:.1f} s after SIGTERM with the server gone")
    finally:
        services.stop_all()
        server.stop()
