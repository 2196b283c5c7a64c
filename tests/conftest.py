"""Shared fixtures: a real nats-server (random port, temporary store) per session,
stopped by its own PID; the embedded default model and a tiny random-init model;
services started as real subprocesses and stopped by PID."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import pytest_asyncio

ROOT = Path(__file__).resolve().parents[1]
HOME = Path(os.environ.setdefault("OPENTINKER_HOME", str(ROOT / ".opentinker")))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# torch, vLLM and HF caches into the project home before anything imports them: torch's
# inductor pins its cache dir (into os.environ, default /tmp/torchinductor_<user>) the
# first time it asks, which a fixture would come too late for
from opentinker.services.core.config import setup_cache_dirs  # noqa: E402

setup_cache_dirs(str(HOME))
# the admin key of this test session: schedulers started by the tests bootstrap it, and
# the SDK and CLI (in-process and subprocesses) authenticate with it
if not os.environ.get("OPENTINKER_ADMIN_KEY"):
    import secrets as _secrets

    os.environ["OPENTINKER_ADMIN_KEY"] = "otk-" + _secrets.token_urlsafe(32)
os.environ.setdefault("OPENTINKER_API_KEY", os.environ["OPENTINKER_ADMIN_KEY"])


@functools.cache
def _uses_world(path: str) -> bool:
    """Whether a test of the file at `path` (relative to the repository) takes the
    `world` fixture."""
    return re.search(r"def test_\w+\([^)]*\bworld\b", (ROOT / path).read_text()) is not None


def _work_unit(nodeid: str) -> str:
    """The unit of work a pytest-xdist worker (scripts/test.sh runs `-n 2`) takes whole:
    the test's file (its module fixtures built once), or tests/adversarial for every test
    of a file that takes the shared stack `world` (started once per worker, so all on one)."""
    path = nodeid.split("::", 1)[0]
    return "tests/adversarial" if path.startswith("tests/adversarial/") or _uses_world(path) else path


def pytest_collection_modifyitems(config, items):
    """The order of the run (and of the work units sent to xdist's workers), longest unit
    first so that the tail is short files that keep both workers busy: tests/adversarial
    (the `world` unit), then integration files, then unit files; stable within each."""
    def rank(item) -> int:
        unit = _work_unit(item.nodeid)
        return 0 if unit == "tests/adversarial" else 1 if unit.startswith("tests/integration/") else 2

    items.sort(key=rank)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scope scheduler with _work_unit as the scope, units sent in the
    run's order."""
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid)

    config.option.loadscopereorder = False
    return ByWorkUnit(config, log)


@pytest.fixture(scope="session", autouse=True)
def private_tmp(tmp_path_factory):
    """This test process's run-time files, and those of the processes it starts (vLLM's
    engine processes, torchrun, uv; services make their own folders inside it), in a
    folder of its own removed at the end, as a service's are (core/tmpdir.py): not left
    in /tmp. pytest's tmp_path stays where it was."""
    import shutil
    import tempfile

    from opentinker.services.core.tmpdir import private_tmpdir

    tmp_path_factory.getbasetemp()  # decided before the switch
    before = tempfile.tempdir, os.environ.get("TMPDIR")
    d = private_tmpdir("pytest")
    yield d
    tempfile.tempdir = before[0]
    if before[1] is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before[1]
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def home() -> Path:
    """The project-owned home (models, caches): $OPENTINKER_HOME or <repo>/.opentinker."""
    HOME.mkdir(parents=True, exist_ok=True)
    from opentinker.services.core.config import setup_cache_dirs

    setup_cache_dirs(str(HOME))
    return HOME


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory):
    """A real nats-server with JetStream on 127.0.0.1:<random port>."""
    from opentinker.services.core.nats_server import NatsServer

    srv = NatsServer(tmp_path_factory.mktemp("nats")).start()
    try:
        register_operator_envs(srv.url, tmp_path_factory.mktemp("envhost"))
        yield srv
    finally:
        srv.stop()


def register_operator_envs(url: str, log_dir: Path) -> None:
    """Run the operator's envhost (every built-in env) until it has written the env
    catalog (KV `ot_envs`), as an operator's first `opentinker envhost` does: tests that
    submit a job with no envhost of their own (a scheduler alone) name a known env."""
    import asyncio
    import time

    from opentinker.schemas import subjects as S
    from opentinker.services.core.bus import Bus

    async def catalog() -> set[str]:
        bus = await Bus.connect(url, "test")
        try:
            await bus.ensure_topology()
            return set(await bus.kv_values(S.KV_ENVS))
        finally:
            await bus.close()

    with open(log_dir / "envhost.log", "w") as log:
        p = subprocess.Popen([sys.executable, "-m", "opentinker.services.envhost"], stdout=log,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env=dict(os.environ, NATS_URL=url, OPENTINKER_HOME=str(HOME), NATS_NKEY=""))
        try:
            deadline = time.monotonic() + 120
            while "arith" not in asyncio.run(catalog()):
                assert p.poll() is None and time.monotonic() < deadline, (log_dir / "envhost.log").read_text()
                time.sleep(0.3)
        finally:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture(scope="session")
def nats_url(nats_server) -> str:
    return nats_server.url


@pytest_asyncio.fixture
async def bus(nats_url):
    from opentinker.services.core.bus import Bus

    b = await Bus.connect(nats_url, "test")
    await b.ensure_topology()
    yield b
    await b.close()


@pytest.fixture
def job_id() -> str:
    """A fresh job id per test."""
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def smollm2(home) -> str:
    """SmolLM2-135M-Instruct as a Hugging Face folder (converted once from the GGUF)."""
    from opentinker.services.core.models import DEFAULT_MODEL, resolve_model

    return resolve_model(DEFAULT_MODEL, str(home))


@pytest.fixture(scope="session")
def tiny_model(request, home) -> str:
    """A random-init 2-layer Llama (head_dim 64) with SmolLM2's tokenizer and chat template;
    $OPENTINKER_TINY_MODEL names one made before (a GPU machine without the embedded model)."""
    from opentinker.services.core.models import make_tiny_model

    if os.environ.get("OPENTINKER_TINY_MODEL"):
        return os.environ["OPENTINKER_TINY_MODEL"]
    return make_tiny_model(home / "models" / "tiny-llama", request.getfixturevalue("smollm2"))


@pytest.fixture(scope="session")
def tiny_vlm(home, smollm2) -> str:
    """A random-init LLaVA (CLIP tower, 56x56 images, 16 image tokens each; the tiny
    Llama's text side) with SmolLM2's tokenizer plus `<image>`, and its processor."""
    from opentinker.services.core.models import make_tiny_vlm

    return make_tiny_vlm(home / "models" / "tiny-llava", smollm2)


def listeners(pid: int) -> list[tuple[int, str, int, bool]]:
    """Every listening TCP socket of process `pid` and those it started, as (pid, ip,
    port, on loopback); [] once the process is gone."""
    import ipaddress

    import psutil

    found = []
    with contextlib.suppress(psutil.NoSuchProcess):
        proc = psutil.Process(pid)
        for q in [proc, *proc.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                found += [(q.pid, c.laddr.ip, c.laddr.port, ipaddress.ip_address(c.laddr.ip).is_loopback)
                          for c in q.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    return found


class Services:
    """Start OpenTinker services as subprocesses; stop them by PID. Each test's services
    form a worker pool of their own (`pool`), so a scheduler places only this test's
    jobs, on this test's workers."""

    def __init__(self, nats_url: str, home: Path, log_dir: Path):
        self.nats_url = nats_url
        self.home = home
        self.log_dir = log_dir
        self.pool = f"p-{uuid.uuid4().hex[:8]}"
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, *overrides: str, args: list[str] | None = None,
              env: dict[str, str] | None = None) -> subprocess.Popen:
        e = dict(os.environ, NATS_URL=self.nats_url, OPENTINKER_HOME=str(self.home),
                 PYTHONUNBUFFERED="1", OPENTINKER_POOL=self.pool,
                 OPENTINKER_API_PORT="0")  # a test that wants the REST API passes api_port=
        e.update(env or {})
        log = open(self.log_dir / f"{name}-{len(self.procs)}.log", "w")
        cmd = [sys.executable, "-m", f"opentinker.services.{name}", *(args or []), *overrides]
        p = subprocess.Popen(cmd, env=e, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.procs.append((name, p))
        return p

    def logs(self, tail: int | None = 4000) -> str:
        """Every service's log under a `=== <file>` line: the last `tail` characters of
        each (an assertion's message), or whole with tail=None (what a test searches)."""
        return "\n".join(f"=== {f.name}\n{f.read_text()[-tail if tail else 0:]}"
                         for f in sorted(self.log_dir.glob("*.log")))

    def dump_stacks(self, timeout_s: float = 10.0) -> int:
        """Ask every running service for its threads' and tasks' stacks (SIGUSR1,
        runner.dump_stacks) and wait until they are in the logs; returns how many
        answered. For a test whose job stalled: its assertion's logs then say what each
        service was waiting for."""
        live = [p for _, p in self.procs if p.poll() is None]
        before = self.logs(None).count("stacks on request")
        for p in live:
            p.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + timeout_s
        while self.logs(None).count("stacks on request") < before + len(live) and time.monotonic() < deadline:
            time.sleep(0.2)
        return self.logs(None).count("stacks on request") - before

    def open_listeners(self) -> list[str]:
        """Every listening TCP socket of the running services and the processes they
        started that is not on loopback, as "<service> pid <pid> <ip>:<port>": a test's
        services listen on loopback only (the NATS and HTTP ports a deployment opens are
        the operator's, with their own authentication)."""
        return [f"{name} pid {pid} {ip}:{port}" for name, p in self.procs
                for pid, ip, port, loopback in listeners(p.pid) if not loopback]

    def stop_all(self) -> None:
        for _, p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for _, p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()


@pytest.fixture
def services(nats_url, home, tmp_path):
    s = Services(nats_url, home, tmp_path)
    yield s
    s.stop_all()


async def delete_consumers(bus, stream: str) -> None:
    """Remove every consumer of `stream`. A work-queue stream allows only non-overlapping
    consumers, so a test that plays a service's part clears the service's consumer first."""
    for info in await bus.js.consumers_info(stream):
        await bus.js.delete_consumer(stream, info.name)


def make_lora(model_dir: str, r: int, alpha: int, std: float, seed: int):
    """A peft LoRA on q/v of `model_dir` with lora_B drawn from N(0, std) (so it is not a
    no-op). Returns (adapter state dict as the learner publishes it, peft's merged model)."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, std)
    sd = {k: v.detach().clone().contiguous() for k, v in get_peft_model_state_dict(peft).items()}
    return sd, peft.merge_and_unload()


async def submit_when_ready(client, spec: dict, job_id: str, services=None, timeout_s: float = 180):
    """Submit, retrying while the scheduler is still starting (no responder yet, or a
    request timing out while a cluster elects its JetStream leaders) or its envhost does
    not serve the job's env yet (refused naming `env`); after `timeout_s`
    fails the test with the services' logs when given."""
    import asyncio
    import time

    import nats.errors

    from opentinker.sdk.client import Job, SpecError

    deadline = time.monotonic() + timeout_s
    timed_out = False
    while True:
        try:
            return await client.submit(spec, job_id=job_id)
        except SpecError as e:
            if timed_out and e.field == "job_id" and "already exists" in str(e):
                return Job(client, job_id)  # a request that timed out had reached the scheduler
            if e.field != "env":
                raise
            if time.monotonic() > deadline:
                pytest.fail(f"{e} (still after {timeout_s:.0f} s)\n{services.logs() if services else ''}")
            await asyncio.sleep(0.3)  # the test's envhost, started with the scheduler, is not serving yet
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError, asyncio.TimeoutError) as e:
            timed_out = timed_out or not isinstance(e, nats.errors.NoRespondersError)
            if time.monotonic() > deadline:
                pytest.fail(f"scheduler not answering within {timeout_s:.0f} s ({e!r})\n"
                            f"{services.logs() if services else ''}")
            await asyncio.sleep(0.3)


async def follow(job, timeout_s: float, services) -> list:
    """Every Metrics message of `job` until it ends; fails the test (with the services'
    logs) after `timeout_s`."""
    import asyncio

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    it = job.metrics().__aiter__()
    out = []
    while True:
        try:
            out.append(await asyncio.wait_for(it.__anext__(), max(0.1, deadline - loop.time())))
        except StopAsyncIteration:
            return out
        except asyncio.TimeoutError:
            pytest.fail(f"job {job.id} did not finish in {timeout_s}s\n{services.logs()}")


async def train_jobs(nats_url: str, services, jobs: dict[str, dict], job_id: str,
                     timeout_s: float = 600) -> tuple[dict, dict]:
    """Submit each spec of `jobs` as job `<job_id>-<key>` (underscores as dashes), follow
    every one to its end and assert it COMPLETED (failing with the services' logs).
    Returns ({key: Job}, {key: [Metrics, ...]})."""
    from opentinker.schemas import JobState
    from opentinker.sdk import Client

    async with await Client.connect(nats_url) as client:
        handles = {k: await submit_when_ready(client, s, f"{job_id}-{k.replace('_', '-')}") for k, s in jobs.items()}
        metrics = {k: await follow(h, timeout_s, services) for k, h in handles.items()}
        for k, h in handles.items():
            rec = await h.wait(timeout_s=30, raise_on_failure=False)
            assert rec.state == JobState.COMPLETED, (k, rec, services.logs())
    return handles, metrics


async def log_rows(data_dir, sql: str, expect: int, timeout_s: float = 30):
    """Rows of `sql` over the log once its first value reaches `expect` (the recorder
    flushes on a timer), or the last rows after `timeout_s`."""
    import asyncio

    from opentinker.services.core.logdb import run_query

    for _ in range(int(timeout_s / 0.5)):
        cols, rows = run_query(sql, str(data_dir))
        if rows and rows[0][0] >= expect:
            return rows
        await asyncio.sleep(0.5)
    return rows


def start_logged_stack(server, home, log_dir, monkeypatch, steps: int, name: str, **env: str):
    """Every service on `server` (a NatsServer or NatsCluster with auth) as the service
    identity, the recorder logging to `<log_dir>/data` every 0.5 s, this test's client a
    service too. Returns (Services, their processes, a small arith job spec of `steps`
    steps on the transformers engine, without its `model`)."""
    monkeypatch.setenv("NATS_NKEY", str(server.service_seed_file))
    services = Services(server.url, home, log_dir)
    env = {"NATS_NKEY": str(server.service_seed_file), **server.scheduler_env(),
           "OPENTINKER_DATA_DIR": str(log_dir / "data"), **env}
    procs = [services.start(svc, *extra, env=env) for svc, extra in
             (("scheduler", ()), ("envhost", ()), ("recorder", ("recorder_flush_s=0.5",)), ("learner", ()),
              ("rollout", ("engine=hf",)))]
    spec = {"name": name, "env": "arith", "engine": "hf", "lora_rank": 4, "prompts_per_step": 2, "group_size": 2,
            "steps": steps, "checkpoint_every": max(1, steps // 2), "micro_batch_size": 4,
            "sampling": {"max_new_tokens": 8, "max_total_tokens": 256}}
    return services, procs, spec


async def until(cond, timeout_s: float, services, what: str):
    """Poll the async `cond()` until it returns something truthy; fail with the logs."""
    import asyncio
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = await cond()
        if got:
            return got
        await asyncio.sleep(0.3)
    pytest.fail(f"{what} not within {timeout_s:.0f} s\n{services.logs()}")


async def stream_and_log(client, job_id: str, data_dir, steps: int) -> tuple[int, int]:
    """(trajectories of `job_id` on its stream, distinct episodes of it in the log),
    once the log holds all `steps` train steps (asserted) and as many episodes as the
    stream (or after 30 s: the recorder flushes on a timer)."""
    from opentinker.schemas import subjects as S

    rows = await log_rows(data_dir, f"SELECT count(DISTINCT step) FROM metrics WHERE job_id = '{job_id}' "
                                    "AND split = 'train'", steps)
    assert rows[0][0] == steps, rows
    on_stream = len(await client.bus.read_raw(S.job(job_id, "traj")))
    rows = await log_rows(data_dir, f"SELECT count(DISTINCT episode_id) FROM trajectories WHERE job_id = '{job_id}'",
                          on_stream)
    return on_stream, rows[0][0]


async def place_job(bus, job_id: str, spec=None, *, learner: str = "", rollout=(), attempt: int = 1,
                    kind: str = "train", user: str = ""):
    """Write the scheduler's record of a job placed on `learner` and `rollout` workers, for
    tests that play the scheduler's part: learners and rollout workers serve only what a
    record places on them."""
    from opentinker.schemas import JobRecord, JobSpec, JobState, encode
    from opentinker.schemas import subjects as S
    from opentinker.schemas.pool import Placement

    rec = JobRecord(job_id=job_id, spec=spec or JobSpec(), state=JobState.RUNNING, kind=kind, user=user,
                    attempt=attempt, placement=Placement(attempt=attempt, learner=learner, rollout=list(rollout)))
    await (await bus.kv(S.KV_JOBS)).put(job_id, encode(rec))
    return rec


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def world(tmp_path_factory, home, tiny_model):
    """The adversarial tests' shared stack (tests/tenants.py): started once, by the first
    test that asks for it."""
    from tenants import start_world

    gen = start_world(tmp_path_factory.mktemp("tenants"), home, tiny_model, Services)
    yield await gen.__anext__()
    with contextlib.suppress(StopAsyncIteration):
        await gen.__anext__()


RANK_SCRIPT = Path(__file__).resolve().parent / "ranks" / "engine_step.py"


def run_ranks(n: int, model: str, out: Path, zero_stage: int, device: str = "cpu", *extra: str,
              script: Path = RANK_SCRIPT) -> tuple[dict, dict]:
    """tests/ranks/engine_step.py (or `script`) on `n` ranks (torchrun): rank 0's
    (metrics, weights)."""
    import json

    from safetensors.torch import load

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                            "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # --standalone: torchrun binds its rendezvous port itself (a port picked here could be
    # taken by another process before torchrun binds it)
    got = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}",
                          "--standalone", str(script), model, str(out),
                          str(zero_stage), device, *extra], capture_output=True, text=True, env=env, timeout=400)
    assert got.returncode == 0, got.stdout[-4000:] + got.stderr[-8000:]
    return json.loads((out / "metrics.json").read_text()), load((out / "weights.safetensors").read_bytes())
