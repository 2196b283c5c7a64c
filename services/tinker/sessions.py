"""What the Tinker API does behind its routes: sessions (KV `ot_tinker`), their models
(tinker jobs submitted to the scheduler as the calling user), operations published to
the model's learner in the SDK's `seq_id` order, and futures read back from the
learner's results.

Every model id, request id and save path a caller names is checked against the
caller: it must belong to a session of theirs (the job record's user), else it is
answered as if it did not exist (404).

What one user may hold (Settings; each refusal is a 429 naming the setting, which the
SDK retries with backoff):
- A session is finished as if its client had closed it (its models' learners export
  their policy and complete, its sampling job ends, its records go) when its heartbeats
  stop for `tinker_heartbeat_timeout_s` (a script that exits without closing it), after
  `tinker_session_idle_s` without an operation or sample, and `tinker_session_max_s`
  after it began. A tinker job that belongs to no open session
  (one submitted over the REST API, or whose session finished) is closed the same way.
- `tinker_inflight_per_user` / `tinker_inflight_bytes_per_user`: the operations and
  samples sent whose futures are not yet retrieved. A retrieved future's messages are
  purged from OT_TINKER RETRIEVED_KEPT_S later, a finished session's likewise, so the
  stream holds what is in flight: one user's burst neither evicts nor refuses another's
  messages while the stream's max_bytes exceeds the users at their cap times the cap.
- `tinker_polls_per_user`: futures long-polled at once. A poll waits on a subscription
  to the result's subject (the result arrives by push), looking at the job's record
  every RECORD_EVERY_S for a job that ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections import Counter
from typing import Any

import msgspec
import nats.errors
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError

from opentinker.schemas import (CancelJob, CancelReply, JobRecord, JobSpec, SubmitJob, SubmitReply, WeightsPublished,
                                decode, encode)
from opentinker.schemas import subjects as S
from opentinker.schemas.tinker import (TinkerOp, TinkerResult, TinkerSample, TinkerSampler, TinkerSamples,
                                       TinkerSession, sampler_object)
from opentinker.services.core.bus import Bus
from opentinker.services.core.config import Settings
from opentinker.services.core.models import DEFAULT_MODEL, resolve_model
from opentinker.services.core.users import Users
from opentinker.services.tinker import provenance, records, wire

log = logging.getLogger("opentinker.tinker")

POLL_S = 25.0             # a retrieve_future waits this long before "try again" (SDK timeout 45 s)
RECORD_EVERY_S = 2.0      # a waiting retrieve_future looks at its job's record this often
ACTIVE_EVERY_S = 30.0     # a session's `active_s` is written at most this often
RETRIEVED_KEPT_S = 60.0   # a retrieved future's messages stay this long (a client's retry finds them)
MAX_MODELS_PER_SESSION = 64
# Tinker's train_attn / train_mlp choose these; train_unembed is not served (the small
# models here tie the unembedding to the embedding, which a merged adapter would change)
LORA_MODULES = {"attn": ["q_proj", "k_proj", "v_proj", "o_proj"], "mlp": ["gate_proj", "up_proj", "down_proj"],
                "unembed": []}
PLACEMENT_WAIT_S = 30.0
TINKER_LORA_ALPHA = 32


class ApiError(Exception):
    """A request refused with HTTP `status` and a JSON `{"detail": ...}` body."""

    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status = status
        self.detail = detail


class Gateway:
    """The Tinker API's state and calls over one bus connection (module docstring)."""

    def __init__(self, bus: Bus, home: str, chunk_bytes: int = S.TINKER_CHUNK_BYTES, admin_key: str = "",
                 settings: Settings | None = None):
        self.bus = bus
        self.home = home
        self.admin_key = admin_key
        self.users = Users(bus)
        self.chunk_bytes = chunk_bytes
        self.limits = settings or Settings()
        self._owners: dict[str, str] = {}  # job id -> user (a record's user never changes)
        self._inflight: dict[str, dict[str, int]] = {}  # user -> {request id: bytes} not yet retrieved
        self._polls: Counter[str] = Counter()  # user -> long-polls (and placement waits) open now
        self._active: dict[str, float] = {}  # session id -> the `active_s` last written
        self._purges: list[tuple[float, str]] = []  # (when, OT_TINKER subject filter) to purge
        self._closed: set[str] = set()  # tinker jobs the reaper sent a close (once per process)
        self.records = records.Records(bus, self.limits)

    # -- what one user holds (module docstring) --------------------------------------

    def _admit(self, user: str, rid: str, size: int) -> None:
        """Count request `rid` (`size` bytes on the bus) as in flight for `user` until
        its future is retrieved. Raises ApiError 429 over the user's limits."""
        mine = self._inflight.setdefault(user, {})
        if rid in mine:
            return  # a resent request (the bus dedups it)
        lim = self.limits
        if len(mine) >= lim.tinker_inflight_per_user:
            raise ApiError(429, f"{len(mine)} operations and samples of yours are in flight, their futures not "
                                f"retrieved (tinker_inflight_per_user = {lim.tinker_inflight_per_user}); "
                                "retrieve their results first")
        used = sum(mine.values())
        if used + size > lim.tinker_inflight_bytes_per_user:
            raise ApiError(429, f"{used + size} bytes of operations and samples of yours would be in flight "
                                f"(tinker_inflight_bytes_per_user = {lim.tinker_inflight_bytes_per_user}); "
                                "retrieve their results first")
        mine[rid] = size

    def _retrieved(self, user: str, rid: str, job_id: str, seq: int) -> None:
        self._inflight.get(user, {}).pop(rid, None)
        if seq == 0:
            return  # a model's readiness: kept while the job lives
        when = time.time() + RETRIEVED_KEPT_S
        self._purges += [(when, S.tinker_result(job_id, seq))]
        if not wire.SAMPLER_RE.match(job_id):
            self._purges += [(when, S.tinker_op(job_id, seq))]

    async def purge_due(self, now: float | None = None) -> int:
        """Purge the OT_TINKER messages whose time has come; returns how many subjects."""
        now = time.time() if now is None else now
        due = [subj for t, subj in self._purges if t <= now]
        self._purges = [(t, subj) for t, subj in self._purges if t > now]
        for subj in due:
            await self.bus.purge_subject(S.STREAM_TINKER, subj)
        return len(due)

    @contextlib.asynccontextmanager
    async def _poll_slot(self, user: str, what: str):
        """One of `user`'s tinker_polls_per_user long waits; ApiError 429 when all are taken."""
        cap = self.limits.tinker_polls_per_user
        if self._polls[user] >= cap:
            raise ApiError(429, f"{what}: {self._polls[user]} requests of yours are waiting at once "
                                f"(tinker_polls_per_user = {cap}); wait for one to return")
        self._polls[user] += 1
        try:
            yield
        finally:
            self._polls[user] -= 1
            if not self._polls[user]:
                del self._polls[user]

    async def _touch(self, user: str, session_id: str) -> None:
        """Note the session's activity (its `active_s`), at most every ACTIVE_EVERY_S."""
        now = time.time()
        if now - self._active.get(session_id, 0.0) < ACTIVE_EVERY_S:
            return
        self._active[session_id] = now
        with contextlib.suppress(KeyWrongLastSequenceError, ApiError):
            s, rev = await self._session(user, session_id)
            await self._put(msgspec.structs.replace(s, active_s=now), rev)

    # -- sessions --------------------------------------------------------------

    async def _session(self, user: str, session_id: str) -> tuple[TinkerSession, int]:
        if not wire.SESSION_RE.match(session_id or ""):
            raise ApiError(404, f"no session {session_id!r}")
        kv = await self.bus.kv(S.KV_TINKER)
        try:
            entry = await kv.get(session_id)
        except KeyNotFoundError:
            raise ApiError(404, f"no session {session_id!r}") from None
        s = decode(entry.value, TinkerSession)
        if s.user != user:
            raise ApiError(404, f"no session {session_id!r}")
        return s, entry.revision

    async def _put(self, s: TinkerSession, revision: int | None) -> None:
        kv = await self.bus.kv(S.KV_TINKER)
        if revision is None:
            await kv.create(s.session_id, encode(s))
        else:
            await kv.update(s.session_id, encode(s), last=revision)

    async def create_session(self, user: str, user_metadata: dict[str, str] | None = None, display_name="") -> str:
        """A new session of `user`, with its (checked: wire.check_metadata) user_metadata."""
        now = time.time()
        s = TinkerSession(session_id=wire.new_session_id(), user=user, created_s=now, heartbeat_s=now,
                          user_metadata=user_metadata or {}, display_name=display_name)
        await self._put(s, None)
        log.info("session %s of %r", s.session_id, user)
        return s.session_id

    async def heartbeat(self, user: str, session_id: str) -> None:
        """Raises ApiError 410 for a finished session (the SDK stops beating)."""
        s, rev = await self._session(user, session_id)
        if s.finished_s:
            raise ApiError(410, f"session {session_id} has finished")
        try:
            await self._put(msgspec.structs.replace(s, heartbeat_s=time.time()), rev)
        except KeyWrongLastSequenceError:
            pass  # another write to it landed first: it is alive all the same

    async def finish(self, user: str, session_id: str, api_key: str) -> None:
        s, rev = await self._session(user, session_id)
        await self._finish(s, rev, api_key)

    async def _finish(self, s: TinkerSession, rev: int, api_key: str) -> None:
        """Close the session's models (their learners export and complete) and cancel
        its sampling sessions' inference jobs, as the user (`api_key`; the reaper has
        none and uses the operator's admin key when the service was given one)."""
        if not s.finished_s:
            await self._put(msgspec.structs.replace(s, finished_s=time.time()), rev)
        mine = self._inflight.get(s.user, {})
        for rid in [r for r in mine if wire.session_of_job(r) == s.session_id]:
            del mine[rid]
        await self.records.drop_session(s.session_id)
        self._active.pop(s.session_id, None)
        later = time.time() + RETRIEVED_KEPT_S
        # its results (a learner purges its job's ops as it ends: a close must stay until read)
        self._purges += [(later, S.tinker_results(wire.model_job(s.session_id, n))) for n in range(s.models)]
        self._purges += [(later, S.tinker_results(wire.sampler_job(s.session_id, n))) for n in range(s.samplers)]
        for n in range(s.models):
            job_id = wire.model_job(s.session_id, n)
            await self.bus.publish(S.tinker_close(job_id), TinkerOp(job_id=job_id, seq_id=0, op="close"),
                                   msg_id=f"{job_id}:close")
        key = api_key or self.admin_key
        if s.samplers and not key:
            log.warning("session %s: no key to cancel its sampling job with (give the service "
                        "OPENTINKER_ADMIN_KEY_FILE); it runs until cancelled", s.session_id)
        elif s.samplers:
            with contextlib.suppress(nats.errors.NoRespondersError, nats.errors.TimeoutError):
                await self.bus.request(S.CANCEL, CancelJob(job_id=wire.sampling_job(s.session_id),
                                                           reason="tinker session finished", api_key=key),
                                       CancelReply, timeout_s=10)
        log.info("session %s finished (%d models, %d sampling sessions)", s.session_id, s.models, s.samplers)

    async def reap(self, now: float | None = None) -> list[str]:
        """Finish the sessions with no heartbeat for tinker_heartbeat_timeout_s, none of whose
        operations or samples came for `tinker_session_idle_s`, or begun over
        `tinker_session_max_s` ago; close the tinker jobs of no open session. Returns
        the ids of the sessions and jobs ended."""
        now = time.time() if now is None else now
        lim = self.limits
        out = []
        # the tinker jobs first: a job's session was made before it, so the sessions read
        # next hold the session of every job read here
        tinker_jobs = []
        for value, _ in (await self.bus.kv_values(S.KV_JOBS)).values():
            try:
                rec = decode(value, JobRecord)
            except msgspec.MsgspecError:
                continue
            if rec.kind == "train" and rec.spec.algorithm == "tinker" and not rec.state.terminal:
                tinker_jobs.append(rec)
        open_sessions: set[str] = set()
        for key, (value, rev) in (await self.bus.kv_values(S.KV_TINKER)).items():
            if not wire.SESSION_RE.match(key):
                continue  # a sampling session's record
            try:
                s = decode(value, TinkerSession)
            except msgspec.MsgspecError:
                log.warning("ignoring an unreadable session %r", key)
                continue
            if s.finished_s:
                continue
            why = ("no heartbeat for %.0f s" % (now - s.heartbeat_s)
                   if now - s.heartbeat_s > lim.tinker_heartbeat_timeout_s else
                   "idle for %.0f s (tinker_session_idle_s)" % (now - max(s.active_s, s.created_s))
                   if now - max(s.active_s, s.created_s) > lim.tinker_session_idle_s else
                   "open for %.0f s (tinker_session_max_s)" % (now - s.created_s)
                   if now - s.created_s > lim.tinker_session_max_s else "")
            if not why:
                open_sessions.add(s.session_id)
                continue
            try:
                await self._finish(s, rev, "")
            except KeyWrongLastSequenceError:
                open_sessions.add(s.session_id)
                continue  # it beat meanwhile
            log.info("session %s of %r finished: %s", s.session_id, s.user, why)
            out.append(s.session_id)
        for rec in tinker_jobs:
            m = wire.JOB_RE.match(rec.job_id)
            if (m and m.group(1) in open_sessions) or rec.job_id in self._closed:
                continue
            await self.bus.publish(S.tinker_close(rec.job_id), TinkerOp(job_id=rec.job_id, seq_id=0, op="close"),
                                   msg_id=f"{rec.job_id}:close")
            self._closed.add(rec.job_id)
            if not (m and m.group(1) in out):
                log.info("tinker job %s of %r belongs to no open session: closed", rec.job_id, rec.user)
                out.append(rec.job_id)
        await self.purge_due(now)
        return out

    # -- models -----------------------------------------------------------------

    async def create_model(self, user: str, api_key: str, session_id: str, n: int, base_model: str,
                           rank: int, seed: int | None, attn: bool, mlp: bool, unembed: bool) -> str:
        """Submit model `n` of the session as a tinker job of `user` (the scheduler checks
        the key and the user's quota). Returns the job id."""
        s, _ = await self._session(user, session_id)
        if s.finished_s:
            raise ApiError(410, f"session {session_id} has finished")
        if not 0 <= n < MAX_MODELS_PER_SESSION:
            raise ApiError(400, f"model_seq_id: {n} (0 to {MAX_MODELS_PER_SESSION - 1})")
        modules = [m for key, on in (("attn", attn), ("mlp", mlp), ("unembed", unembed)) if on
                   for m in LORA_MODULES[key]]
        if not modules:
            raise ApiError(400, "lora_config: train at least one of attn, mlp, unembed")
        job_id = wire.model_job(session_id, n)
        try:
            spec = JobSpec(name=f"tinker-{session_id}", algorithm="tinker", model=base_model, lora_rank=rank,
                           lora_alpha=TINKER_LORA_ALPHA, lora_target_modules=modules,
                           seed=seed if seed is not None else 0)
        except (msgspec.ValidationError, TypeError, ValueError) as e:
            raise ApiError(400, f"create_model: {e}") from None
        await self._submit_job(user, api_key, job_id, spec, "train", "create_model")
        await self._count(user, session_id, models=n + 1)
        return job_id

    async def _submit_job(self, user: str, api_key: str, job_id: str, spec: JobSpec, kind: str, what: str) -> None:
        """Submit `job_id` as the user to this service's pool (its scheduler checks the key and
        quota); a job of that id and kind the user already has counts as submitted (a retry)."""
        try:
            cmd = SubmitJob(spec=spec, job_id=job_id, kind=kind, api_key=api_key)
            reply = await self.bus.request(S.submit_subject(self.limits.pool), cmd, SubmitReply, timeout_s=30)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            raise ApiError(503, f"no scheduler of pool {self.limits.pool!r} answers") from None
        if not reply.ok:
            got = await self.bus.job_record(job_id) if reply.field == "job_id" else None
            if got is None or got[0].user != user or got[0].kind != kind or got[0].spec.algorithm != spec.algorithm:
                raise ApiError(400, f"{what}: {reply.field}: {reply.error}" if reply.field else reply.error)
        self._owners[job_id] = user

    async def _count(self, user: str, session_id: str, **at_least: int) -> None:
        """Raise the session's model / sampler counts to at least the given ones."""
        while True:
            s, rev = await self._session(user, session_id)
            changes = {k: max(getattr(s, k), v) for k, v in at_least.items()}
            try:
                await self._put(msgspec.structs.replace(s, **changes), rev)
                return
            except KeyWrongLastSequenceError:
                continue

    async def create_from_state(self, user: str, api_key: str, session_id: str, n: int, path: str,
                                optimizer: bool) -> str:
        """Model `n` of the session, started from the save_state at `path` (one of the
        user's): the saving model's base model and LoRA, its weights (and optimizer
        state with `optimizer`). Returns the job id; its readiness is the load's future."""
        s, _ = await self._session(user, session_id)
        if s.finished_s:
            raise ApiError(410, f"session {session_id} has finished")
        if not 0 <= n < MAX_MODELS_PER_SESSION:
            raise ApiError(400, f"model_seq_id: {n} (0 to {MAX_MODELS_PER_SESSION - 1})")
        try:
            mid, kind, name = wire.parse_save_path(path)
        except wire.WireError as e:
            raise ApiError(400, str(e)) from None
        if kind != "weights":
            raise ApiError(400, f"path: {path!r} holds sampler weights; "
                                "a training client starts from a save_state path")
        src = await self.own_model(user, mid)
        base = (await self.bus.job_record(src))[0].spec
        job_id = wire.model_job(session_id, n)
        spec = JobSpec(name=f"tinker-{session_id}", algorithm="tinker", model=base.model, lora_rank=base.lora_rank,
                       lora_alpha=base.lora_alpha, lora_target_modules=list(base.lora_target_modules),
                       seed=base.seed, tinker_init=f"{src}/{name}", tinker_init_optimizer=optimizer)
        await self._submit_job(user, api_key, job_id, spec, "train", "create_training_client_from_state")
        await self._count(user, session_id, models=n + 1)
        return job_id

    async def own_model(self, user: str, mid: str) -> str:
        """The job id of model `mid` if it is `user`'s; ApiError 404 otherwise."""
        try:
            job_id = wire.job_of_model(mid)
        except wire.WireError as e:
            raise ApiError(404, str(e)) from None
        await self._own_job(user, job_id, f"no model {mid!r}")
        return job_id

    async def _own_job(self, user: str, job_id: str, missing: str) -> None:
        owner = self._owners.get(job_id)
        if owner is None:
            got = await self.bus.job_record(job_id)
            if got is None:
                raise ApiError(404, missing)
            owner = self._owners[job_id] = got[0].user
        if owner != user:
            raise ApiError(404, missing)

    async def info(self, user: str, mid: str) -> dict[str, Any]:
        """get_info: the base model and where its tokenizer is (a local folder when the
        model is on this host, so the SDK's get_tokenizer needs no hub)."""
        job_id = await self.own_model(user, mid)
        rec, _ = await self.bus.job_record(job_id)
        spec = rec.spec
        tokenizer = spec.model
        if spec.model == DEFAULT_MODEL or spec.model.startswith("/"):
            tokenizer = await asyncio.to_thread(resolve_model, spec.model, self.home)
        return {"model_id": mid, "model_name": spec.model, "is_lora": True, "lora_rank": spec.lora_rank,
                "model_data": {"model_name": spec.model, "tokenizer_id": tokenizer, "arch": ""}}

    # -- sampling sessions ----------------------------------------------------------

    async def create_sampler(self, user: str, api_key: str, session_id: str, n: int, base_model: str | None,
                             model_path: str | None) -> str:
        """Sampling session `n` of the session: the base model, with the sampler weights
        at `model_path` (a save_weights_for_sampler path of the user's) when given.
        Every sampling session of a Tinker session is served by one inference job of the
        user, `<session>-sampling`, submitted with the first. Returns its id."""
        s, _ = await self._session(user, session_id)
        if s.finished_s:
            raise ApiError(410, f"session {session_id} has finished")
        if not 0 <= n < 1_000_000:
            raise ApiError(400, f"sampling_session_seq_id: {n}")
        weights = None
        if model_path:
            try:
                mid, kind, name = wire.parse_save_path(model_path)
            except wire.WireError as e:
                raise ApiError(400, str(e)) from None
            if kind != "sampler_weights":
                raise ApiError(400, f"model_path: {model_path!r} is a training state; sample from a "
                                    "save_weights_for_sampler path")
            src = await self.own_model(user, mid)
            src_spec = (await self.bus.job_record(src))[0].spec
            weights = await self._sampler_event(src, src_spec, name)
            base_model = src_spec.model
        if not base_model:
            raise ApiError(400, "create_sampling_session: base_model or model_path is required")
        job_id = wire.sampling_job(session_id)
        got = await self.bus.job_record(job_id)
        if got is None:
            spec = JobSpec(name=f"tinker-{session_id}", model=base_model, rollout_workers=1)
            await self._submit_job(user, api_key, job_id, spec, "inference", "create_sampling_session")
        elif got[0].spec.model != base_model:
            raise ApiError(400, f"base_model: this session samples {got[0].spec.model!r}; one base model per "
                                "session's sampling clients (open another ServiceClient for another)")
        sid = wire.sampler_job(session_id, n)
        rec = TinkerSampler(sampler_id=sid, session_id=session_id, user=user, base_model=base_model,
                            model_path=model_path or "", weights=weights, created_s=time.time())
        await (await self.bus.kv(S.KV_TINKER)).put(sid, encode(rec))
        await self._count(user, session_id, samplers=n + 1)
        return sid

    async def _sampler_event(self, src_job: str, spec: JobSpec, name: str) -> WeightsPublished:
        """A weight event for the adapter tinker job `src_job` (spec `spec`) saved as `name`."""
        obj = sampler_object(src_job, name)
        try:
            data = await self.bus.get_object(S.OBJ_WEIGHTS, obj)
        except NotFoundError:
            raise ApiError(404, f"model_path: no sampler weights {name!r} of {wire.model_of_job(src_job)}") from None
        return WeightsPublished(job_id=src_job, policy_version=1, kind="lora", uri=f"nats-os://{S.OBJ_WEIGHTS}/{obj}",
                                sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data),
                                lora_rank=spec.lora_rank, lora_alpha=spec.lora_alpha,
                                target_modules=list(spec.lora_target_modules), time_s=time.time())

    async def _sampler(self, user: str, sid: str) -> TinkerSampler:
        """The user's sampling session `sid`; ApiError 404 for another's or none."""
        try:
            wire.check_sampler(sid)
            entry = await (await self.bus.kv(S.KV_TINKER)).get(sid)
            rec = decode(entry.value, TinkerSampler)
        except (wire.WireError, KeyNotFoundError, msgspec.MsgspecError):
            raise ApiError(404, f"no sampling session {sid!r}") from None
        if rec.user != user:
            raise ApiError(404, f"no sampling session {sid!r}")
        return rec

    async def sampler_info(self, user: str, sid: str) -> dict[str, Any]:
        rec = await self._sampler(user, sid)
        return {"sampler_id": sid, "base_model": rec.base_model, "model_path": rec.model_path or None}

    async def sample(self, user: str, req: TinkerSample, record: bool = False) -> tuple[str, list[str]]:
        """Send `req` (for sampling session `req.sampler`) to the rollout worker of the
        session's inference job, waiting up to PLACEMENT_WAIT_S for its placement (one of
        the user's tinker_polls_per_user waits); recorded with `record` (records.py).
        Returns the future's request id and its sequences' ids. Raises ApiError: 404 for
        another's sampling session, 410 for an ended sampling job, 429 while it is still
        queued (the SDK retries) or over the user's in-flight limits."""
        rec = await self._sampler(user, req.sampler)
        job_id = wire.sampling_job(rec.session_id)
        deadline = time.monotonic() + PLACEMENT_WAIT_S
        async with self._poll_slot(user, "sample"):
            while True:
                job, _ = await self.bus.job_record(job_id)
                if job.state.terminal:
                    raise ApiError(410, f"the session's sampling job {job_id} is {job.state.value}")
                if job.placement is not None and job.placement.rollout:
                    break
                if time.monotonic() > deadline:
                    raise ApiError(429, f"the session's sampling job {job_id} is still queued: no rollout worker is "
                                        "free for it, or your quota (jobs placed at once) holds it")
                await asyncio.sleep(0.5)
        req = msgspec.structs.replace(req, job_id=job_id, attempt=job.attempt, weights=rec.weights)
        rid = wire.request_id(req.sampler, req.seq_id)
        self._admit(user, rid, len(encode(req)))
        await self._touch(user, rec.session_id)
        if record:
            req = msgspec.structs.replace(req, record_key=await self.records.start(rid, rec, req.tokens))
        ids = provenance.sequence_ids(req.record_key or rid, req.num_samples)
        await self.bus.publish(S.rollout(job_id, job.placement.rollout[0]), req,
                               msg_id=f"{req.sampler}:sample{req.seq_id}")
        return rid, ids

    # -- operations and futures ---------------------------------------------------

    async def submit(self, user: str, op: TinkerOp) -> str:
        """Publish `op` of `user`'s model for its learner (once per seq_id: a resent
        submit is a duplicate JetStream drops). Returns the future's request id. Raises
        ApiError 400 for a seq_id below 1, 429 over the user's in-flight limits."""
        if op.seq_id < 1:
            raise ApiError(400, f"seq_id: {op.seq_id} (from 1)")
        rid = wire.request_id(op.job_id, op.seq_id)
        self._admit(user, rid, len(encode(op)))
        await self._touch(user, wire.session_of_job(op.job_id))
        await self.bus.publish(S.tinker_op(op.job_id, op.seq_id), op, msg_id=f"{op.job_id}:op{op.seq_id}")
        return rid

    async def retrieve(self, user: str, rid: str, api_key: str) -> dict[str, Any] | bytes:
        """A future's answer: its result (JSON, or protobuf bytes for forward,
        forward_backward and sample), a failure, or "try again" after POLL_S. A
        save_weights_and_get_sampling_client result opens its sampling session first.
        Raises ApiError 404 for another's future, 429 over tinker_polls_per_user."""
        try:
            job_id, seq = wire.parse_request_id(rid)
        except wire.WireError as e:
            raise ApiError(404, str(e)) from None
        if wire.SAMPLER_RE.match(job_id):
            await self._sampler(user, job_id)
            watched = wire.sampling_job(wire.session_of_job(job_id))
        else:
            await self._own_job(user, job_id, f"no request {rid!r}")
            watched = job_id
        async with self._poll_slot(user, "retrieve_future"):
            answer = await self._wait(user, api_key, rid, job_id, seq, watched)
        if not (isinstance(answer, dict) and answer.get("type") == "try_again"):
            self._retrieved(user, rid, job_id, seq)
        return answer

    async def _wait(self, user: str, api_key: str, rid: str, job_id: str, seq: int,
                    watched: str) -> dict[str, Any] | bytes:
        subject = S.tinker_result(job_id, seq)
        sub = await self.bus.nc.subscribe(subject)  # before the read: a result landing between is not missed
        try:
            raw = await self.bus.last_message(subject)
            if raw is not None:
                return await self._answer(user, api_key, raw.data or b"", job_id)
            deadline = time.monotonic() + POLL_S
            while (left := deadline - time.monotonic()) > 0:
                try:
                    m = await sub.next_msg(timeout=min(RECORD_EVERY_S, left))
                except nats.errors.TimeoutError:
                    got = await self.bus.job_record(watched)  # a job that ended will never answer
                    if got is not None and got[0].state.terminal:
                        raw = await self.bus.last_message(subject)
                        if raw is not None:
                            return await self._answer(user, api_key, raw.data or b"", job_id)
                        rec = got[0]
                        return {"error": f"job {watched} is {rec.state.value}"
                                         + (f": {rec.reason}" if rec.reason else ""), "category": "server"}
                    continue
                return await self._answer(user, api_key, m.data, job_id)
            return {"type": "try_again", "request_id": rid, "queue_state": "active"}
        finally:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    async def _answer(self, user: str, api_key: str, data: bytes, job_id: str) -> dict[str, Any] | bytes:
        try:
            got = decode(data, TinkerSamples if wire.SAMPLER_RE.match(job_id) else TinkerResult)
        except msgspec.MsgspecError as e:  # a service's bug, not the caller's: a failed future, not a 500
            log.error("unreadable result for %s: %s", job_id, e)
            return {"error": f"the result does not decode ({e})", "category": "server"}
        if isinstance(got, TinkerSamples):
            samples = got
            await self.records.finish(samples, wire.session_of_job(job_id))
            if samples.error:
                return {"error": samples.error, "category": samples.category}
            return wire.sample_response(samples)
        r = got
        mid = wire.model_of_job(job_id)
        if r.error:
            return {"error": r.error, "category": r.category}
        if r.op == "save_sampler" and r.sampling_session_seq_id >= 0:
            sid = await self.create_sampler(user, api_key, wire.session_of_job(job_id), r.sampling_session_seq_id,
                                            None, wire.save_path(mid, "sampler_weights", r.path.partition("/")[2]))
            return {"sampling_session_id": sid}
        if r.op == "ready":
            return {"model_id": mid}
        if r.op in ("forward", "forward_backward"):
            return wire.forward_backward_output(r)
        if r.op == "optim_step":
            return {"metrics": r.metrics}
        if r.op == "save_state":
            return {"path": wire.save_path(mid, "weights", r.path.partition("/")[2])}
        if r.op == "save_sampler":
            return {"path": wire.save_path(mid, "sampler_weights", r.path.partition("/")[2])}
        if r.op == "load_state":
            src, _, name = r.path.partition("/")
            return {"path": wire.save_path(wire.model_of_job(src), "weights", name), "model_id": mid}
        return {"error": f"unexpected result of a {r.op!r} op", "category": "server"}
