"""The embedded stack behind `opentinker up`: a local nats-server with JetStream on a
data directory (unless NATS_URL names one) and every service as its own process.

Loopback only: nats-server and the scheduler's REST API listen on 127.0.0.1, and both
authenticate. The first `up` makes an admin API key in `<home>/admin.key` unless
OPENTINKER_ADMIN_KEY(_FILE) names one, and the NATS keys in `<home>/nats/auth/` (all mode
0600): the services connect with the service nkey, the scheduler answers the auth callout
for API-key users (services/core/natsauth.py). The CLI and SDK on this machine use the
stack's service nkey (its owner runs the stack); other users connect with an API key.
Every child is stopped by its own PID. Each child gets OMP_NUM_THREADS and
MKL_NUM_THREADS by services.core.config.thread_count: 1 for the scheduler, envhost,
recorder and tinker API, the libraries' defaults for the learner and rollout worker, unless
OPENTINKER_<SERVICE>_THREADS, a `threads=N` override or OPENTINKER_THREADS says otherwise.
Several rollout workers on this host (`rollout_workers=M`) split its cores between
them (`core_share`): each gets its share as its thread count and, for vLLM, as its
OpenMP binding (VLLM_CPU_OMP_THREADS_BIND), unless those are set; vLLM's default
binding would put every worker's threads on the same cores.

`cluster=N` (`opentinker up --cluster 3`) runs N nats-servers as one cluster instead
(nats_server.NatsCluster: routes on loopback, one auth folder) and every service with
`nats_replicas` = min(N, 3), so streams, KV buckets and object stores survive a node's
loss; services and clients reconnect to the surviving nodes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from opentinker.services.core.config import thread_count, thread_env
from opentinker.services.core.nats_server import NatsCluster, NatsServer, free_port

SERVICES = ("scheduler", "envhost", "recorder", "rollout", "learner", "tinker")
DEFAULT_PORT = 4222
DEFAULT_API_PORT = 8470
DEFAULT_TINKER_PORT = 8471


class Stack:
    """nats-server + services as child processes; `stop()` ends them in reverse order."""

    def __init__(self, home: str | Path, nats_url: str | None = None,
                 services: tuple[str, ...] = SERVICES, overrides: dict[str, list[str]] | None = None,
                 cluster: int = 0, rollout_workers: int = 1):
        if cluster < 0 or cluster == 2:
            raise ValueError(f"cluster: {cluster} nodes (0 or 1: one server; 3 or more: a cluster, "
                             "which needs a majority of its nodes up, so 2 would survive no loss)")
        if rollout_workers < 1:
            raise ValueError(f"rollout_workers: {rollout_workers} (at least 1)")
        self.rollout_workers = rollout_workers
        self.home = Path(home)
        self.nats_url = nats_url
        self.cluster = cluster if cluster > 1 else 0
        self.services = services
        self.overrides = {k: list(v) for k, v in (overrides or {}).items()}
        self.log_dir = self.home / "logs"
        self.server: NatsServer | NatsCluster | None = None
        self.procs: dict[str, subprocess.Popen] = {}
        self.sockets: dict[str, socket.socket] = {}  # service -> the listening socket it inherits
        self.api_url = ""
        self.tinker_url = ""  # the Tinker API (TINKER_BASE_URL)

    def start(self) -> Stack:
        """Start everything; raises RuntimeError if nats-server or a service dies at once."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if not self.nats_url and self.cluster:
            self.server = NatsCluster(self.home / "nats-cluster", self.cluster, auth=True,
                                      log_dir=self.log_dir).start()
            self.nats_url = self.server.url
        elif not self.nats_url:
            port = DEFAULT_PORT if _port_free(DEFAULT_PORT) else free_port()
            server = NatsServer(self.home / "nats", port=port, auth=True, log_file=self.log_dir / "nats-server.log")
            server.picked = True  # 4222 is a preference: taken meanwhile, any free port does (nats_server.py)
            self.server = server.start()
            self.nats_url = self.server.url
        # the REST and Tinker APIs' sockets are bound here and inherited by the service
        # (api_fd / tinker_fd), so no other process can take the port before it starts
        if "scheduler" in self.services and (sock := self._listen("scheduler", "api", DEFAULT_API_PORT)):
            self.api_url = f"http://127.0.0.1:{sock.getsockname()[1]}/"
        if "tinker" in self.services and (sock := self._listen("tinker", "tinker", DEFAULT_TINKER_PORT)):
            self.tinker_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        for name in self.services:
            self.spawn(name)
            if name == "rollout":  # more rollout workers: rollout-2, rollout-3, ... (own ids and logs)
                for i in range(2, self.rollout_workers + 1):
                    self.spawn(f"rollout-{i}")
        time.sleep(1.0)
        self.check()
        (self.home / "stack.json").write_text(json.dumps(
            {"nats_url": self.nats_url, "api_url": self.api_url, "tinker_url": self.tinker_url,
             "service_nkey": str(self.server.service_seed_file) if self.server else "",
             "pids": {n: p.pid for n, p in self.procs.items()}}))
        return self

    def _listen(self, service: str, prefix: str, preferred: int):
        """Bind `service`'s listening socket on `<prefix>_host` (its override, else
        $OPENTINKER_<PREFIX>_HOST, else 127.0.0.1): port `preferred` when free, else
        any; pass it on as `<prefix>_fd`/`<prefix>_port` overrides, and return it. None
        (the service binds its own) when the overrides name the port, the fd, or a
        --config file. Raises OSError if no port can be bound."""
        overrides = self.overrides.setdefault(service, [])
        if any(o.startswith((f"{prefix}_port=", f"{prefix}_fd=", "--config")) for o in overrides):
            return None
        hosts = [o.partition("=")[2] for o in overrides if o.startswith(f"{prefix}_host=")]
        host = hosts[-1] if hosts else os.environ.get(f"OPENTINKER_{prefix.upper()}_HOST") or "127.0.0.1"
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            try:
                sock.bind((host, preferred))
            except OSError:  # taken: any free port (a failed bind leaves the socket unbound)
                sock.bind((host, 0))
        except OSError:
            sock.close()
            raise
        sock.listen(1024)
        sock.set_inheritable(True)
        self.sockets[service] = sock
        overrides += [f"{prefix}_port={sock.getsockname()[1]}", f"{prefix}_fd={sock.fileno()}"]
        return sock

    def admin_key_file(self) -> Path:
        """`<home>/admin.key`, made (random, 0600) if missing."""
        path = self.home / "admin.key"
        if not path.exists():
            import secrets

            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write("otk-" + secrets.token_urlsafe(32) + "\n")
        return path

    def child_env(self, name: str) -> dict[str, str]:
        """The environment service `name` (`rollout-2`: the second rollout worker) is
        started with: this process's, the stack's NATS and home, and its thread count
        (config.thread_count; a `threads=N` in its overrides counts as configured; with
        several rollout workers, a worker's share of the cores by default). Raises
        ValueError for a bad thread count."""
        service, _, nth = name.partition("-")
        env = dict(os.environ, NATS_URL=self.nats_url or "", OPENTINKER_HOME=str(self.home),
                   PYTHONUNBUFFERED="1")
        if self.cluster:
            env["OPENTINKER_NATS_REPLICAS"] = str(min(self.cluster, 3))
        configured = [o.partition("=")[2] for o in self.overrides.get(service, []) if o.startswith("threads=")]
        try:
            n = thread_count(service, env, int(configured[-1]) if configured else 0)
        except ValueError as e:  # int() of a bad override, or a bad count
            raise ValueError(f"{service}: bad thread count: {e}") from None
        if service == "rollout" and self.rollout_workers > 1:
            cores = core_share(sorted(os.sched_getaffinity(0)), int(nth or 1) - 1, self.rollout_workers)
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
            n = n or len(cores)
        env.update(thread_env(n))
        return env

    def spawn(self, name: str) -> subprocess.Popen:
        """Start (or restart) service `name` (`rollout-2`: a second rollout worker) as a
        child process logging to <home>/logs/<name>.log."""
        service = name.partition("-")[0]
        env = self.child_env(name)
        # the scheduler bootstraps the admin with it; the tinker API cancels idle sessions' jobs with it
        if name in ("scheduler", "tinker") and not (env.get("OPENTINKER_ADMIN_KEY")
                                                    or env.get("OPENTINKER_ADMIN_KEY_FILE")):
            env["OPENTINKER_ADMIN_KEY_FILE"] = str(self.admin_key_file())
        if self.server is not None and self.server.auth:
            env["NATS_NKEY"] = str(self.server.service_seed_file)
            if name == "scheduler":
                env.update(self.server.scheduler_env())
        log = open(self.log_dir / f"{name}.log", "ab")
        overrides = list(self.overrides.get(service, []))
        if service in ("rollout", "learner") and not any(o.startswith("worker_id=") for o in overrides):
            # the same identity across restarts: a worker back within its heartbeat's
            # life keeps its jobs (no requeue), and its unfinished work comes back to it
            overrides.append(f"worker_id={self.worker_id(name)}")
        cmd = [sys.executable, "-m", f"opentinker.services.{service}", *overrides]
        sock = self.sockets.get(name)
        self.procs[name] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            pass_fds=(sock.fileno(),) if sock is not None else ())
        return self.procs[name]

    def worker_id(self, name: str) -> str:
        """`<service>-<host>-<6 hex of the home path>`: stable for this stack, distinct
        from another stack's on the same host and bus."""
        import hashlib

        from opentinker.services.core.pool import default_worker_id

        host = default_worker_id(name).rsplit("-", 1)[0]  # <service>-<host>, without the pid
        return f"{host}-{hashlib.sha256(str(self.home.resolve()).encode()).hexdigest()[:6]}"

    def check(self) -> None:
        """Raise RuntimeError naming any service that has exited."""
        dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
        if dead:
            raise RuntimeError(f"services exited: {dead}; see logs in {self.log_dir}")

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM each service (reverse start order), wait, SIGKILL stragglers; stop NATS."""
        for name in reversed(list(self.procs)):
            p = self.procs[name]
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()
        for sock in self.sockets.values():
            sock.close()
        self.sockets.clear()
        if self.server:
            self.server.stop()
        (self.home / "stack.json").unlink(missing_ok=True)

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def core_share(cores: list[int], index: int, count: int) -> list[int]:
    """Worker `index` (0-based) of `count` workers' share of `cores`: contiguous, nearly
    equal slices; with more workers than cores, one core each, in turn. Pure."""
    if count >= len(cores):
        return [cores[index % len(cores)]]
    return cores[index * len(cores) // count:(index + 1) * len(cores) // count]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def supervise(stack: Stack, say=print) -> None:
    """`opentinker up`'s foreground loop: restart any service that exits (a service can
    be killed and restarted at any time; its work is redelivered from JetStream) until
    SIGINT or SIGTERM, then stop the whole stack."""
    stopping = False

    def _stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    try:
        while not stopping:
            time.sleep(0.5)
            for name, p in list(stack.procs.items()):
                if p.poll() is not None and not stopping:
                    say(f"{name} exited with {p.returncode}; restarting", flush=True)
                    time.sleep(1.0)
                    stack.spawn(name)
    finally:
        say("stopping...", flush=True)
        stack.stop()
