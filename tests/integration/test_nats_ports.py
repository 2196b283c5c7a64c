"""A port picked for a nats-server (free_port) can be bound by another process before
the server binds it, as another pytest worker's server did in a CI run: the cluster's
node exited on "address already in use", its client port answered from the other
server, and the cluster looked ready with two nodes. A server is up only when its port
is one its own log says it listens on; a picked port taken meanwhile is picked again."""

import json
import socket

import pytest

from opentinker.services.core.nats_server import NatsCluster, NatsServer, PortTaken


def server_info(port: int) -> dict:
    """The INFO line a NATS server sends on connect (its `server_id` is its own)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        line = conn.makefile("rb").readline()
    assert line.startswith(b"INFO "), line
    return json.loads(line[5:])


@pytest.fixture
def other(tmp_path):
    """Another process's nats-server: the squatter."""
    srv = NatsServer(tmp_path / "other").start()
    yield srv
    srv.stop()


def test_a_server_whose_picked_port_another_server_took_starts_on_a_fresh_one(tmp_path, other):
    srv = NatsServer(tmp_path / "nats")
    srv.port = other.port  # as if the other server had bound the port picked for this one
    try:
        srv.start()
        assert srv.port != other.port
        assert server_info(srv.port)["server_id"] != server_info(other.port)["server_id"]
        assert srv.proc.poll() is None
    finally:
        srv.stop()


def test_a_port_given_and_taken_is_refused_naming_it(tmp_path, other):
    with socket.socket() as plain:  # not even a NATS server
        plain.bind(("127.0.0.1", 0))
        plain.listen()
        port = plain.getsockname()[1]
        with pytest.raises(PortTaken):
            NatsServer(tmp_path / "a", port=port).start()
    with pytest.raises(PortTaken, match=f"127.0.0.1:{other.port}"):
        NatsServer(tmp_path / "b", port=other.port).start()


@pytest.mark.parametrize("which", ["client", "cluster"])
def test_a_cluster_whose_port_was_taken_starts_again_on_fresh_ports(tmp_path, other, which):
    cluster = NatsCluster(tmp_path / "nats", 3)
    node = cluster.nodes[1]
    if which == "client":
        node.port = other.port
    else:  # every node routes to it; the node itself exits when it cannot bind it
        for n in cluster.nodes:
            n.cluster = {**n.cluster, "routes": [other.port if p == node.cluster["port"] else p
                                                 for p in n.cluster["routes"]]}
        node.cluster = {**node.cluster, "port": other.port}
    try:
        cluster.start(timeout_s=60)
        ids = {server_info(n.port)["server_id"] for n in cluster.nodes}
        assert len(ids) == 3 and server_info(other.port)["server_id"] not in ids
        assert other.port not in [n.port for n in cluster.nodes] + [n.cluster["port"] for n in cluster.nodes]
        assert all(n.proc.poll() is None for n in cluster.nodes)
    finally:
        cluster.stop()
