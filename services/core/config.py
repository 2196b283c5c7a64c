"""Typed service settings: defaults, then a TOML file, then `OPENTINKER_*` environment
variables, then CLI overrides (`key=value`). No interpolation. `--print-config` in any
service prints the result."""

from __future__ import annotations

import contextlib
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec


def default_home() -> str:
    """Where OpenTinker keeps models, caches and data: $OPENTINKER_HOME or
    ~/.cache/opentinker."""
    return os.environ.get("OPENTINKER_HOME") or str(Path.home() / ".cache" / "opentinker")


class Settings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Settings shared by every service (each reads the fields it needs)."""

    nats_url: str = "nats://127.0.0.1:4222"
    home: str = msgspec.field(default_factory=default_home)
    data_dir: str = ""            # trajectory log root; default <home>/data
    device: Literal["auto", "cpu", "cuda"] = "auto"
    engine: Literal["auto", "vllm", "hf"] = "auto"
    worker_id: str = ""
    pool: str = "default"         # the worker pool a scheduler places on and a worker joins
    rollout_slots: int = 4        # jobs one rollout worker serves at once (one adapter each)
    # a learner's most data-parallel ranks for one job (JobSpec.learner_ranks); 0: the
    # GPUs it sees on CUDA, else its CPU cores
    learner_max_ranks: int = 0
    # vLLM multi-LoRA: adapters up to `lora_max_rank` are applied by vLLM per request,
    # one loaded per job slot, instead of merged into the weights at each job switch.
    # "auto": on with CUDA; off on CPU, where vLLM's LoRA kernels made generation
    # several times slower than merging (bench/multi_lora.py, results in bench/RESULTS.md)
    vllm_multi_lora: Literal["auto", "on", "off"] = "auto"
    # intra-op threads the learner trains an asynchronous job (max_staleness >= 1) with on
    # a CPU, where its rollout worker generates the next batch on the same cores meanwhile
    # (0: as many as for any job). On 2 cores, generation (vLLM, 2 bound threads) beside
    # a 2-thread learner step took 6.4 s and the step 17.0 s; beside a 1-thread step, 5.2 s
    # and 2.8 s (alone: 4.7 s and 1.5 s): the two thread teams wait on each other's
    # barriers. End to end it gained nothing measurable (bench/RESULTS.md, 2026-11-29: async
    # steps/s 0.95-1.02x sync's over 4 seeds with 1), so no default sets it
    learner_async_threads: int = 0
    # the transformers engine's decoding (engine_hf.HFEngine): "compiled" decodes into a
    # static KV cache under torch.compile with CUDA graphs (a compile per shape, once per
    # engine), "static" the same cache without the compile, "dynamic" a growing cache.
    # "auto": compiled on CUDA, dynamic on a CPU (inductor's compile takes minutes there)
    hf_decode: Literal["auto", "dynamic", "static", "compiled"] = "auto"
    lora_max_rank: int = 64
    # a rollout worker's OpenAI-compatible endpoint for inference jobs (-1: none, 0: a
    # free port); `serve_url` is what it advertises (default http://<serve_host>:<port>)
    serve_host: str = "127.0.0.1"
    serve_port: int = 0
    serve_url: str = ""
    max_jobs_per_user: int = 4    # scheduler quota: a user's jobs placed at once
    max_workers_per_user: int = 8  # scheduler quota: workers a user's placed jobs hold
    max_unfinished_jobs_per_user: int = 32  # scheduler: queued + running jobs of one user (admins: no limit)
    # scheduler: a submit holding its user's submit lock longer than this is refused
    # ("try again"); at most the lock's TTL less 10 s (scheduler/locks.py LEASE_S)
    submit_lease_s: float = 20.0
    # scheduler: a finished job's record (COMPLETED, FAILED, CANCELLED), with its weights
    # and checkpoints in the object stores, is deleted this long after its last change,
    # and only the newest `finished_jobs_per_user` finished records of a user are kept
    # (either 0: no such limit). Checked every minute (scheduler/retention.py). Unfinished
    # jobs, and finished ones an unfinished job names (`tinker_init`, `opponents`), are
    # never deleted.
    job_retention_days: float = 30.0
    finished_jobs_per_user: int = 200
    api_host: str = "127.0.0.1"   # the scheduler's REST API and dashboard
    api_port: int = 8470          # 0 = no REST API
    # a listening socket inherited from the starter (`opentinker up` binds the port first,
    # so nothing can take it before the service starts): the API serves on it, and
    # api_host/api_port only name it; -1: none. tinker_fd likewise for the Tinker API.
    api_fd: int = -1
    # the tinker service's Tinker API (TINKER_BASE_URL = http://<tinker_host>:<port>);
    # 0 = a free port (written to <home>/tinker.json)
    tinker_host: str = "127.0.0.1"
    tinker_port: int = 8471
    tinker_fd: int = -1
    # a Tinker session is finished (its models export and complete, its sampling job
    # ends) after this long without an operation or sample, and this long after it began
    tinker_session_idle_s: float = 3600.0
    tinker_session_max_s: float = 3 * 86400.0
    # ... and this long without a heartbeat (the SDK beats every 10 s; a script that exits
    # without closing its ServiceClient stops beating, and frees its learner this long after)
    tinker_heartbeat_timeout_s: float = 60.0
    # per Tinker session, what its sampling clients with record_stability_info may keep
    # recorded (for the loss stable_reinforce); past either, its oldest records go first
    tinker_recorded_bytes_per_session: int = 256 * 1024 * 1024
    tinker_recorded_sequences_per_session: int = 65_536
    # per user, in the tinker service: futures long-polled at once (over: 429), and the
    # operations and samples sent whose futures are not yet retrieved (count and bytes;
    # over: 429), which bounds one user's share of the OT_TINKER and OT_ROLLOUT streams
    tinker_polls_per_user: int = 64
    tinker_inflight_per_user: int = 256
    tinker_inflight_bytes_per_user: int = 32 * 1024 * 1024
    # a learner refuses a user's tinker save_state / save_weights_for_sampler once that
    # user's jobs' objects (stores ot_weights, ot_checkpoints) hold this many bytes
    store_bytes_per_user: int = 4 * 1024**3
    # scheduler: the share of the pool's learner slots one user's placed jobs may hold
    # (at least one slot), so one user cannot hold every learner
    learner_share_per_user: float = 0.5
    # the auth callout issuer's account nkey seed file (natsauth.py): the scheduler then
    # answers nats-server's auth callout, so users connect to NATS with their API key
    nats_callout_issuer_file: str = ""
    # the xkey seed the callout's requests are sealed to (`auth_callout.xkey`)
    nats_callout_xkey_file: str = ""
    # a system-account nkey seed: the scheduler disconnects a revoked key's live
    # connections with it (without one they last until their JWT expires)
    nats_system_nkey_file: str = ""
    log_level: str = "INFO"
    recorder_flush_rows: int = 256
    recorder_flush_s: float = 2.0
    # JetStream redelivers a message the recorder took but did not ack (it crashed
    # before its Parquet file was written) after this long.
    recorder_ack_wait_s: float = 30.0
    envhost_max_concurrency: int = 16  # user env calls running at once (threads)
    envhost_episode_ttl_s: float = 600.0  # an episode untouched this long is dropped
    # an operator's envhost: the URLs (prefixes, e.g. "http://10.0.0.5:8000/v1") and the
    # environment variables (API keys) a non-admin job's env_args may name in `*_url` and
    # `*_key_env` arguments (e.g. the simulated-user env's endpoint), separated by commas
    # or spaces; empty: none (services/core/access.py, check_endpoint_args)
    envhost_allowed_urls: str = ""
    envhost_allowed_key_envs: str = ""
    # the rollout's wait for one env step's reply (a user's step may run tools or a
    # verifier); a step past it fails its episode with the reason
    env_step_timeout_s: float = 120.0
    # JetStream limits (schemas.subjects.STREAM_LIMITS) scaled for this deployment: every
    # stream's max_bytes and max_age times these; set them alike for every service
    stream_max_bytes_scale: float = 1.0
    stream_max_age_scale: float = 1.0
    # JetStream replicas of every stream, KV bucket and object store: 1 on a lone
    # nats-server, 3 on a 3-node cluster (`opentinker up --cluster 3`), so a node's loss
    # loses nothing; set it alike for every service
    nats_replicas: int = 1
    # intra-op threads (torch, OpenMP, MKL) of this service; 0: the default of
    # thread_count (1 for services without tensor math, the libraries' own otherwise)
    threads: int = 0

    @property
    def log_dir(self) -> Path:
        return Path(self.data_dir or Path(self.home) / "data")


def _coerce(kind: Any, raw: str) -> Any:
    return msgspec.convert(raw, kind, strict=False)


def load_settings(toml_path: str | None = None, overrides: list[str] | None = None) -> Settings:
    """Build Settings. Raises ValueError naming the bad key or value."""
    data: dict[str, Any] = {}
    if os.environ.get("NATS_URL"):
        data["nats_url"] = os.environ["NATS_URL"]
    if toml_path:
        with open(toml_path, "rb") as f:
            data.update(tomllib.load(f))
    fields = {f.name: f.type for f in msgspec.structs.fields(Settings)}
    for name, kind in fields.items():
        env = os.environ.get(f"OPENTINKER_{name.upper()}")
        if env is not None:
            data[name] = _coerce(kind, env)
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise ValueError(f"bad override {item!r}: expected KEY=VALUE with KEY in {sorted(fields)}")
        data[key] = _coerce(fields[key], value)
    try:
        return msgspec.convert(data, Settings)
    except msgspec.ValidationError as e:
        raise ValueError(f"bad settings: {e}") from None


def setup_cache_dirs(home: str) -> None:
    """Point torch/vLLM/HF/Triton caches into `home` instead of /tmp or ~."""
    cache = Path(home) / "cache"
    for var, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("VLLM_CACHE_ROOT", "vllm"),
                     ("TRITON_CACHE_DIR", "triton"), ("HF_HOME", "hf"),
                     ("TORCH_EXTENSIONS_DIR", "torch_extensions"), ("XDG_CACHE_HOME", "xdg")):
        os.environ.setdefault(var, str(cache / sub))
    # inductor's precompiled headers (CPU kernels) go to /tmp/torchinductor_<user> whatever
    # TORCHINDUCTOR_CACHE_DIR says (torch 2.13 codecache._HEADER_DIR): none, so none there
    os.environ.setdefault("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "0")


def main_settings(service: str, argv: list[str] | None = None) -> Settings:
    """Parse a service's command line: `[--config FILE] [--print-config] [KEY=VALUE ...]`."""
    import argparse
    import logging
    import sys

    p = argparse.ArgumentParser(prog=f"opentinker serve {service}")
    p.add_argument("--config", help="TOML settings file")
    p.add_argument("--print-config", action="store_true")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = p.parse_args(argv)
    settings = load_settings(args.config, args.overrides)
    if args.print_config:
        print(msgspec.json.format(msgspec.json.encode(settings)).decode())
        sys.exit(0)
    setup_cache_dirs(settings.home)
    logging.basicConfig(level=settings.log_level,
                        format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s")
    return settings


# -- threads ---------------------------------------------------------------------
# Every service is its own process, and torch, OpenMP and MKL each default to one
# thread per core, so on a small machine the learner's and rollout's math competes with
# idle thread pools in services that never multiply a matrix. Policy (thread_count):
# services without tensor math run 1 intra-op thread; the learner and rollout worker
# keep the libraries' defaults (torch: one per physical core) unless told otherwise.

LIGHT_SERVICES = frozenset({"scheduler", "recorder", "envhost", "tinker"})  # the REST API runs in the scheduler
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # read by torch, numpy and Arrow when they start


def thread_count(service: str, env: Mapping[str, str], configured: int = 0) -> int | None:
    """The intra-op thread count for `service`, or None for the libraries' default.

    First of: `OPENTINKER_<SERVICE>_THREADS` in `env` (e.g. OPENTINKER_LEARNER_THREADS),
    `configured` (Settings.threads: a `threads=N` override, TOML, or OPENTINKER_THREADS),
    OPENTINKER_THREADS in `env`, then 1 for LIGHT_SERVICES and None (all cores) for the
    rest. 0 or empty means unset. Pure. Raises ValueError for a value that is not an
    integer >= 0.

    vLLM on CPU binds its own OpenMP threads (VLLM_CPU_OMP_THREADS_BIND, default "auto")
    and ignores torch.set_num_threads after that (vLLM 0.32 cpu_worker.py), so for a
    rollout worker running vLLM on CPU use VLLM_CPU_OMP_THREADS_BIND to limit it.
    """

    def count(name: str, raw: str | int) -> int:
        try:
            n = int(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r}: expected a thread count (integer >= 0)") from None
        if n < 0:
            raise ValueError(f"{name}={raw!r}: expected a thread count (integer >= 0)")
        return n

    per_service = f"OPENTINKER_{service.upper()}_THREADS"
    for name, raw in ((per_service, env.get(per_service) or 0), ("threads", configured),
                      ("OPENTINKER_THREADS", env.get("OPENTINKER_THREADS") or 0)):
        if n := count(name, raw):
            return n
    return 1 if service in LIGHT_SERVICES else None


def thread_env(n: int | None) -> dict[str, str]:
    """The environment variables that give a new process `n` intra-op threads ({} for None)."""
    return {} if n is None else {var: str(n) for var in THREAD_ENV_VARS}


# -- where, and as whom, to connect ------------------------------------------------


def local_stack() -> dict[str, Any]:
    """What a running `opentinker up` on this machine wrote to `<home>/stack.json`
    (`nats_url`, `api_url`, `service_nkey`), or {} when none runs (or it is unreadable)."""
    import json

    with contextlib.suppress(ValueError, OSError):
        stack = json.loads((Path(default_home()) / "stack.json").read_text())
        if isinstance(stack, dict):
            return stack
    return {}


def default_api_key() -> str:
    """$OPENTINKER_API_KEY, else the file named by $OPENTINKER_API_KEY_FILE, else the
    local stack's admin key (`<home>/admin.key`, written by `opentinker up`), else ""."""
    if os.environ.get("OPENTINKER_API_KEY"):
        return os.environ["OPENTINKER_API_KEY"]
    p = Path(os.environ.get("OPENTINKER_API_KEY_FILE") or Path(default_home()) / "admin.key")
    return p.read_text().strip() if p.is_file() else ""


def default_api_url(url: str | None = None) -> str:
    """`url`, else $OPENTINKER_API_URL, else the local `opentinker up` stack's REST API,
    else "" (none known)."""
    return (url or os.environ.get("OPENTINKER_API_URL") or local_stack().get("api_url") or "").rstrip("/")


def default_nats_url(url: str | None = None) -> str:
    """`url`, else $NATS_URL, else the local `opentinker up` stack's, else
    nats://127.0.0.1:4222. A cluster's URL lists its nodes, comma-separated."""
    return url or os.environ.get("NATS_URL") or local_stack().get("nats_url") or "nats://127.0.0.1:4222"


def server_list(url: str) -> list[str]:
    """The servers of a NATS URL: a cluster's lists its nodes, comma-separated
    ("nats://a:4222,nats://b:4222"); nats-py takes them as a list and reconnects to any."""
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if not servers:
        raise ValueError(f"nats_url: no server in {url!r}")
    return servers


def service_credentials(url: str) -> dict[str, str]:
    """nats.connect arguments of the service identity (natsauth.py): `$NATS_NKEY` (an
    nkey seed file), `$NATS_CREDS` (a creds file), or, when `url` is the NATS of the
    local `opentinker up` stack, that stack's service nkey (named in
    `<home>/stack.json`; only its owner can read it). {} when there is none."""
    if os.environ.get("NATS_NKEY"):
        return {"nkeys_seed": os.environ["NATS_NKEY"]}
    if os.environ.get("NATS_CREDS"):
        return {"user_credentials": os.environ["NATS_CREDS"]}
    stack = local_stack()
    if stack.get("nats_url") == url and stack.get("service_nkey") and Path(stack["service_nkey"]).is_file():
        return {"nkeys_seed": stack["service_nkey"]}
    return {}
