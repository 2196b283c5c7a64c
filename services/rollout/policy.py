"""The rollout worker's policies: which weights each job's episodes are sampled with,
and putting them in an engine.

A job's policy is the latest WeightsPublished of the learner run a request names
(`policy_run`; "" = the job's latest of any run); with no event yet it is the base
model, policy version 0. PolicyTracker keeps the one table of weight events this worker
knows: every event, whichever way it is read, goes through `_note`, and `_note` wakes
whoever waits for a version.

Reads:
  ot.job.*.weights   stream OT_WEIGHTS, one ordered consumer from each job's last event,
                     then live ones: a restarted worker knows each job's policy without
                     asking. A job's first request also reads every event the stream holds
                     for it (each run's newest, not only the job's last), and a request
                     naming a version not yet noted reads the job's last event once (the
                     consumer may still be catching up, e.g. after a NATS outage); then it
                     waits up to WEIGHTS_WAIT_S for `_note` to see that version, else
                     WeightsUnavailable (the service puts the requests back on the queue).
  ot_weights (object store) or a file: the bytes an event's `uri` names, sha256-checked;
                     LoRA adapters are merged into full weights, or with vLLM multi-LoRA
                     written once per version under <home>/cache/adapters/<job>/.
Writes:
  ot.dlq.rollout     weight events that cannot be decoded or arrive on another job's subject.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
import torch
from nats.aio.msg import Msg
from nats.js import api
from nats.js.errors import NotFoundError

from opentinker.schemas import WeightsPublished, decode
from opentinker.schemas import subjects as S
from opentinker.services.core import tracing
from opentinker.services.core.bus import Bus, undecodable
from opentinker.services.core.runner import torch_threads
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

WEIGHTS_WAIT_S = 60.0        # for a version a request names but this worker has not seen
JOBS_KEPT = 4                # per-job policy tensors kept for fast job switches
RUNS_KEPT = 4                # learner runs per job whose newest weight event is remembered
VERSIONS_KEPT = 64           # per job, the latest events by (run, version), for pinned requests
JOBS_TRACKED = 1024          # jobs whose weight events are remembered (a lookup refills one)

PolicyId = tuple[str, int, str]  # (job id, policy version, sha256 of the weights)
BASE: PolicyId = ("", 0, "")     # the model's own weights, policy version 0 of every job


def single_threaded(fn, *args):
    """fn(*args) with torch on one intra-op thread, then as many as before.

    A weight load is a few hundred small copies and matmuls, each an OpenMP parallel
    region. While the learner trains on the same cores (max_staleness >= 1 on one
    host), each region waits until both of its threads are scheduled: a LoRA load that
    took 0.14 s alone took ~1 s (median of 45 loads during a learner forward/backward,
    bench/e2e_grpo.py async, 2 cores). One thread does the same work without waiting on
    a second. vLLM's CPU worker replaces torch.set_num_threads by a no-op once its
    engine runs in the process (vLLM 0.32 cpu_worker.py, against changing the size of
    its bound thread team for good); torch's own setter is called here, and the team
    goes back to its size before anything else runs on this thread (measured: the same
    threads, affinities and generation speed after)."""
    with torch_threads(1):
        return fn(*args)


class WeightsUnavailable(Exception):
    """A request names a policy version whose weight event has not arrived."""


class EngineSlot:
    """One engine for one model, the thread that runs it, and the policy it holds."""

    def __init__(self, engine: Any, model_dir: str, executor: ThreadPoolExecutor):
        self.engine = engine
        self.model_dir = model_dir
        # every engine call (create, generate, load) from one thread: vLLM's CPU
        # backend binds its OpenMP threads to the thread that created it
        self.executor = executor
        # the engine's own view of its loaded weights where it has one (by the names the
        # learner sends), else the model folder's safetensors
        own = getattr(engine, "base_weights", None)
        self.base = own if own is not None else BaseWeights(model_dir)
        # what a merged LoRA weight is rounded to (None: float32, the engine's load rounds)
        self.merge_dtype = getattr(engine, "merge_dtype", None)
        self.held = HeldWeights(self.base, engine.packed_modules)
        self.holding: PolicyId = BASE
        self.updates: OrderedDict[str, tuple[PolicyId, dict[str, torch.Tensor]]] = OrderedDict()
        # held from loading a job's policy to the end of its generation: jobs sharing
        # the engine (LoRA jobs, inference endpoints) never interleave their weights
        self.lock = asyncio.Lock()
        self.adapters: dict[str, str] = {}  # job -> its adapter folder (vLLM multi-LoRA)
        self.last_used = time.monotonic()
        self.in_use = 0  # runs using the engine now (one that locks it per round may not hold the lock)


class PolicyTracker:
    """The weight events this worker knows, and loading a job's policy into an engine.

    `adapters_dir`: where vLLM multi-LoRA adapters are written (<home>/cache/adapters)."""

    def __init__(self, bus: Bus, adapters_dir: Path):
        self.bus = bus
        self.adapters_dir = adapters_dir
        self.newest: dict[str, tuple[int, WeightsPublished]] = {}  # job -> (stream seq, event)
        # job -> learner run -> (stream seq, that run's latest event)
        self.runs: dict[str, dict[str, tuple[int, WeightsPublished]]] = {}
        # job -> (learner run, policy version) -> (stream seq, event): an evaluation's
        # request is served by exactly the version it names (event_at)
        self.at: dict[str, dict[tuple[str, int], tuple[int, WeightsPublished]]] = {}
        self._looked_up: set[str] = set()
        self._noted = asyncio.Condition()  # notified by every _note
        self._sub = None

    async def start(self) -> None:
        self._sub = await self.bus.js.subscribe(
            S.STREAMS[S.STREAM_WEIGHTS][0][0], stream=S.STREAM_WEIGHTS, cb=self._on_weights,
            ordered_consumer=True, deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT)

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._sub.unsubscribe()

    # -- the event table --

    async def _on_weights(self, m: Msg) -> None:
        # an ordered consumer: nothing to ack; a bad event is dead-lettered and ignored
        try:
            ev = decode(m.data, WeightsPublished)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            await self.bus.dead_letter(m, undecodable(WeightsPublished, e))
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
            self.at.pop(gone, None)
            self._looked_up.discard(gone)
        at = self.at.setdefault(ev.job_id, {})
        key = (ev.run, ev.policy_version)
        if key not in at or seq > at[key][0]:
            at[key] = (seq, ev)
        while len(at) > VERSIONS_KEPT:
            del at[min(at, key=lambda k: at[k][0])]
        runs = self.runs.setdefault(ev.job_id, {})
        mine = runs.get(ev.run)
        if mine is None or seq > mine[0]:
            runs[ev.run] = (seq, ev)
        while len(runs) > RUNS_KEPT:
            del runs[min(runs, key=lambda r: runs[r][0])]
        async with self._noted:
            self._noted.notify_all()

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

    def _version(self, job_id: str, run: str) -> int:
        got = self._newest_of(job_id, run)
        return got.policy_version if got else 0

    async def newest_event(self, job_id: str, at_least: int, run: str = "") -> WeightsPublished | None:
        """The latest weight event of learner run `run` of the job ("": of any run),
        waiting up to WEIGHTS_WAIT_S for one of version `at_least` or newer. None = no
        event yet (version 0, the base model). Raises WeightsUnavailable if no such
        version arrives."""
        if job_id not in self._looked_up:
            self._looked_up.add(job_id)
            await self._all_events(job_id)  # the subscription may not have caught up yet
        elif self._version(job_id, run) < at_least:
            await self._last_event(job_id)
        try:
            async with self._noted:
                await asyncio.wait_for(self._noted.wait_for(lambda: self._version(job_id, run) >= at_least),
                                       WEIGHTS_WAIT_S)
        except TimeoutError:
            raise WeightsUnavailable(f"job {job_id}: policy version {at_least} was requested, "
                                     f"the newest weight event is version {self._version(job_id, run)}") from None
        return self._newest_of(job_id, run)

    def _exact(self, job_id: str, version: int, run: str) -> WeightsPublished | None:
        found = [got for (r, v), got in self.at.get(job_id, {}).items() if v == version and (r == run or not run)]
        return max(found, key=lambda got: got[0])[1] if found else None

    async def event_at(self, job_id: str, version: int, run: str = "") -> WeightsPublished | None:
        """The weight event of exactly policy `version` of learner run `run` ("": the
        latest announcement of that version by any run), for a request pinned to it (an
        evaluation reports the version its episodes were sampled by, never a newer one).
        None: version 0 that the run never announced, i.e. the base model. Raises
        WeightsUnavailable if the run has not reached `version` within WEIGHTS_WAIT_S,
        WeightsError if it went past `version` and that version's event is not on the
        stream (OT_WEIGHTS keeps 1,000 events per job)."""
        await self.newest_event(job_id, version, run)  # every event noted is in the table
        got = self._exact(job_id, version, run)
        if got is None:  # noted before this worker started: the stream has it
            await self._all_events(job_id)
            got = self._exact(job_id, version, run)
        if got is None and version > 0:
            raise WeightsError(f"job {job_id}: policy version {version} of learner run {run!r} was requested, "
                               f"and its weight event is no longer on the stream (the run is at version "
                               f"{self._version(job_id, run)})")
        return got

    # -- loading a policy into an engine --

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
            return merge_lora(slot.base, pairs, lora_scale(ev.lora_alpha, ev.lora_rank, pairs), slot.merge_dtype)
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
        already does; returns that policy version. Raises WeightsUnavailable (see
        newest_event) and WeightsError (weights that cannot be read or applied)."""
        return await self.ensure_weights(slot, job_id, await self.newest_event(job_id, at_least, run))

    async def ensure_version(self, slot: EngineSlot, job_id: str, version: int, run: str = "") -> int:
        """Make `slot`'s engine hold exactly policy `version` of learner run `run` of the
        job (event_at); returns `version`. Raises as event_at and ensure_weights do."""
        return await self.ensure_weights(slot, job_id, await self.event_at(job_id, version, run))

    async def ensure_weights(self, slot: EngineSlot, key: str, ev: WeightsPublished | None) -> int:
        """Make `slot`'s engine hold the weights `ev` names (None: the base model),
        loading them unless it already does; `key` (a job id, or a tinker sampling
        session's id) names them in the engine's caches. Returns ev's policy version.
        Raises WeightsError for weights that cannot be read or applied."""
        job_id = key
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
            new = await loop.run_in_executor(slot.executor, single_threaded, self._tensors, slot, ev, data)
            slot.updates[job_id] = (ident, new)
            slot.updates.move_to_end(job_id)
            while len(slot.updates) > JOBS_KEPT:
                slot.updates.popitem(last=False)
        plan = slot.held.plan(new)
        t1 = time.perf_counter()
        await loop.run_in_executor(slot.executor, single_threaded, slot.engine.load_weights, plan)
        slot.held.commit(new)
        slot.holding = ident
        t2 = time.perf_counter()
        log.info("job %s: policy version %d loaded (%d tensors in %.2f s: fetch and merge %.2f s, engine %.2f s)",
                 job_id, ident[1], len(plan), t2 - t0, t1 - t0, t2 - t1)
        return ident[1]

    async def _use_adapter(self, slot: EngineSlot, job_id: str, ev: WeightsPublished, ident: PolicyId,
                           t0: float) -> int:
        """vLLM multi-LoRA: the engine keeps the base weights and applies the job's
        adapter per request. The adapter is written once per version as a peft folder
        under <adapters_dir>/<job>/; the job's previous one is dropped."""
        loop = asyncio.get_running_loop()
        folder = self.adapters_dir / job_id / ev.sha256[:16]
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
