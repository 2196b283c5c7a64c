"""compose/ without a Docker engine: the compose file validates against the Compose
Specification's JSON schema (check-jsonschema's vendored copy) and has the topology of
`opentinker up`; the Dockerfile passes hadolint; no secret is baked into the image."""

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose" / "docker-compose.yml"
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    return str(BIN / name) if (BIN / name).exists() else shutil.which(name) or name


def test_the_compose_file_validates_against_the_compose_spec_schema():
    out = subprocess.run([tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_broken_compose_file_is_caught(tmp_path):
    doc = yaml.safe_load(COMPOSE.read_text())
    doc["services"]["nats"]["imagee"] = "nats:2.11-alpine"  # a typo the spec does not allow
    doc["services"]["nats"]["healthcheck"]["retries"] = [10]
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(yaml.safe_dump(doc))
    out = subprocess.run([tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(bad)],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "imagee" in out.stdout + out.stderr, out.stdout


def test_the_stack_has_the_topology_of_opentinker_up():
    from opentinker.ops.stack import SERVICES

    svc = yaml.safe_load(COMPOSE.read_text())["services"]
    for name in SERVICES:
        cpu = name if name in svc else f"{name}-cpu"
        assert cpu in svc and "cpu" in svc[cpu]["profiles"], name
        assert svc[cpu]["restart"] == "unless-stopped" and "service_nkey" in svc[cpu]["secrets"], name
        assert svc[cpu]["environment"]["NATS_NKEY"] == "/run/secrets/service_nkey", name
        assert svc[cpu]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4318", name
    for gpu in ("rollout-gpu", "learner-gpu"):
        devices = svc[gpu]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"] and "gpu" in svc[gpu]["profiles"]
    assert svc["nats"]["healthcheck"]["test"] and "nats-box" in svc
    assert "callout_issuer" in svc["scheduler"]["secrets"] and svc["scheduler"]["healthcheck"]["test"]
    collector = yaml.safe_load((ROOT / "compose" / "otel-collector.yaml").read_text())
    assert "otlp" in collector["service"]["pipelines"]["traces"]["receivers"] and "otel-collector" in svc
    # ports published on the host's loopback only
    for s in svc.values():
        assert all(str(p).startswith("127.0.0.1:") for p in s.get("ports", [])), s
    assert "include ./nats-keys/auth.conf" in (ROOT / "compose" / "nats.conf").read_text()


def test_the_dockerfile_passes_hadolint_and_bakes_in_no_secret():
    out = subprocess.run([tool("hadolint"), str(ROOT / "compose" / "Dockerfile")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    ignored = (ROOT / ".dockerignore").read_text().split()
    for secret in (".opentinker", ".venv", "compose/admin.key", "compose/nats-keys"):
        assert secret in ignored, secret


CLUSTER = ROOT / "compose" / "cluster.yml"


def test_the_cluster_overlay_reaches_every_service_and_its_node_config_parses(tmp_path):
    from opentinker.ops.keys import COMPOSE_NODES, write_nats_keys
    from opentinker.services.core.nats_server import server_binary

    out = subprocess.run([tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(CLUSTER)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    base, overlay = (yaml.safe_load(p.read_text())["services"] for p in (COMPOSE, CLUSTER))
    nodes = ",".join(f"nats://{n}:4222" for n in COMPOSE_NODES)
    for name, svc in base.items():  # every client of NATS gets all three nodes
        if "NATS_URL" in (svc.get("environment") or {}):
            env = overlay[name]["environment"]
            assert env["NATS_URL"] == nodes, name
            assert name == "nats-box" or env["OPENTINKER_NATS_REPLICAS"] == "3", name
    names = {overlay[n]["environment"]["NATS_SERVER_NAME"] for n in COMPOSE_NODES}
    assert len(names) == 3 and len({overlay[n]["volumes"][0] for n in COMPOSE_NODES}) == 3
    assert all(not overlay[n].get("ports") for n in COMPOSE_NODES[1:])  # nothing more published

    # the node config, with the keys `opentinker nats-keys` writes, is one nats-server accepts
    write_nats_keys(tmp_path / "nats-keys", say=lambda *a: None)
    conf = tmp_path / "nats.conf"
    conf.write_text((ROOT / "compose" / "nats-cluster.conf").read_text())
    cluster = (tmp_path / "nats-keys" / "cluster.conf")
    assert cluster.stat().st_mode & 0o777 == 0o600
    text = cluster.read_text()
    assert "authorization" in text and all(f"@{n}:6222" in text for n in COMPOSE_NODES)

    def check() -> subprocess.CompletedProcess:
        return subprocess.run([server_binary(), "-t", "-c", str(conf)], capture_output=True, text=True,
                              env={"NATS_SERVER_NAME": "n1"}, cwd=tmp_path)

    got = check()
    assert got.returncode == 0, got.stdout + got.stderr
    cluster.write_text(text.replace("listen: 0.0.0.0:6222", "listen: [6222"))  # a broken block is caught
    assert check().returncode != 0
