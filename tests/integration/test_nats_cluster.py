"""A 3-node NATS cluster (routes on loopback, JetStream at 3 replicas): one node
SIGKILLed mid-job, and not brought back, costs nothing. Services and the client
reconnect to the surviving nodes, the streams' leaders move there, the job completes on
its first attempt, and every trajectory on the stream is in the log."""

import asyncio
import signal
import time

import pytest

from opentinker.schemas import JobState, Metrics
from opentinker.schemas import subjects as S
from opentinker.sdk import Client
from opentinker.services.core.nats_server import NatsCluster

from conftest import start_logged_stack, stream_and_log, submit_when_ready

STEPS = 8
KILL_AT = 3


async def stream_info(client, stream: str):
    """A stream's info, retried as the services' calls are (a JetStream API request has
    no responder while the cluster elects a meta leader)."""
    return await client.bus._retry(f"stream info {stream}", client.bus.js.stream_info, stream)


@pytest.mark.timeout(900)
async def test_a_node_killed_mid_job_loses_no_step_and_no_trajectory(tmp_path, home, tiny_model, monkeypatch):
    cluster = NatsCluster(tmp_path / "nats", 3, auth=True, log_dir=tmp_path).start()
    services, procs, spec = start_logged_stack(cluster, home, tmp_path, monkeypatch, STEPS, "cluster",
                                               OPENTINKER_NATS_REPLICAS="3")
    client = await Client.connect(cluster.url)
    try:
        job = await submit_when_ready(client, {**spec, "model": tiny_model}, f"cluster-{int(time.time())}", services)
        deadline = time.monotonic() + 300
        while not any(m.step >= KILL_AT for m in await client.bus.read_subject(S.job(job.id, "metrics"), Metrics)):
            assert time.monotonic() < deadline, services.logs()
            await asyncio.sleep(0.3)
        # every stream, KV bucket and object store is on all three nodes
        for stream in [*S.STREAMS, f"KV_{S.KV_JOBS}", f"KV_{S.KV_WORKERS}", f"OBJ_{S.OBJ_WEIGHTS}"]:
            info = await stream_info(client, stream)
            assert info.config.num_replicas == 3 and len(info.cluster.replicas or []) == 2, (stream, info.cluster)
        # the node leading the trajectory stream dies, for good
        leader = (await stream_info(client, S.STREAM_TRAJ)).cluster.leader
        victim = next(n for n in cluster.nodes if n.cluster["server_name"] == leader)
        victim.proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(victim.proc.wait, 10)

        try:
            rec = await job.wait(timeout_s=600, raise_on_failure=False)
        except TimeoutError:  # a service stalled (once: the rollout worker): say where each one waits
            services.dump_stacks()
            raise AssertionError(f"job {job.id} not done 600 s after the kill\n{services.logs(30000)}") from None
        assert rec.state == JobState.COMPLETED, (rec.reason, services.logs())
        assert rec.attempt == 1, rec.history  # no job requeued over the node's loss
        assert all(p.poll() is None for p in procs), services.logs()
        now_leader = (await stream_info(client, S.STREAM_TRAJ)).cluster.leader
        assert now_leader and now_leader != leader
        on_stream, in_log = await stream_and_log(client, job.id, tmp_path / "data", STEPS)
        print(f"node {leader} killed after step {KILL_AT}; trajectories on the stream {on_stream}, "
              f"in the log {in_log}; leader now {now_leader}")
        assert in_log == on_stream >= STEPS * 2 * 2  # every trajectory the stream holds is in the log
    finally:
        await client.close()
        services.stop_all()
        cluster.stop()


@pytest.mark.timeout(300)
async def test_a_service_started_before_the_last_node_joins_waits_for_it(tmp_path):
    """Two nodes of three up: JetStream answers but cannot place 3 replicas ("no suitable
    peers", err 10005). A service starting then waits for the third node instead of
    crashing (it once left a CI run's envhost dead and every job refused)."""
    from opentinker.services.core.bus import Bus

    cluster = NatsCluster(tmp_path / "nats", 3)
    for node in cluster.nodes[:2]:
        node.start()
    bus = await Bus.connect(",".join(n.url for n in cluster.nodes[:2]), service="test")
    try:
        topology = asyncio.create_task(bus.ensure_topology(replicas=3))
        await asyncio.sleep(3)
        assert not topology.done(), topology.exception()  # waiting, not failed
        cluster.nodes[2].start()
        await asyncio.wait_for(topology, 150)
        info = await bus._retry("stream info", bus.js.stream_info, S.STREAM_TRAJ)
        assert info.config.num_replicas == 3 and len(info.cluster.replicas or []) == 2, info.cluster
    finally:
        await bus.close()
        cluster.stop()
