"""The NATS cluster's configuration, without starting it: a cluster URL's servers, the
replicas every stream is made with, each node's routes (loopback only, every other
node), and the stack's refusal of a cluster that would survive no node's loss."""

import re

import pytest

from opentinker.ops.stack import Stack
from opentinker.schemas import subjects as S
from opentinker.services.core.bus import stream_config
from opentinker.services.core.config import server_list
from opentinker.services.core.nats_server import NatsCluster


def test_a_cluster_url_lists_its_nodes():
    assert server_list("nats://a:1") == ["nats://a:1"]
    assert server_list("nats://a:1, nats://b:2,nats://c:3") == ["nats://a:1", "nats://b:2", "nats://c:3"]
    with pytest.raises(ValueError, match="nats_url"):
        server_list(" , ")


def test_streams_are_made_with_the_replicas_asked_for():
    assert all(stream_config(name).num_replicas == 1 for name in S.STREAMS)
    assert all(stream_config(name, replicas=3).num_replicas == 3 for name in S.STREAMS)


def test_each_node_routes_to_every_other_on_loopback(tmp_path):
    cluster = NatsCluster(tmp_path, 3)
    confs = [n._cluster_config() for n in cluster.nodes]
    cports = [n.cluster["port"] for n in cluster.nodes]
    for i, conf in enumerate(confs):
        assert f'server_name: "n{i}"' in conf and f'listen: "127.0.0.1:{cports[i]}"' in conf
        routes = re.findall(r"nats://([\d.]+):(\d+)", conf)
        assert sorted(int(p) for _, p in routes) == sorted(p for j, p in enumerate(cports) if j != i)
        assert {h for h, _ in routes} == {"127.0.0.1"}
    assert cluster.url == ",".join(n.url for n in cluster.nodes) and len(set(cluster.url.split(","))) == 3
    # one auth folder: every node trusts the same service key and callout issuer
    assert len({n.service_seed_file for n in cluster.nodes}) == 1
    with pytest.raises(ValueError, match="at least 1"):
        NatsCluster(tmp_path, 0)


def test_the_stack_runs_a_cluster_with_three_replicas_and_refuses_two_nodes(tmp_path):
    stack = Stack(tmp_path, nats_url="nats://127.0.0.1:1,nats://127.0.0.1:2,nats://127.0.0.1:3", cluster=5)
    env = stack.child_env("learner")
    assert env["OPENTINKER_NATS_REPLICAS"] == "3" and env["NATS_URL"].count(",") == 2
    assert "OPENTINKER_NATS_REPLICAS" not in Stack(tmp_path, nats_url="nats://127.0.0.1:1").child_env("learner")
    with pytest.raises(ValueError, match="2 would survive no loss"):
        Stack(tmp_path, cluster=2)
