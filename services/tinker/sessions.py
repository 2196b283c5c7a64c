"""What the Tinker API does behind its routes: sessions (KV `ot_tinker`), their models
(tinker jobs submitted to the scheduler as the calling user), operations published to
the model's learner in the SDK's `seq_id` order, and futures read back from the
learner's results.

Every model id, request id and save path a caller names is checked against the
caller: it must belong to a session of theirs (the job record's user), else it is
answered as if it did not exist (404). A session whose heartbeats stop for
SESSION_TTL_S is finished as if its client had closed it: its models' learners
export their policy and complete.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec
import nats.errors
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from opentinker.schemas import JobSpec, SubmitJob, SubmitReply, decode, encode
from opentinker.schemas import subjects as S
from opentinker.schemas.tinker import TinkerOp, TinkerResult, TinkerSession
from opentinker.services.core.bus import Bus
from opentinker.services.core.models import DEFAULT_MODEL, resolve_model
from opentinker.services.core.users import Users
from opentinker.services.tinker import wire

log = logging.getLogger("opentinker.tinker")

SESSION_TTL_S = 300.0     # no heartbeat this long (the SDK beats every 10 s): finished
POLL_S = 25.0             # a retrieve_future waits this long before "try again" (SDK timeout 45 s)
POLL_EVERY_S = 0.05
MAX_MODELS_PER_SESSION = 64
LORA_MODULES = {"attn": ["q_proj", "k_proj", "v_proj", "o_proj"], "mlp": ["gate_proj", "up_proj", "down_proj"],
                "unembed": ["lm_head"]}
TINKER_LORA_ALPHA = 32


class ApiError(Exception):
    """A request refused with HTTP `status` and a JSON `{"detail": ...}` body."""

    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status = status
        self.detail = detail


class Gateway:
    """The Tinker API's state and calls over one bus connection (module docstring)."""

    def __init__(self, bus: Bus, home: str, chunk_bytes: int = S.TINKER_CHUNK_BYTES):
        self.bus = bus
        self.home = home
        self.users = Users(bus)
        self.chunk_bytes = chunk_bytes
        self._owners: dict[str, str] = {}  # job id -> user (a record's user never changes)

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

    async def create_session(self, user: str) -> str:
        now = time.time()
        s = TinkerSession(session_id=wire.new_session_id(), user=user, created_s=now, heartbeat_s=now)
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

    async def finish(self, user: str, session_id: str) -> None:
        s, rev = await self._session(user, session_id)
        await self._finish(s, rev)

    async def _finish(self, s: TinkerSession, rev: int) -> None:
        if not s.finished_s:
            await self._put(msgspec.structs.replace(s, finished_s=time.time()), rev)
        for n in range(s.models):
            job_id = f"{s.session_id}-m{n}"
            await self.bus.publish(S.tinker_close(job_id), TinkerOp(job_id=job_id, seq_id=0, op="close"),
                                   msg_id=f"{job_id}:close")
        log.info("session %s finished (%d models)", s.session_id, s.models)

    async def reap(self, now: float | None = None) -> list[str]:
        """Finish the sessions with no heartbeat for SESSION_TTL_S; returns their ids."""
        now = time.time() if now is None else now
        out = []
        for key, (value, rev) in (await self.bus.kv_values(S.KV_TINKER)).items():
            try:
                s = decode(value, TinkerSession)
            except msgspec.MsgspecError:
                log.warning("ignoring an unreadable session %r", key)
                continue
            if not s.finished_s and now - s.heartbeat_s > SESSION_TTL_S:
                try:
                    await self._finish(s, rev)
                except KeyWrongLastSequenceError:
                    continue  # it beat meanwhile
                out.append(s.session_id)
        return out

    # -- models -----------------------------------------------------------------

    async def create_model(self, user: str, api_key: str, session_id: str, n: int, base_model: str,
                           rank: int, seed: int | None, attn: bool, mlp: bool, unembed: bool) -> str:
        """Submit model `n` of the session as a tinker job of `user` (the scheduler checks
        the key and the user's quota). Returns the job id."""
        s, rev = await self._session(user, session_id)
        if s.finished_s:
            raise ApiError(410, f"session {session_id} has finished")
        if not 0 <= n < MAX_MODELS_PER_SESSION:
            raise ApiError(400, f"model_seq_id: {n} (0 to {MAX_MODELS_PER_SESSION - 1})")
        modules = [m for key, on in (("attn", attn), ("mlp", mlp), ("unembed", unembed)) if on
                   for m in LORA_MODULES[key]]
        if not modules:
            raise ApiError(400, "lora_config: train at least one of attn, mlp, unembed")
        job_id = f"{session_id}-m{n}"
        try:
            spec = JobSpec(name=f"tinker-{session_id}", algorithm="tinker", model=base_model, lora_rank=rank,
                           lora_alpha=TINKER_LORA_ALPHA, lora_target_modules=modules,
                           seed=seed if seed is not None else 0)
        except (msgspec.ValidationError, TypeError, ValueError) as e:
            raise ApiError(400, f"create_model: {e}") from None
        try:
            reply = await self.bus.request(S.SUBMIT, SubmitJob(spec=spec, job_id=job_id, api_key=api_key),
                                           SubmitReply, timeout_s=30)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            raise ApiError(503, "the scheduler does not answer") from None
        if not reply.ok:
            raise ApiError(400, f"create_model: {reply.field}: {reply.error}" if reply.field else reply.error)
        self._owners[job_id] = user
        while True:
            try:
                await self._put(msgspec.structs.replace(s, models=max(s.models, n + 1)), rev)
                break
            except KeyWrongLastSequenceError:
                s, rev = await self._session(user, session_id)
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

    def known_models(self) -> list[str]:
        return [DEFAULT_MODEL]

    # -- operations and futures ---------------------------------------------------

    async def submit(self, op: TinkerOp) -> str:
        """Publish `op` for its model's learner (once per seq_id: a resent submit is a
        duplicate JetStream drops). Returns the future's request id."""
        if op.seq_id < 1:
            raise ApiError(400, f"seq_id: {op.seq_id} (from 1)")
        await self.bus.publish(S.tinker_op(op.job_id, op.seq_id), op, msg_id=f"{op.job_id}:op{op.seq_id}")
        return wire.request_id(op.job_id, op.seq_id)

    async def retrieve(self, user: str, rid: str) -> dict[str, Any] | bytes:
        """A future's answer: its result (JSON, or protobuf bytes for forward and
        forward_backward), a failure, or "try again" after POLL_S."""
        try:
            job_id, seq = wire.parse_request_id(rid)
        except wire.WireError as e:
            raise ApiError(404, str(e)) from None
        await self._own_job(user, job_id, f"no request {rid!r}")
        deadline = time.monotonic() + POLL_S
        checked = 0.0
        while True:
            raw = await self.bus.last_message(S.tinker_result(job_id, seq))
            if raw is not None:
                return self._answer(decode(raw.data, TinkerResult), job_id)
            if time.monotonic() - checked > 2.0:  # a job that ended will never answer
                checked = time.monotonic()
                got = await self.bus.job_record(job_id)
                if got is not None and got[0].state.terminal:
                    raw = await self.bus.last_message(S.tinker_result(job_id, seq))
                    if raw is not None:
                        return self._answer(decode(raw.data, TinkerResult), job_id)
                    rec = got[0]
                    return {"error": f"the model's job {job_id} is {rec.state.value}"
                                     + (f": {rec.reason}" if rec.reason else ""), "category": "server"}
            if time.monotonic() > deadline:
                return {"type": "try_again", "request_id": rid, "queue_state": "active"}
            await asyncio.sleep(POLL_EVERY_S)

    def _answer(self, r: TinkerResult, job_id: str) -> dict[str, Any] | bytes:
        mid = wire.model_of_job(job_id)
        if r.error:
            return {"error": r.error, "category": r.category}
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
