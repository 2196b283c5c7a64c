"""The rollout service: a worker that turns rollout requests into trajectories.

Role: hold a generation engine per model (vLLM, or transformers as the light
fallback), keep it on the latest policy of the job it serves, and run the
agent loop (agent_loop.py) for each requested group of episodes.

Joins the pool: a heartbeat in KV `ot_workers` (kind "rollout", `rollout_slots` jobs
at once, the engines it can run). The scheduler places jobs on it; their learners
address its requests to it. Several jobs of one base model share its engine, each
episode generated with its own job's adapter and policy version.

Reads:
  ot.job.*.rollout.<worker_id>
                     stream OT_ROLLOUT, durable pull consumer "rollout-<worker_id>"
                     (this worker's requests, of every job placed here). Up to 16
                     requests are fetched together; the episodes of each job among
                     them share one engine call per turn. A request is acked only after all its
                     trajectories are published.
  ot.job.*.weights   stream OT_WEIGHTS, an ordered consumer from each job's last
                     event: a job's policy is the latest WeightsPublished of the learner
                     run a request names (`policy_run`; bytes from the object store
                     `ot_weights` or a file, sha256-checked). A request waits for the
                     version it names if this worker has not seen it.
  ot_jobs (KV)       a request is served only for a job the record places on this
                     worker, at the record's placement attempt, with the record's model
                     and engine; one of a finished job or a past attempt is acked and
                     skipped; any other (a job not placed here, another model) is
                     dead-lettered with the reason.
Writes:
  ot.job.<id>.traj   one Trajectory per episode, Nats-Msg-Id = `<job_id>:<episode_id>`
                     (episode id `<request_id>-e<i>`), so a redelivered request dedups;
                     stamped with the learner run whose weights sampled it.
  ot.dlq.rollout     undecodable or invalid requests, and requests whose weights or
                     model cannot be loaded, with the reason.
Calls (core request/reply): ot.env.<env>.init / .reset, ot.env.host.<host>.step / .close.

Run: `python -m opentinker.services.rollout [engine=auto|vllm|hf] [device=auto|cpu|cuda]
[worker_id=NAME] [nats_url=...]` (`--print-config` shows the settings).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import re
import shutil
import time
import zlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
import tenacity
import torch
from nats.aio.msg import Msg
from nats.js import api
from nats.js.errors import NotFoundError

from opentinker.schemas import (
    EnvCloseRequest,
    EnvInitReply,
    EnvInitRequest,
    EnvResetReply,
    EnvResetRequest,
    EnvStepReply,
    EnvStepRequest,
    RolloutRequest,
    Trajectory,
    WeightsPublished,
    decode,
    encode,
)
from opentinker.schemas import subjects as S
from opentinker.services.core import tracing
from opentinker.services.core.bus import TRANSIENT, Bus
from opentinker.services.core.config import Settings
from opentinker.services.core.pool import Heartbeat, default_worker_id, machine_capacity
from opentinker.services.core.models import resolve_model
from opentinker.services.core.runner import run_service
from opentinker.services.rollout.agent_loop import AgentLoop, EnvError
from opentinker.services.rollout.weights import (
    BaseWeights,
    HeldWeights,
    WeightsError,
    check_sha256,
    decode_tensors,
    lora_pairs,
    lora_scale,
    merge_lora,
    parse_uri,
    write_peft_adapter,
)

log = logging.getLogger("opentinker.rollout")

ROLLOUT_STREAM = "OT_ROLLOUT"
WEIGHTS_STREAM = "OT_WEIGHTS"
FETCH_BATCH = 16
FETCH_LINGER_S = 0.05        # a learner publishes a step's requests back to back
# a worker that dies with requests in hand has them redelivered this long after its
# last "in progress": short, so a restarted (or another) worker takes them soon
ACK_WAIT_S = 60.0
IN_PROGRESS_EVERY_S = 15.0   # well inside ack_wait
ENV_SETUP_TIMEOUT_S = 30.0
ENV_SETUP_RETRY_S = 60.0     # how long init/reset wait for an envhost of the env to appear
ENV_STEP_TIMEOUT_S = 120.0   # a user's step may run tools or a verifier
ENV_CLOSE_TIMEOUT_S = 2.0
WEIGHTS_WAIT_S = 60.0        # for a version a request names but this worker has not seen
JOBS_KEPT = 4                # per-job policy tensors kept for fast job switches
RUNS_KEPT = 4                # learner runs per job whose newest weight event is remembered
JOBS_TRACKED = 1024          # jobs whose weight events are remembered (a lookup refills one)
MAX_MODEL_LEN = 2048
_HOST_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


PolicyId = tuple[str, int, str]  # (job id, policy version, sha256 of the weights)
BASE: PolicyId = ("", 0, "")     # the model's own weights, policy version 0 of every job


class WeightsUnavailable(Exception):
    """A request names a policy version whose weight event has not arrived."""


# -- environment RPC over NATS ------------------------------------------------


class NatsEnvClient:
    """agent_loop.EnvClient over NATS request/reply; transport failures -> EnvError.

    Init and reset go to any envhost of the env, so "no env host serves it" there is
    retried with backoff for up to ENV_SETUP_RETRY_S (an envhost restarting, or
    starting after the job): an envhost restart costs time, not episodes. A step goes to
    the host holding the episode's game; if that host is gone, so is the game, and the
    episode ends with the error."""

    def __init__(self, bus: Bus, setup_retry_s: float = 0.0):
        self.bus = bus
        self.setup_retry_s = setup_retry_s

    async def _request(self, subject: str, msg: msgspec.Struct, kind: type, timeout_s: float,
                       retry_s: float = 0.0):
        try:
            async for attempt in tenacity.AsyncRetrying(
                    retry=tenacity.retry_if_exception_type(nats.errors.NoRespondersError),
                    wait=tenacity.wait_exponential_jitter(multiplier=0.5, max=5.0, jitter=0.5),
                    stop=tenacity.stop_after_delay(retry_s), reraise=True):
                with attempt:
                    return await self.bus.request(subject, msg, kind, timeout_s=timeout_s)
        except nats.errors.NoRespondersError:
            raise EnvError(f"no env host serves {subject}"
                           + (f" (waited {retry_s:g} s for one)" if retry_s else "")) from None
        except nats.errors.TimeoutError:
            raise EnvError(f"no reply on {subject} within {timeout_s:g} s") from None
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise EnvError(f"unreadable {kind.__name__} on {subject}: {e}") from None

    @staticmethod
    def _host(host_id: str) -> str:
        if not _HOST_ID.match(host_id):
            raise EnvError(f"env reset replied with an invalid host_id {host_id!r}")
        return host_id

    async def init(self, req: EnvInitRequest) -> EnvInitReply:
        return await self._request(S.env_init(req.env), req, EnvInitReply, ENV_SETUP_TIMEOUT_S,
                                   self.setup_retry_s)

    async def reset(self, req: EnvResetRequest) -> EnvResetReply:
        return await self._request(S.env_reset(req.env), req, EnvResetReply, ENV_SETUP_TIMEOUT_S,
                                   self.setup_retry_s)

    async def step(self, host_id: str, req: EnvStepRequest) -> EnvStepReply:
        return await self._request(S.env_step(self._host(host_id)), req, EnvStepReply, ENV_STEP_TIMEOUT_S)

    async def close(self, host_id: str, req: EnvCloseRequest) -> None:
        try:
            await self.bus.nc.request(S.env_close(self._host(host_id)), encode(req),
                                      timeout=ENV_CLOSE_TIMEOUT_S, headers=self.bus.headers(req, None, None))
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as e:
            raise EnvError(f"close on {host_id}: {e!r}") from None


# -- request checks -----------------------------------------------------------


def check_request(req: RolloutRequest, subject: str) -> str:
    """'' if `req` can be served, else the reason, naming the field."""
    for field, check in (("job_id", S.check_job_id), ("env", S.env_init)):
        try:
            check(getattr(req, field))
        except ValueError as e:
            return f"`{field}`: {e}"
    if S.job_id_of(subject) != req.job_id:
        return f"`job_id`: {req.job_id!r} arrived on {subject}"
    if not req.request_id.startswith(f"{req.job_id}-") or len(req.request_id) > 200:
        return f"`request_id`: {req.request_id[:80]!r} must start with the job id and a hyphen (<= 200 chars)"
    s = req.sampling
    checks = [
        (1 <= req.group_size <= 1024, "group_size", "must be in [1, 1024]"),
        (req.policy_version >= 0, "policy_version", "must be >= 0"),
        (req.engine in ("auto", "vllm", "hf"), "engine", "must be auto, vllm or hf"),
        (bool(req.model.strip()), "model", "must name a model"),
        (s.temperature >= 0, "sampling.temperature", "must be >= 0"),
        (0 < s.top_p <= 1, "sampling.top_p", "must be in (0, 1]"),
        (s.max_new_tokens >= 1, "sampling.max_new_tokens", "must be >= 1"),
        (s.max_turns >= 1, "sampling.max_turns", "must be >= 1"),
        (s.max_total_tokens >= 2, "sampling.max_total_tokens", "must be >= 2"),
    ]
    for ok, field, reason in checks:
        if not ok:
            return f"`{field}`: {reason} (got {_get(req, field)!r})"
    return ""


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


# -- engines and the policy they hold -------------------------------------------


class EngineSlot:
    """One engine for one model, the thread that runs it, and the policy it holds."""

    def __init__(self, engine: Any, model_dir: str, executor: ThreadPoolExecutor):
        self.engine = engine
        # every engine call (create, generate, load) from one thread: vLLM's CPU
        # backend binds its OpenMP threads to the thread that created it
        self.executor = executor
        self.base = BaseWeights(model_dir)
        self.held = HeldWeights(self.base, engine.packed_modules)
        self.holding: PolicyId = BASE
        self.updates: OrderedDict[str, tuple[PolicyId, dict[str, torch.Tensor]]] = OrderedDict()
        # held from loading a job's policy to the end of its generation: jobs sharing
        # the engine (LoRA jobs, inference endpoints) never interleave their weights
        self.lock = asyncio.Lock()
        self.adapters: dict[str, str] = {}  # job -> its adapter folder (vLLM multi-LoRA)
        self.last_used = time.monotonic()


def pick_engine(requested: str, configured: str, model_dir: str) -> str:
    """The request's engine, else the worker's setting, else vLLM when it is
    installed and the model's head_dim >= 32, else transformers."""
    kind = requested if requested != "auto" else configured
    if kind == "auto":
        from opentinker.services.rollout import engine_vllm

        kind = "vllm" if engine_vllm.supports(model_dir) else "hf"
    return kind


class RolloutWorker:
    """The service's state: engines, the newest weight event per job, the env client."""

    def __init__(self, settings: Settings, bus: Bus):
        self.settings = settings
        self.bus = bus
        self.worker = S.check_worker_id(settings.worker_id or default_worker_id("rollout"))
        self.device = settings.device if settings.device != "auto" else (
            "cuda" if torch.cuda.is_available() else "cpu")
        self.seed = zlib.crc32(self.worker.encode())
        self.env = NatsEnvClient(bus, setup_retry_s=ENV_SETUP_RETRY_S)
        self.engines: dict[tuple[str, str], EngineSlot] = {}
        self.newest: dict[str, tuple[int, WeightsPublished]] = {}  # job -> (stream seq, event)
        # job -> learner run -> (stream seq, that run's latest event)
        self.runs: dict[str, dict[str, tuple[int, WeightsPublished]]] = {}
        self._looked_up: set[str] = set()
        self._weights_seen = asyncio.Condition()
        self._sub = None

    async def start(self) -> None:
        # an ordered consumer from the last event of every job, then live ones: a
        # restarted worker knows each job's policy without asking
        self._sub = await self.bus.js.subscribe(
            S.STREAMS[WEIGHTS_STREAM][0][0], stream=WEIGHTS_STREAM, cb=self._on_weights,
            ordered_consumer=True, deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT)

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._sub.unsubscribe()
        for slot in self.engines.values():
            slot.executor.shutdown(wait=False, cancel_futures=True)

    # -- weights events --

    async def _on_weights(self, m: Msg) -> None:
        # an ordered consumer: nothing to ack; a bad event is dead-lettered and ignored
        try:
            ev = decode(m.data, WeightsPublished)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            await self.bus.dead_letter(m, f"cannot decode WeightsPublished: {e}")
            return
        if ev.job_id != S.job_id_of(m.subject):
            await self.bus.dead_letter(m, f"WeightsPublished.job_id: {ev.job_id!r} on {m.subject}")
            return
        await self._note(ev, m.metadata.sequence.stream)

    async def _note(self, ev: WeightsPublished, seq: int) -> None:
        # within a run the latest announcement wins, not the highest version; across
        # runs a request names its run: a resumed learner re-announces its checkpoint's
        # lower version under a new run, and a lost run's newer versions are not its policy
        old = self.newest.get(ev.job_id)
        if old is None or seq > old[0]:
            self.newest[ev.job_id] = (seq, ev)
        while len(self.newest) > JOBS_TRACKED:  # the jobs whose events came longest ago go
            gone = min(self.newest, key=lambda j: self.newest[j][0])
            del self.newest[gone]
            self.runs.pop(gone, None)
            self._looked_up.discard(gone)
        runs = self.runs.setdefault(ev.job_id, {})
        mine = runs.get(ev.run)
        if mine is None or seq > mine[0]:
            runs[ev.run] = (seq, ev)
        while len(runs) > RUNS_KEPT:
            del runs[min(runs, key=lambda r: runs[r][0])]
        async with self._weights_seen:
            self._weights_seen.notify_all()

    async def _last_event(self, job_id: str) -> None:
        raw = await self.bus.last_message(S.job(job_id, "weights"))
        if raw is None:
            return
        try:
            ev = decode(raw.data, WeightsPublished)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("ignoring an unreadable last weight event of job %s: %s", job_id, e)
            return
        if ev.job_id == job_id:
            await self._note(ev, raw.seq)

    async def _all_events(self, job_id: str) -> None:
        """Note every weight event the stream holds for the job (once per job: a
        restarted worker learns each run's newest event, not just the job's last)."""
        for raw in await self.bus.read_raw(S.job(job_id, "weights")):
            try:
                ev = decode(raw.data, WeightsPublished)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            if ev.job_id == job_id:
                await self._note(ev, raw.seq)

    def _newest_of(self, job_id: str, run: str) -> WeightsPublished | None:
        got = self.runs.get(job_id, {}).get(run) if run else self.newest.get(job_id)
        return got[1] if got else None

    async def newest_event(self, job_id: str, at_least: int, run: str = "") -> WeightsPublished | None:
        """The latest weight event of learner run `run` of the job ("": of any run),
        waiting up to WEIGHTS_WAIT_S for one of version `at_least` or newer. None = no
        event yet (version 0, the base model). Raises WeightsUnavailable if no such
        version arrives."""
        if job_id not in self._looked_up:
            self._looked_up.add(job_id)
            await self._all_events(job_id)  # the subscription may not have caught up yet

        def have() -> int:
            got = self._newest_of(job_id, run)
            return got.policy_version if got else 0

        deadline = time.monotonic() + WEIGHTS_WAIT_S
        while have() < at_least:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WeightsUnavailable(f"job {job_id}: policy version {at_least} was requested, "
                                         f"the newest weight event is version {have()}")
            async with self._weights_seen:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._weights_seen.wait(), min(left, 2.0))
            await self._last_event(job_id)
        return self._newest_of(job_id, run)

    async def _fetch(self, uri: str) -> bytes:
        scheme, bucket, name = parse_uri(uri)
        if scheme == "file":
            try:
                return await asyncio.to_thread(Path(name).read_bytes)
            except OSError as e:
                raise WeightsError(f"`uri`: cannot read {name}: {e}") from None
        try:
            return await self.bus.get_object(bucket, name)
        except NotFoundError:
            raise WeightsError(f"`uri`: no object {name!r} in bucket {bucket!r}") from None

    @staticmethod
    def _tensors(slot: EngineSlot, ev: WeightsPublished, data: bytes) -> dict[str, torch.Tensor]:
        check_sha256(data, ev.sha256)
        tensors = decode_tensors(data)
        if ev.kind == "lora":
            pairs = lora_pairs(tensors)
            return merge_lora(slot.base, pairs, lora_scale(ev.lora_alpha, ev.lora_rank, pairs))
        # a tied lm_head is not in the base checkpoint but is a name learners save
        unknown = sorted(set(tensors) - set(slot.base) - {"lm_head.weight"})
        if unknown:
            raise WeightsError(f"full weights name parameters the model lacks: {unknown[:5]}")
        for name, t in tensors.items():
            if name in slot.base and slot.base[name].shape != t.shape:
                raise WeightsError(f"full weights: {name!r} is {tuple(t.shape)}, "
                                   f"the model's is {tuple(slot.base[name].shape)}")
        return tensors

    async def ensure_policy(self, slot: EngineSlot, job_id: str, at_least: int, run: str = "") -> int:
        """Make `slot`'s engine hold the latest policy of learner run `run` of the job
        (version >= `at_least`; "": the job's newest of any run), loading it unless it
        already does; returns that policy version."""
        ev = await self.newest_event(job_id, at_least, run)
        # weights are identified by their bytes: a resumed learner re-makes a version
        ident = (job_id, ev.policy_version, ev.sha256) if ev else BASE
        if slot.holding == ident:
            return ident[1]
        with tracing.span("rollout.load_policy", attrs={"ot.job_id": job_id, "ot.policy_version": ident[1],
                                                        "ot.kind": ev.kind if ev else "base"}):
            return await self._load_policy(slot, job_id, ev, ident)

    async def _load_policy(self, slot: EngineSlot, job_id: str, ev: WeightsPublished | None,
                           ident: PolicyId) -> int:
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        max_rank = getattr(slot.engine, "max_lora_rank", 0)
        if ev is not None and ev.kind == "lora" and 0 < (ev.lora_rank or 1) <= max_rank:
            return await self._use_adapter(slot, job_id, ev, ident, t0)
        if max_rank:
            slot.engine.use_lora(None)
        cached = slot.updates.get(job_id)
        if ev is None:
            new: dict[str, torch.Tensor] = {}
        elif cached is not None and cached[0] == ident:
            new = cached[1]
            slot.updates.move_to_end(job_id)
        else:
            data = await self._fetch(ev.uri)
            new = await loop.run_in_executor(slot.executor, self._tensors, slot, ev, data)
            slot.updates[job_id] = (ident, new)
            slot.updates.move_to_end(job_id)
            while len(slot.updates) > JOBS_KEPT:
                slot.updates.popitem(last=False)
        plan = slot.held.plan(new)
        await loop.run_in_executor(slot.executor, slot.engine.load_weights, plan)
        slot.held.commit(new)
        slot.holding = ident
        log.info("job %s: policy version %d loaded (%d tensors in %.2f s)",
                 job_id, ident[1], len(plan), time.perf_counter() - t0)
        return ident[1]

    async def _use_adapter(self, slot: EngineSlot, job_id: str, ev: WeightsPublished, ident: PolicyId,
                           t0: float) -> int:
        """vLLM multi-LoRA: the engine keeps the base weights and applies the job's
        adapter per request. The adapter is written once per version as a peft folder
        under <home>/cache/adapters/<job>/; the job's previous one is dropped."""
        loop = asyncio.get_running_loop()
        folder = Path(self.settings.home) / "cache" / "adapters" / job_id / ev.sha256[:16]
        if not (folder / "adapter_config.json").exists():
            data = await self._fetch(ev.uri)

            def write() -> None:
                check_sha256(data, ev.sha256)
                pairs = lora_pairs(decode_tensors(data))
                write_peft_adapter(slot.base, pairs, ev.lora_alpha, ev.lora_rank, folder)

            await loop.run_in_executor(slot.executor, write)
        plan = slot.held.plan({})  # back to the base weights if a full-weight job left its own
        if plan:
            await loop.run_in_executor(slot.executor, slot.engine.load_weights, plan)
        slot.held.commit({})
        previous = slot.adapters.get(job_id)
        drop = previous if previous and previous != str(folder) else None
        await loop.run_in_executor(slot.executor, slot.engine.use_lora, str(folder), drop)
        if drop:
            shutil.rmtree(drop, ignore_errors=True)
        slot.adapters[job_id] = str(folder)
        slot.holding = ident
        log.info("job %s: policy version %d applied as a vLLM LoRA adapter (%.2f s)",
                 job_id, ident[1], time.perf_counter() - t0)
        return ident[1]

    # -- engines --

    async def engine_for(self, req: RolloutRequest) -> EngineSlot:
        """The engine slot for the request's model; see engine_for_model."""
        return await self.engine_for_model(req.model, req.engine)

    async def engine_for_model(self, model: str, engine: str) -> EngineSlot:
        """The engine slot for `model` on `engine` ("auto", "vllm", "hf"), created on
        first use. Raises OSError/ValueError/RuntimeError/ImportError when the model or
        engine cannot load."""
        model_dir = await asyncio.to_thread(resolve_model, model, self.settings.home)
        kind = pick_engine(engine, self.settings.engine, model_dir)
        chosen_for_us = engine == "auto" and self.settings.engine == "auto"
        key = (model_dir, kind)
        if key in self.engines:
            self.engines[key].last_used = time.monotonic()
            return self.engines[key]
        self._evict(self.settings.rollout_slots - 1)
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engine-{kind}")
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        try:
            try:
                engine = await loop.run_in_executor(executor, self._make_engine, kind, model_dir)
            except ImportError as e:
                if not (chosen_for_us and kind == "vllm"):
                    raise
                log.warning("vLLM does not import (%s); using the transformers engine", e)
                kind, key = "hf", (model_dir, "hf")
                if key in self.engines:
                    executor.shutdown(wait=False)
                    return self.engines[key]
                engine = await loop.run_in_executor(executor, self._make_engine, kind, model_dir)
        except BaseException:
            executor.shutdown(wait=False)
            raise
        self.engines[key] = EngineSlot(engine, model_dir, executor)
        log.info("%s engine for %s ready in %.1f s (device %s)", kind, model_dir,
                 time.perf_counter() - t0, self.device)
        return self.engines[key]

    def _evict(self, keep: int) -> None:
        """Drop least recently used idle engines until at most `keep` remain: a worker
        holds at most `rollout_slots` jobs, so it never needs more engines than that,
        and a model no placed job uses must not hold memory forever."""
        idle = sorted((k for k, slot in self.engines.items() if not slot.lock.locked()),
                      key=lambda k: self.engines[k].last_used)
        while len(self.engines) > max(keep, 0) and idle:
            key = idle.pop(0)
            slot = self.engines.pop(key)
            slot.executor.shutdown(wait=False, cancel_futures=True)
            log.info("engine for %s (%s) unloaded: unused longest, and the worker is at its %d engines",
                     key[0], key[1], self.settings.rollout_slots)
        if len(self.engines) > keep:
            log.warning("%d engines busy; loading one more than rollout_slots", len(self.engines))
        import gc

        gc.collect()

    def multi_lora(self) -> bool:
        """Whether vLLM engines apply adapters per request (settings.vllm_multi_lora)."""
        mode = self.settings.vllm_multi_lora
        return self.settings.lora_max_rank > 0 and (mode == "on" or (mode == "auto" and self.device == "cuda"))

    def _make_engine(self, kind: str, model_dir: str) -> Any:
        if kind == "vllm":
            from opentinker.services.rollout.engine_vllm import VLLMEngine

            # float32 on CPU: sampler logprobs match the learner's float32 (engine_vllm)
            dtype = "bfloat16" if self.device == "cuda" else "float32"
            return VLLMEngine(model_dir, device=self.device, dtype=dtype, seed=self.seed,
                              max_model_len=MAX_MODEL_LEN,
                              max_loras=self.settings.rollout_slots if self.multi_lora() else 0,
                              max_lora_rank=self.settings.lora_max_rank)
        from opentinker.services.rollout.engine_hf import HFEngine

        return HFEngine(model_dir, device=self.device, dtype="float32", seed=self.seed,
                        max_model_len=MAX_MODEL_LEN)

    # -- requests --

    async def admit(self, req: RolloutRequest) -> tuple[str, str]:
        """Whether to serve `req`, by the job's record: ("serve", ""), ("skip", why) for
        a finished job or a past placement attempt (acked: nothing is wrong), or
        ("refuse", why) for a request this worker must never serve (dead-lettered): a
        job with no record or not placed here, or another model or engine than the
        job's. A worker thus runs only what the scheduler placed on it."""
        try:
            got = await self.bus.job_record(req.job_id)
        except msgspec.MsgspecError as e:
            return "refuse", f"job {req.job_id}: unreadable JobRecord ({e})"
        if got is None:
            return "refuse", f"`job_id`: no job {req.job_id!r} (only jobs placed on this worker are served)"
        rec = got[0]
        if rec.state.terminal:
            return "skip", f"job {req.job_id} is {rec.state.value}"
        if req.attempt != rec.attempt:
            return "skip", f"attempt {req.attempt} is past (the job is at attempt {rec.attempt})"
        if rec.placement is None or self.worker not in rec.placement.rollout:
            return "refuse", f"`job_id`: job {req.job_id} is not placed on worker {self.worker}"
        if req.model != rec.spec.model:
            return "refuse", f"`model`: {req.model!r} is not job {req.job_id}'s model {rec.spec.model!r}"
        if req.engine != rec.spec.engine:
            return "refuse", f"`engine`: {req.engine!r} is not job {req.job_id}'s engine {rec.spec.engine!r}"
        return "serve", ""

    async def handle(self, msgs: list[Msg]) -> None:
        """Serve one fetched batch: check each request, then run the groups of each
        (model, job) together. Every message ends acked, naked or dead-lettered."""
        pending: dict[int, Msg] = {}
        seen: set[tuple[str, str]] = set()
        parts: dict[tuple[str, str, str], list[tuple[RolloutRequest, Msg]]] = {}
        for m in msgs:
            req = await self.bus.decode_or_dead_letter(m, RolloutRequest)
            if req is None:
                continue
            reason = check_request(req, m.subject)
            if reason:
                await self._reject(m, f"invalid RolloutRequest: {reason}")
                continue
            verdict, why = await self.admit(req)
            if verdict == "refuse":
                await self._reject(m, f"RolloutRequest refused: {why}")
                continue
            if verdict == "skip":
                log.info("skipping request %s: %s", req.request_id, why)
                await m.ack()
                continue
            if (req.job_id, req.request_id) in seen:
                # the same group twice (a republished request): its episode ids, and
                # so its trajectories, are the first copy's
                log.info("job %s: request %s twice in one batch", req.job_id, req.request_id)
                await m.ack()
                continue
            seen.add((req.job_id, req.request_id))
            pending[id(m)] = m
            parts.setdefault((req.model, req.engine, req.job_id, req.policy_run), []).append((req, m))
        if not parts:
            return
        beat = asyncio.create_task(self._heartbeat(pending))
        try:
            for items in parts.values():
                await self._run_part(items, pending)
        finally:
            beat.cancel()
            # whatever was not finished (cancelled on shutdown, failed): another
            # worker, or this one, takes it again now rather than after ack_wait
            for m in pending.values():
                with contextlib.suppress(nats.errors.Error):
                    await m.nak(delay=1.0)

    async def _reject(self, m: Msg, reason: str) -> None:
        await self.bus.dead_letter(m, reason)
        await m.term()

    async def _heartbeat(self, pending: dict[int, Msg]) -> None:
        while True:
            await asyncio.sleep(IN_PROGRESS_EVERY_S)
            for m in list(pending.values()):
                with contextlib.suppress(nats.errors.Error):
                    await m.in_progress()

    async def _run_part(self, items: list[tuple[RolloutRequest, Msg]], pending: dict[int, Msg]) -> None:
        reqs = [r for r, _ in items]
        msg_of = {r.request_id: m for r, m in items}
        job_id = reqs[0].job_id
        try:
            slot = await self.engine_for(reqs[0])
        except (OSError, ValueError, RuntimeError, ImportError) as e:
            for _, m in items:
                pending.pop(id(m), None)
                await self._reject(m, f"`model`/`engine`: cannot load {reqs[0].model!r}: {e}")
            return
        at_least = max(r.policy_version for r in reqs)

        run = reqs[0].policy_run

        async def policy_version() -> int:
            return await self.ensure_policy(slot, job_id, at_least, run)

        async def publish(req: RolloutRequest, trajs: list[Trajectory]) -> None:
            m = msg_of[req.request_id]
            tp = (m.headers or {}).get(S.H_TRACEPARENT)
            for t in trajs:
                if t.policy_version > 0:
                    t = msgspec.structs.replace(t, policy_run=run)
                # the stream dedups msg ids across all jobs; request ids are only
                # known to be unique within one. The trajectory carries its episode's
                # trace context on to the learner.
                with tracing.within(loop.spans.get(t.episode_id)), tracing.span(
                        "rollout.publish_trajectory", kind=tracing.SpanKind.PRODUCER,
                        attrs={"ot.episode_id": t.episode_id}):
                    await self.bus.publish(S.job(job_id, "traj"), t, msg_id=f"{job_id}:{t.episode_id}",
                                           traceparent=tp)
            await m.ack()
            pending.pop(id(m), None)

        loop = AgentLoop(slot.engine, self.env, worker=self.worker, executor=slot.executor)
        t0 = time.perf_counter()
        try:
            async with slot.lock:
                await loop.run(reqs, policy_version, publish,
                               parents={r.request_id: tracing.extract(m.headers) for r, m in items})
        except WeightsError as e:
            for _, m in items:
                if pending.pop(id(m), None) is not None:
                    await self._reject(m, f"weights of job {job_id} cannot be applied: {e}")
            return
        except WeightsUnavailable as e:
            log.warning("%s; the requests go back to the queue", e)
            return
        n = sum(r.group_size for r in reqs)
        log.info("job %s: %d groups, %d episodes in %.1f s", job_id, len(reqs), n, time.perf_counter() - t0)


async def fetch_batch(bus: Bus, sub: Any) -> list[Msg]:
    """Up to FETCH_BATCH requests: wait up to 1 s for the first, then linger briefly
    for the rest of a step's requests so they share engine calls."""
    msgs = await bus.fetch(sub, FETCH_BATCH, 1.0)
    if msgs and len(msgs) < FETCH_BATCH:
        await asyncio.sleep(FETCH_LINGER_S)
        msgs += await bus.fetch(sub, FETCH_BATCH - len(msgs), FETCH_LINGER_S)
    return msgs


async def body(settings: Settings, bus: Bus, stop: asyncio.Event) -> None:
    worker = RolloutWorker(settings, bus)
    await worker.start()
    durable = f"rollout-{worker.worker}"
    sub = await bus.pull(ROLLOUT_STREAM, durable, S.rollout_of_worker(worker.worker), ack_wait_s=ACK_WAIT_S)
    engines = ["vllm", "hf"] if importlib.util.find_spec("vllm") and settings.engine != "hf" else ["hf"]
    server = None
    serve_url = ""
    if settings.serve_port >= 0:
        from opentinker.services.core.http import serve_http
        from opentinker.services.rollout.openai_api import make_app

        server = await serve_http(make_app(worker), settings.serve_host, settings.serve_port)
        serve_url = settings.serve_url or f"http://{settings.serve_host}:{server.port}"
        log.info("OpenAI-compatible endpoint for inference jobs on %s/jobs/<job>/v1", serve_url)
    beat = Heartbeat(bus, "rollout", worker.worker, settings.pool,
                     machine_capacity(settings.rollout_slots, engines), jobs=list, serve_url=serve_url)
    await beat.start()
    log.info("rollout worker %s of pool %s ready (engine %s, device %s)", worker.worker, settings.pool,
             settings.engine, worker.device)
    stopped = asyncio.create_task(stop.wait())
    try:
        while not stop.is_set():
            msgs = await fetch_batch(bus, sub)
            if not msgs:
                continue
            work = asyncio.create_task(worker.handle(msgs))
            await asyncio.wait({work, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                work.cancel()  # its cleanup naks what it had not finished
                with contextlib.suppress(asyncio.CancelledError):
                    await work
            else:
                try:
                    work.result()
                except TRANSIENT as e:
                    # the bus outlasted its retries mid-batch: what was not published is
                    # naked (or redelivered after ack_wait); keep serving once it is back
                    log.warning("serving a batch failed on NATS (%r); its requests go back to the queue", e)
    finally:
        stopped.cancel()
        await beat.stop()
        if server is not None:
            await server.stop()
        await worker.close()


def main(argv: list[str] | None = None) -> None:
    run_service("rollout", body, argv)
