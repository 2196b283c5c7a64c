"""The rollout service: a worker that turns rollout requests into trajectories.

Role: hold a generation engine per model (vLLM, or transformers as the light
fallback), keep it on the latest policy of the job it serves, and run the
agent loop (agent_loop.py) for each requested group of episodes.

Modules: service.py (this one) is the loop: admission, engines, serving a batch,
publishing trajectories. policy.py tracks the jobs' weight events and loads a policy
into an engine; env_client.py calls the env hosts; agent_loop.py runs episodes;
engine_vllm.py / engine_hf.py wrap the engines; openai_api.py serves inference jobs.

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
                     trajectories are published. TinkerSample messages (a Tinker API
                     sampling session's calls) come here too: sampling.py.
  ot.job.*.weights   stream OT_WEIGHTS, through policy.py: a job's policy is the latest
                     WeightsPublished of the learner run a request names (`policy_run`;
                     bytes from the object store `ot_weights` or a file, sha256-checked).
                     A request waits for the version it names if this worker has not seen
                     it; if it never comes, the request goes back to the queue.
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
                     model cannot be loaded, with the reason (and bad weight events, policy.py).
Calls (core request/reply, env_client.py; under ot.env.user.<owner>. for a job whose
record names the user's own envhost as `env_owner`): ot.env.<env>.init / .reset,
ot.env.host.<host>.step / .close.

Run: `python -m opentinker.services.rollout [engine=auto|vllm|hf] [device=auto|cpu|cuda]
[worker_id=NAME] [nats_url=...]` (`--print-config` shows the settings).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import logging
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
import torch
from nats.aio.msg import Msg

from opentinker.schemas import JobRecord, RolloutRequest, Trajectory
from opentinker.schemas.rollout import TEACHER_MISMATCH
from opentinker.schemas.tinker import TinkerSample
from opentinker.schemas import subjects as S
from opentinker.services.core import tracing
from opentinker.services.core.bus import TRANSIENT, Bus
from opentinker.services.core.config import Settings
from opentinker.services.core.pool import Heartbeat, default_worker_id, machine_capacity
from opentinker.services.core.models import resolve_model, resolve_sampler_dtype
from opentinker.services.core.runner import run_service
from opentinker.services.rollout.agent_loop import AgentLoop
from opentinker.services.rollout.env_client import ENV_SETUP_RETRY_S, NatsEnvClient
from opentinker.services.rollout.policy import EngineSlot, PolicyTracker, WeightsUnavailable
from opentinker.services.rollout.sampling import admit_sample, batch_key, is_sample, serve_samples
from opentinker.services.rollout.teacher import check_teacher_vocab
from opentinker.services.rollout.weights import WeightsError

log = logging.getLogger("opentinker.rollout")

FETCH_BATCH = 16
FETCH_LINGER_S = 0.05        # a learner publishes a step's requests back to back
# a worker that dies with requests in hand has them redelivered this long after its
# last "in progress": short, so a restarted (or another) worker takes them soon
ACK_WAIT_S = 60.0
IN_PROGRESS_EVERY_S = 15.0   # well inside ack_wait
MAX_MODEL_LEN = 2048


# -- request checks -----------------------------------------------------------


def check_request(req: RolloutRequest, subject: str) -> str:
    """'' if `req` can be served, else the reason, naming the field. Its numbers
    (group_size, policy_version, sampling) and engine were checked by decoding: their
    bounds live on the schema fields, the same ones a job spec is validated against."""
    for field, check in (("job_id", S.check_job_id), ("env", S.env_init)):
        try:
            check(getattr(req, field))
        except ValueError as e:
            return f"`{field}`: {e}"
    if S.job_id_of(subject) != req.job_id:
        return f"`job_id`: {req.job_id!r} arrived on {subject}"
    if not req.request_id.startswith(f"{req.job_id}-") or len(req.request_id) > 200:
        return f"`request_id`: {req.request_id[:80]!r} must start with the job id and a hyphen (<= 200 chars)"
    if not req.model.strip():
        return "`model`: must name a model"
    return ""


# -- engines -------------------------------------------------------------------


def pick_engine(requested: str, configured: str, model_dir: str) -> str:
    """The request's engine, else the worker's setting, else vLLM when it is
    installed and the model's head_dim >= 32, else transformers."""
    kind = requested if requested != "auto" else configured
    if kind == "auto":
        from opentinker.services.rollout import engine_vllm

        kind = "vllm" if engine_vllm.supports(model_dir) else "hf"
    return kind


class RolloutWorker:
    """The service's state: engines, the jobs' policies (policy.py), the env client."""

    def __init__(self, settings: Settings, bus: Bus):
        self.settings = settings
        self.bus = bus
        self.worker = S.check_worker_id(settings.worker_id or default_worker_id("rollout"))
        self.device = settings.device if settings.device != "auto" else (
            "cuda" if torch.cuda.is_available() else "cpu")
        self.seed = zlib.crc32(self.worker.encode())
        self.env = NatsEnvClient(bus, setup_retry_s=ENV_SETUP_RETRY_S, step_timeout_s=settings.env_step_timeout_s)
        self.engines: dict[tuple[str, str, str, str], EngineSlot] = {}  # (model dir, kind, dtype, role)
        # job id -> its learner `dtype`, read from the job record at admission: a CPU
        # sampler's "auto" precision follows it (resolve_sampler_dtype)
        self.learner_dtype: dict[str, str] = {}
        # job id -> whose envhosts serve its env (JobRecord.env_owner: "" = the operator's)
        self.env_owner: dict[str, str] = {}
        self.detached: set[asyncio.Task] = set()  # parts of jobs on a user's own envhost (_detach)
        self.engine_lock = asyncio.Lock()
        self.policies = PolicyTracker(bus, Path(settings.home) / "cache" / "adapters")
        # (student model dir, teacher model dir) whose vocabularies were found equal
        self.same_vocab: set[tuple[str, str]] = set()

    async def start(self) -> None:
        await self.policies.start()

    async def close(self) -> None:
        for task in list(self.detached):
            task.cancel()
        await asyncio.gather(*self.detached, return_exceptions=True)
        await self.policies.close()
        for slot in self.engines.values():
            slot.executor.shutdown(wait=False, cancel_futures=True)

    # -- engines --

    async def engine_for(self, req: RolloutRequest, learner_dtype: str = "float32") -> EngineSlot:
        """The engine slot for the request's model; see engine_for_model."""
        return await self.engine_for_model(req.model, req.engine, req.sampler_dtype, learner_dtype)

    async def engine_for_model(self, model: str, engine: str, sampler_dtype: str = "auto",
                               learner_dtype: str = "float32", role: str = "") -> EngineSlot:
        """The engine slot for `model` on `engine` ("auto", "vllm", "hf") in
        `sampler_dtype` ("auto", "float32", "bfloat16"; "auto" follows the job's
        `learner_dtype` on a CPU, resolve_sampler_dtype), created on first use; `role`
        "teacher": a slot apart from the students' (a distillation teacher's model, on
        its own weights). Raises OSError/ValueError/RuntimeError/ImportError when the
        model or engine cannot load."""
        # one engine built at a time: jobs on a user's own envhost run beside the batch
        # (_detach), and two vLLM engines started at once in one process crash it
        async with self.engine_lock:
            return await self._engine_for_model(model, engine, sampler_dtype, learner_dtype, role)

    async def _engine_for_model(self, model: str, engine: str, sampler_dtype: str,
                                learner_dtype: str, role: str = "") -> EngineSlot:
        model_dir = await asyncio.to_thread(resolve_model, model, self.settings.home)
        kind = pick_engine(engine, self.settings.engine, model_dir)
        chosen_for_us = engine == "auto" and self.settings.engine == "auto"
        dtype = resolve_sampler_dtype(sampler_dtype, self.device, learner_dtype)
        key = (model_dir, kind, dtype, role)
        if key in self.engines:
            self.engines[key].last_used = time.monotonic()
            return self.engines[key]
        self._evict(self.settings.rollout_slots - 1)
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engine-{kind}")
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        try:
            try:
                engine = await loop.run_in_executor(executor, self._make_engine, kind, model_dir, dtype)
            except ImportError as e:
                if not (chosen_for_us and kind == "vllm"):
                    raise
                log.warning("vLLM does not import (%s); using the transformers engine", e)
                kind, key = "hf", (model_dir, "hf", dtype, role)
                if key in self.engines:
                    executor.shutdown(wait=False)
                    return self.engines[key]
                engine = await loop.run_in_executor(executor, self._make_engine, kind, model_dir, dtype)
        except BaseException:
            executor.shutdown(wait=False)
            raise
        self.engines[key] = EngineSlot(engine, model_dir, executor)
        log.info("%s engine for %s ready in %.1f s (device %s, %s)", kind, model_dir,
                 time.perf_counter() - t0, self.device, dtype)
        return self.engines[key]

    def _evict(self, keep: int) -> None:
        """Drop least recently used idle engines until at most `keep` remain: a worker
        holds at most `rollout_slots` jobs, so it never needs more engines than that,
        and a model no placed job uses must not hold memory forever."""
        idle = sorted((k for k, slot in self.engines.items() if not slot.lock.locked() and not slot.in_use),
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

    def _make_engine(self, kind: str, model_dir: str, dtype: str) -> Any:
        if kind == "vllm":
            from opentinker.services.rollout.engine_vllm import VLLMEngine

            return VLLMEngine(model_dir, device=self.device, dtype=dtype, seed=self.seed,
                              max_model_len=MAX_MODEL_LEN,
                              max_loras=self.settings.rollout_slots if self.multi_lora() else 0,
                              max_lora_rank=self.settings.lora_max_rank)
        from opentinker.services.rollout.engine_hf import HFEngine

        return HFEngine(model_dir, device=self.device, dtype=dtype, seed=self.seed,
                        max_model_len=MAX_MODEL_LEN, decode=self.settings.hf_decode)

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
            self.learner_dtype.pop(req.job_id, None)
            self.env_owner.pop(req.job_id, None)
            return "skip", f"job {req.job_id} is {rec.state.value}"
        if req.attempt != rec.attempt:
            return "skip", f"attempt {req.attempt} is past (the job is at attempt {rec.attempt})"
        if rec.placement is None or self.worker not in rec.placement.rollout:
            return "refuse", f"`job_id`: job {req.job_id} is not placed on worker {self.worker}"
        if req.model != rec.spec.model:
            return "refuse", f"`model`: {req.model!r} is not job {req.job_id}'s model {rec.spec.model!r}"
        if req.engine != rec.spec.engine:
            return "refuse", f"`engine`: {req.engine!r} is not job {req.job_id}'s engine {rec.spec.engine!r}"
        if req.sampler_dtype != rec.spec.sampler_dtype:
            return "refuse", (f"`sampler_dtype`: {req.sampler_dtype!r} is not job {req.job_id}'s "
                              f"sampler_dtype {rec.spec.sampler_dtype!r}")
        # the weights a teacher reads: only those the scheduler checked for the job's owner
        for field in ("teacher", "teacher_job", "teacher_model"):
            if getattr(req, field) != getattr(rec.spec, field):
                return "refuse", (f"`{field}`: {getattr(req, field)[:200]!r} is not job {req.job_id}'s "
                                  f"{field} {getattr(rec.spec, field)[:200]!r}")
        self.learner_dtype[req.job_id] = rec.spec.dtype
        self.env_owner[req.job_id] = rec.env_owner
        return "serve", ""

    async def handle(self, msgs: list[Msg]) -> None:
        """Serve one fetched batch: check each request, then run the groups of each
        (model, job) together. Every message ends acked, naked or dead-lettered."""
        pending: dict[int, Msg] = {}
        seen: set[tuple[str, str]] = set()
        parts: dict[tuple[str, str, str, str, int], list[tuple[RolloutRequest, Msg]]] = {}
        samples: dict[tuple, tuple[JobRecord, list[tuple[TinkerSample, Msg]]]] = {}
        for m in msgs:
            if is_sample(m):  # a Tinker API sampling session's call (sampling.py)
                admitted = await admit_sample(self, m)
                if admitted is not None:
                    sample, rec = admitted
                    samples.setdefault(batch_key(sample), (rec, []))[1].append((sample, m))
                continue
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
            # an evaluation's episodes are sampled by exactly the version they report:
            # they run apart from the job's training groups, which take its newest policy
            pinned = req.policy_version if req.purpose == "eval" else -1
            parts.setdefault((req.model, req.engine, req.job_id, req.policy_run, pinned), []).append((req, m))
        for rec, items in samples.values():  # one engine call per sampling session and weights
            await serve_samples(self, rec, items)
        for key in [k for k in parts if k[4] >= 0]:
            # an evaluation's part takes the job's training groups along when they ask
            # for no newer policy than the evaluated one: one engine batch, every
            # episode sampled by the pinned version
            train = key[:4] + (-1,)
            if train in parts and all(r.policy_version <= key[4] for r, _ in parts[train]):
                parts[key] += parts.pop(train)
        for key in [k for k in parts if self.env_owner.get(k[2], "")]:
            # a job on a user's own envhost runs beside this batch, not in it: its env
            # may stall up to env_step_timeout_s a turn, and must not hold up the
            # worker's other jobs
            items = parts.pop(key)
            self._detach(items, {id(m): pending.pop(id(m)) for _, m in items})
        if not parts:
            return
        beat = asyncio.create_task(self._heartbeat(pending))
        try:
            for items in parts.values():
                await self._run_part(items, pending)
        finally:
            beat.cancel()
            await self._give_back(pending)

    @staticmethod
    async def _give_back(pending: dict[int, Msg]) -> None:
        """Nak what was not finished (cancelled on shutdown, failed): another worker, or
        this one, takes it again now rather than after ack_wait."""
        for m in pending.values():
            with contextlib.suppress(nats.errors.Error):
                await m.nak(delay=1.0)

    def _detach(self, items: list[tuple[RolloutRequest, Msg]], pending: dict[int, Msg]) -> None:
        """Run one job's part in a task of its own, with its own in-progress heartbeat;
        what it leaves unfinished is naked, as `handle` does."""

        async def run() -> None:
            beat = asyncio.create_task(self._heartbeat(pending))
            try:
                await self._run_part(items, pending)
            except TRANSIENT as e:
                log.warning("job %s: serving failed on NATS (%r); its requests go back to the queue",
                            items[0][0].job_id, e)
            except Exception:  # as a batch's failure would: logged, and its requests back to the queue
                log.exception("job %s: serving its requests failed", items[0][0].job_id)
            finally:
                beat.cancel()
                await self._give_back(pending)

        task = asyncio.create_task(run())
        self.detached.add(task)
        task.add_done_callback(self.detached.discard)

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
            slot = await self.engine_for(reqs[0], self.learner_dtype.get(job_id, "float32"))
        except (OSError, ValueError, RuntimeError, ImportError) as e:
            for _, m in items:
                pending.pop(id(m), None)
                await self._reject(m, f"`model`/`engine`: cannot load {reqs[0].model!r}: {e}")
            return
        at_least = max(r.policy_version for r in reqs)

        run = reqs[0].policy_run
        pinned = next((r.policy_version for r in reqs if r.purpose == "eval"), None)

        async def policy_version(of: str = "", base: bool = False) -> int:
            if of:  # an opponent's seats or a teacher job: its newest policy (the scheduler checked it is the user's)
                return await self.policies.ensure_weights(slot, of, await self.policies.newest_event(of, 0))
            if base:  # a distillation teacher: the model's own weights
                return await self.policies.ensure_weights(slot, job_id, None)
            if pinned is not None:  # the part holds one version's evaluation (handle)
                return await self.policies.ensure_version(slot, job_id, pinned, run)
            return await self.policies.ensure_policy(slot, job_id, at_least, run)

        async def publish(req: RolloutRequest, trajs: list[Trajectory]) -> None:
            m = msg_of[req.request_id]
            tp = (m.headers or {}).get(S.H_TRACEPARENT)
            for t in trajs:
                if t.policy_version > 0 and not t.policy_of:
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

        async def score_by_model(model: str, seqs: list[list[int]], **vision: Any) -> list[list[float]]:
            # teacher = "model": another model's engine, on its own weights, scores the sequences
            # (an engine of its own, never a student's: its lock is held only around this
            # call, always after the student's, so two jobs teaching each other's models
            # cannot wait on each other)
            try:
                teacher = await self.engine_for_model(model, reqs[0].engine, reqs[0].sampler_dtype,
                                                      self.learner_dtype.get(job_id, "float32"), role="teacher")
            except (OSError, ValueError, RuntimeError, ImportError) as e:
                raise ValueError(f"{TEACHER_MISMATCH}cannot load {model[:200]!r}: {e}") from e
            if (slot.model_dir, teacher.model_dir) not in self.same_vocab:
                check_teacher_vocab(slot.engine.tokenizer, teacher.engine.tokenizer, model)
                self.same_vocab.add((slot.model_dir, teacher.model_dir))
            teacher.in_use += 1
            try:
                async with teacher.lock:
                    await self.policies.ensure_weights(teacher, f"teacher:{job_id}", None)
                    return await asyncio.get_running_loop().run_in_executor(
                        teacher.executor, functools.partial(teacher.engine.prompt_logprobs, **vision), seqs)
            finally:
                teacher.in_use -= 1

        owner = self.env_owner.get(job_id, "")
        loop = AgentLoop(slot.engine, self.env.for_owner(owner), worker=self.worker, executor=slot.executor,
                         score_by_model=score_by_model)
        t0 = time.perf_counter()
        slot.in_use += 1
        try:
            # a user's own envhost is untrusted: while the run waits on it, the engine
            # other jobs share is not held (locked per generation round instead)
            async with contextlib.nullcontext() if owner else slot.lock:
                await loop.run(reqs, policy_version, publish,
                               parents={r.request_id: tracing.extract(m.headers) for r, m in items},
                               engine_lock=slot.lock if owner else None)
        except WeightsError as e:
            for _, m in items:
                if pending.pop(id(m), None) is not None:
                    await self._reject(m, f"weights of job {job_id} cannot be applied: {e}")
            return
        except WeightsUnavailable as e:
            log.warning("%s; the requests go back to the queue", e)
            return
        finally:
            slot.in_use -= 1
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
    sub = await bus.durable(S.rollout_durable(worker.worker), ack_wait_s=ACK_WAIT_S, recreate=True)
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
