"""`opentinker nats-keys DIR`: a deployment's NATS keys, made once (compose/ uses them)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from opentinker.services.core.natsauth import ensure_seed_file, server_auth_config

# the nodes of compose/cluster.yml (the compose network's host names)
COMPOSE_NODES = ("nats", "nats-2", "nats-3")


def cluster_config(nodes: tuple[str, ...] = COMPOSE_NODES, password: str = "") -> str:
    """The `cluster` block of a NATS cluster of `nodes` whose routes authenticate: one
    route user, a random password (256 bits) every node checks and presents (nats-server
    routes take a user and password or TLS, not nkeys)."""
    password = password or secrets.token_urlsafe(32)
    routes = ", ".join(f'"nats-route://route:{password}@{n}:6222"' for n in nodes)
    return ("cluster {\n  name: opentinker\n  listen: 0.0.0.0:6222\n"
            f'  authorization {{ user: route, password: "{password}" }}\n'
            f"  routes: [{routes}]\n}}\n")


def write_nats_keys(out: Path, say=print) -> None:
    """Make the NATS keys of a deployment (services/core/natsauth.py) in `out`, once:
    the services' nkey seed, the auth callout's issuer seed and xkey seed, the system
    account's nkey seed (all 0600, secrets), `auth.conf`, the server config block
    with their public keys and the accounts (include it), and `cluster.conf`, the
    cluster block of compose/cluster.yml's nodes (0600: it holds the route password)."""
    svc = ensure_seed_file(out / "service.nk", "user")
    issuer = ensure_seed_file(out / "callout-issuer.nk", "account")
    xkey = ensure_seed_file(out / "callout.xk", "curve")
    system = ensure_seed_file(out / "system.nk", "user")
    (out / "auth.conf").write_text(server_auth_config(svc, issuer, xkey, system))
    cluster = out / "cluster.conf"
    if not cluster.exists():  # a secret (the route password): 0600, made once
        fd = os.open(cluster, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(cluster_config())
    say(f"{out / 'service.nk'}: the services' nkey seed (NATS_NKEY), public key {svc}")
    say(f"{out / 'callout-issuer.nk'}: the scheduler's callout issuer seed "
        f"(OPENTINKER_NATS_CALLOUT_ISSUER_FILE), public key {issuer}")
    say(f"{out / 'callout.xk'}: the scheduler's callout xkey seed (OPENTINKER_NATS_CALLOUT_XKEY_FILE), "
        f"public key {xkey}")
    say(f"{out / 'system.nk'}: the scheduler's system-account nkey seed (OPENTINKER_NATS_SYSTEM_NKEY_FILE), "
        f"public key {system}")
    say(f"{out / 'auth.conf'}: include it in the nats-server config")
    say(f"{cluster}: the cluster block of compose/cluster.yml's three nodes (a route password; secret)")
