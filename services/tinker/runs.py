"""The Tinker API's REST listing (the SDK's RestClient): a user's training runs and
their checkpoints, answered from what the stack already records, with the user metadata
and expiry (ttl_seconds) the SDK attaches to runs and saves, which are kept here (KV
`ot_tinker`: TinkerRunMeta `run.<job>`, TinkerCheckpointMeta `ckpt.<job>.<kind>.<hex
of the name>`, schemas/tinker.py).

- A training run is a model of a Tinker session, named by its Tinker model id
  `<session>:train:<n>`: a tinker job of the caller's in KV `ot_jobs`, whose record holds
  its owner, base model, LoRA rank and modules and creation time. It is listed until the
  scheduler's retention deletes the record (and its objects with it).
- Its checkpoints are the objects its saves wrote: save_state's `<job>/named/<name>` in
  `ot_checkpoints` (type "training", `tinker://<model>/weights/<name>`) and
  save_weights_for_sampler's `<job>/sampler/<name>` in `ot_weights` (type "sampler",
  `tinker://<model>/sampler_weights/<name>`). A checkpoint's id is its path after the
  run, `weights/<name>` or `sampler_weights/<name>` (the SDK's ParsedCheckpointTinkerPath);
  its time is when its object was written (the object's mtime), its size the object's.
- A run's `last_request_time` is the later of its creation and its session's last
  operation or sample (TinkerSession.active_s, written at most every ACTIVE_EVERY_S).
- Lists are newest first: runs by creation, checkpoints by time. A page is `limit`
  (1 to MAX_PAGE) items from `offset` (0 to MAX_OFFSET); the cursor counts them all.
- A run's `user_metadata` is its create_model's (or create_training_client_from_state's);
  a save's, and its `expires_at` (its ttl_seconds after the save was written), the
  save's own, kept by the learner once it has written the save (TinkerOp.ttl_s /
  user_metadata; a save it refuses changes nothing); a save written again without them
  has none. Each is checked by wire.check_metadata / wire.check_ttl (a 400 naming the
  field). `expire`, every EXPIRE_EVERY_S in the service's loop, deletes the saves whose
  time has come (their objects, so their room in `store_bytes_per_user` is free again)
  and the metadata of runs whose job record is gone.

Another user's run answers 404, as one that does not exist, to every call (its
checkpoints' listing, deletion and weights info included).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Literal

import msgspec
from nats.js.errors import KeyNotFoundError, NotFoundError, ObjectNotFoundError

from opentinker.schemas import JobRecord, decode, encode
from opentinker.schemas import subjects as S
from opentinker.schemas.tinker import (CHECKPOINT_NAME_RE, SAMPLER_FOLDER, STATE_FOLDER, TinkerCheckpointMeta,
                                       TinkerRunMeta, TinkerSession, checkpoint_key, save_object)
from opentinker.services.core.bus import Bus
from opentinker.services.tinker import wire
from opentinker.services.tinker.sessions import LORA_MODULES, ApiError

MAX_PAGE = 1000
MAX_OFFSET = 1_000_000
LIST_TIMEOUT_S = 60.0
EXPIRE_EVERY_S = 60.0
_NUMBER_RE = re.compile(r"^-?[0-9]{1,12}$")
# the object each kind of save writes (store, folder under the job) and its Tinker type
KINDS = {"weights": (S.OBJ_CHECKPOINTS, STATE_FOLDER, "training"),
         "sampler_weights": (S.OBJ_WEIGHTS, SAMPLER_FOLDER, "sampler")}


class Checkpoint(msgspec.Struct, kw_only=True):
    """tinker.types.Checkpoint. time: when it was written (UTC); size_bytes: its object's."""

    checkpoint_id: str
    checkpoint_type: Literal["training", "sampler"]
    time: datetime
    tinker_path: str
    size_bytes: int | None = None
    public: bool = False
    user_metadata: dict[str, str] | None = None
    expires_at: datetime | None = None


class Cursor(msgspec.Struct, kw_only=True):
    """tinker.types.Cursor: the page asked for and how many items there are in all."""

    offset: int
    limit: int
    total_count: int


class TrainingRun(msgspec.Struct, kw_only=True):
    """tinker.types.TrainingRun (a model of a Tinker session; module docstring)."""

    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool = True
    corrupted: bool = False
    lora_rank: int | None = None
    last_request_time: datetime
    last_checkpoint: Checkpoint | None = None
    last_sampler_checkpoint: Checkpoint | None = None
    user_metadata: dict[str, str] | None = None


# -- pure: queries, names and shapes ---------------------------------------------------

def page(query: Mapping[str, str], default_limit: int) -> tuple[int, int]:
    """(limit, offset) of a list's query parameters: `limit` 1 to MAX_PAGE (absent:
    `default_limit`), `offset` 0 to MAX_OFFSET (absent: 0). Raises wire.WireError naming
    the field for anything else."""
    out = []
    for field, default, lo, hi in (("limit", default_limit, 1, MAX_PAGE), ("offset", 0, 0, MAX_OFFSET)):
        raw = query.get(field)
        if raw is None:
            out.append(default)
            continue
        if not _NUMBER_RE.match(raw) or not lo <= int(raw) <= hi:
            raise wire.WireError(f"{field}: {raw[:40]!r} is not a whole number from {lo} to {hi}")
        out.append(int(raw))
    return out[0], out[1]


def check_scope(query: Mapping[str, str]) -> None:
    """Refuse what a run list or get may ask and is not served: `access_scope` other than
    "owned" or "accessible" (both mean the caller's own runs: none is shared here) and
    `project_id` (no projects here). Raises wire.WireError naming the field."""
    scope = query.get("access_scope", "owned")
    if scope not in ("owned", "accessible"):
        raise wire.WireError(f"access_scope: {scope[:40]!r} is not 'owned' or 'accessible'")
    if "project_id" in query:
        raise wire.WireError("project_id: projects are not served (list without it: every run of yours)")


def checkpoint_of_object(bucket: str, name: str) -> tuple[str, str, str] | None:
    """(job id, kind "weights" or "sampler_weights", save name) of the object `name` in
    store `bucket` when a Tinker session's model saved it; None for any other object."""
    job_id, _, rest = name.partition("/")
    folder, _, save = rest.partition("/")
    for kind, (store, where, _) in KINDS.items():
        if (bucket, folder) == (store, where) and wire.JOB_RE.match(job_id) and CHECKPOINT_NAME_RE.match(save):
            return job_id, kind, save
    return None


def object_of_checkpoint(job_id: str, checkpoint_id: str) -> tuple[str, str]:
    """(store, object name) of checkpoint `checkpoint_id` (`weights/<name>` or
    `sampler_weights/<name>`) of the model job `job_id`. Raises wire.WireError."""
    kind, _, name = checkpoint_id.partition("/")
    if kind not in KINDS or not CHECKPOINT_NAME_RE.match(name):
        raise wire.WireError(f"checkpoint_id: {checkpoint_id[:160]!r} is not weights/<name> or "
                             "sampler_weights/<name>")
    store, folder, _ = KINDS[kind]
    return store, save_object(job_id, folder, name)


def utc(mtime: str | None) -> datetime:
    """The aware UTC time of an object's ISO 8601 `mtime` (naive: UTC); the epoch when
    it has none or cannot be read."""
    try:
        t = datetime.fromisoformat(mtime or "")
    except ValueError:
        return datetime.fromtimestamp(0, timezone.utc)
    return t.replace(tzinfo=timezone.utc) if t.tzinfo is None else t.astimezone(timezone.utc)


def checkpoint(job_id: str, kind: str, name: str, size_bytes: int | None, mtime: str | None,
               meta: TinkerCheckpointMeta | None = None) -> Checkpoint:
    """The Checkpoint of save `name` of kind `kind` of the model job `job_id`, with its
    user metadata and expiry from `meta` (None: neither)."""
    return Checkpoint(checkpoint_id=f"{kind}/{name}", checkpoint_type=KINDS[kind][2], time=utc(mtime),
                      tinker_path=wire.save_path(wire.model_of_job(job_id), kind, name), size_bytes=size_bytes,
                      user_metadata=(meta.user_metadata or None) if meta else None,
                      expires_at=datetime.fromtimestamp(meta.expires_s, timezone.utc)
                      if meta and meta.expires_s else None)


def training_run(rec: JobRecord, checkpoints: list[Checkpoint], active_s: float = 0.0,
                 meta: TinkerRunMeta | None = None) -> TrainingRun:
    """The TrainingRun of the model job record `rec`, with its `checkpoints` (newest
    first), its session's last operation at unix time `active_s` and its user metadata
    from `meta`."""
    newest = {t: next((c for c in checkpoints if c.checkpoint_type == t), None) for t in ("training", "sampler")}
    return TrainingRun(training_run_id=wire.model_of_job(rec.job_id), base_model=rec.spec.model,
                       model_owner=rec.user, lora_rank=rec.spec.lora_rank,
                       last_request_time=datetime.fromtimestamp(max(rec.created_s, active_s), timezone.utc),
                       last_checkpoint=newest["training"], last_sampler_checkpoint=newest["sampler"],
                       user_metadata=(meta.user_metadata or None) if meta else None)


def run_key(job_id: str) -> str:
    """The KV `ot_tinker` key of the TinkerRunMeta of model job `job_id`."""
    return f"run.{job_id}"


def weights_info(rec: JobRecord) -> dict:
    """tinker.types.WeightsInfoResponse of a save of the model job record `rec`: its base
    model and LoRA (the modules it trains; the unembedding never, sessions.LORA_MODULES)."""
    modules = set(rec.spec.lora_target_modules)
    return {"base_model": rec.spec.model, "is_lora": True, "lora_rank": rec.spec.lora_rank,
            "optimizer_config": {"type": "adamw"}, "train_unembed": False,
            "train_mlp": bool(modules & set(LORA_MODULES["mlp"])),
            "train_attn": bool(modules & set(LORA_MODULES["attn"]))}


# -- over the bus ----------------------------------------------------------------------

class Runs:
    """A user's training runs and checkpoints, read from the bus (module docstring).
    Every call raises ApiError 404 for a run that is not the caller's."""

    def __init__(self, bus: Bus):
        self.bus = bus

    async def _records(self, user: str) -> list[JobRecord]:
        """The records of `user`'s training runs, newest first."""
        out = []
        for value, _ in (await self.bus.kv_values(S.KV_JOBS)).values():
            try:
                rec = decode(value, JobRecord)
            except msgspec.MsgspecError:
                continue
            if rec.user == user and rec.kind == "train" and rec.spec.algorithm == "tinker" \
                    and wire.JOB_RE.match(rec.job_id):
                out.append(rec)
        return sorted(out, key=lambda r: (r.created_s, r.job_id), reverse=True)

    async def _record(self, user: str, run_id: str) -> JobRecord:
        """The record of `user`'s training run `run_id` (a model id, checked as every
        route checks one: sessions.py); ApiError 404 otherwise."""
        missing = ApiError(404, f"no training run {run_id[:160]!r}")
        try:
            job_id = wire.job_of_model(run_id)
        except wire.WireError:
            raise missing from None
        got = await self.bus.job_record(job_id)
        if got is None or got[0].user != user or got[0].spec.algorithm != "tinker":
            raise missing
        return got[0]

    # -- what is kept here: run and save metadata, expiry ----------------------------

    async def note_run(self, user: str, job_id: str, user_metadata: dict[str, str]) -> None:
        """Keep model job `job_id`'s user metadata (checked already; {}: none)."""
        kv = await self.bus.kv(S.KV_TINKER)
        if user_metadata:
            await kv.put(run_key(job_id), encode(TinkerRunMeta(job_id=job_id, user=user, user_metadata=user_metadata)))

    async def _metas(self) -> tuple[dict[str, TinkerRunMeta], dict[tuple[str, str, str], TinkerCheckpointMeta]]:
        """Every run's metadata by job id, every save's by (job id, kind, name)."""
        runs_meta, saves_meta = {}, {}
        for key, (value, _) in (await self.bus.kv_values(S.KV_TINKER, "run.")).items():
            with contextlib.suppress(msgspec.MsgspecError):
                m = decode(value, TinkerRunMeta)
                runs_meta[m.job_id] = m
        for key, (value, _) in (await self.bus.kv_values(S.KV_TINKER, "ckpt.")).items():
            with contextlib.suppress(msgspec.MsgspecError):
                c = decode(value, TinkerCheckpointMeta)
                saves_meta[(c.job_id, c.kind, c.name)] = c
        return runs_meta, saves_meta

    async def expire(self, now: float | None = None) -> list[str]:
        """Delete the saves past their expiry (their objects and metadata) and the
        metadata of runs whose job record is gone. Returns the tinker paths deleted."""
        now = time.time() if now is None else now
        kv = await self.bus.kv(S.KV_TINKER)
        runs_meta, saves_meta = await self._metas()
        jobs = set((await self.bus.kv_values(S.KV_JOBS)).keys()) if runs_meta or saves_meta else set()
        out = []
        for (job_id, kind, name), m in saves_meta.items():
            if m.expires_s and m.expires_s <= now:
                await self.bus.delete_object(*object_of_checkpoint(job_id, f"{kind}/{name}"))
                out.append(wire.save_path(wire.model_of_job(job_id), kind, name))
            elif job_id in jobs:
                continue
            with contextlib.suppress(KeyNotFoundError):
                await kv.purge(checkpoint_key(job_id, kind, name))
        for job_id in set(runs_meta) - jobs:
            with contextlib.suppress(KeyNotFoundError):
                await kv.purge(run_key(job_id))
        return out

    async def _checkpoints(self, jobs: set[str]) -> list[Checkpoint]:
        """The checkpoints of the model jobs `jobs`, newest first."""
        out: list[Checkpoint] = []
        if not jobs:
            return out
        _, saves_meta = await self._metas()
        for bucket in (S.OBJ_CHECKPOINTS, S.OBJ_WEIGHTS):
            try:
                infos = await asyncio.wait_for((await self.bus.objects(bucket)).list(ignore_deletes=True),
                                               LIST_TIMEOUT_S)
            except NotFoundError:  # nats-py: an empty store
                continue
            for info in infos:
                got = checkpoint_of_object(bucket, info.name)
                if got is not None and got[0] in jobs:
                    out.append(checkpoint(*got, info.size, info.mtime, saves_meta.get(got)))
        return sorted(out, key=lambda c: (c.time, c.tinker_path), reverse=True)

    async def _active(self) -> dict[str, float]:
        """Session id -> its last operation or sample (unix s)."""
        out = {}
        for key, (value, _) in (await self.bus.kv_values(S.KV_TINKER)).items():
            if wire.SESSION_RE.match(key):
                try:
                    out[key] = decode(value, TinkerSession).active_s
                except msgspec.MsgspecError:
                    continue
        return out

    async def _runs(self, recs: list[JobRecord]) -> list[TrainingRun]:
        if not recs:
            return []
        ckpts = await self._checkpoints({r.job_id for r in recs})
        active = await self._active()
        runs_meta, _ = await self._metas()
        by_run: dict[str, list[Checkpoint]] = {}
        for c in ckpts:
            by_run.setdefault(wire.parse_save_path(c.tinker_path)[0], []).append(c)
        return [training_run(r, by_run.get(wire.model_of_job(r.job_id), []),
                             active.get(wire.session_of_job(r.job_id), 0.0), runs_meta.get(r.job_id)) for r in recs]

    async def session_ids(self, user: str, limit: int, offset: int) -> list[str]:
        """A page of `user`'s Tinker session ids, newest first (the REST client's list_sessions)."""
        mine = []
        for key, (value, _) in (await self.bus.kv_values(S.KV_TINKER)).items():
            if wire.SESSION_RE.match(key):
                with contextlib.suppress(msgspec.MsgspecError):
                    s = decode(value, TinkerSession)
                    if s.user == user:
                        mine.append((s.created_s, key))
        return [key for _, key in sorted(mine, reverse=True)[offset:offset + limit]]

    async def session_info(self, user: str, session_id: str) -> dict:
        """tinker.types.GetSessionResponse of `user`'s session: its training runs and
        sampling sessions, its user_metadata and display name. ApiError 404 for another's."""
        missing = ApiError(404, f"no session {session_id[:40]!r}")
        if not wire.SESSION_RE.match(session_id):
            raise missing
        try:
            s = decode((await (await self.bus.kv(S.KV_TINKER)).get(session_id)).value, TinkerSession)
        except (KeyNotFoundError, msgspec.MsgspecError):
            raise missing from None
        if s.user != user:
            raise missing
        return {"training_run_ids": [wire.model_id(session_id, n) for n in range(s.models)],
                "sampler_ids": [wire.sampler_job(session_id, n) for n in range(s.samplers)],
                "user_metadata": s.user_metadata or None, "display_name": s.display_name or None}

    async def list_runs(self, user: str, limit: int, offset: int) -> dict:
        """tinker.types.TrainingRunsResponse: a page of `user`'s training runs."""
        recs = await self._records(user)
        runs = await self._runs(recs[offset:offset + limit])
        return msgspec.to_builtins({"training_runs": runs,
                                    "cursor": Cursor(offset=offset, limit=limit, total_count=len(recs))})

    async def get_run(self, user: str, run_id: str) -> dict:
        """tinker.types.TrainingRun of `user`'s run `run_id`."""
        return msgspec.to_builtins((await self._runs([await self._record(user, run_id)]))[0])

    async def list_checkpoints(self, user: str, run_id: str) -> dict:
        """tinker.types.CheckpointsListResponse: every checkpoint of run `run_id` (no cursor)."""
        rec = await self._record(user, run_id)
        return msgspec.to_builtins({"checkpoints": await self._checkpoints({rec.job_id}), "cursor": None})

    async def list_user_checkpoints(self, user: str, limit: int, offset: int) -> dict:
        """tinker.types.CheckpointsListResponse: a page of the checkpoints of all of
        `user`'s runs."""
        ckpts = await self._checkpoints({r.job_id for r in await self._records(user)})
        return msgspec.to_builtins({"checkpoints": ckpts[offset:offset + limit],
                                    "cursor": Cursor(offset=offset, limit=limit, total_count=len(ckpts))})

    async def _object(self, user: str, run_id: str, checkpoint_id: str) -> tuple[JobRecord, str, str]:
        """(run record, store, object name) of an existing checkpoint of `user`'s run;
        ApiError 404 otherwise."""
        rec = await self._record(user, run_id)
        missing = ApiError(404, f"no checkpoint {checkpoint_id[:160]!r} of training run {run_id!r}")
        try:
            bucket, name = object_of_checkpoint(rec.job_id, checkpoint_id)
            await (await self.bus.objects(bucket)).get_info(name)
        except (wire.WireError, ObjectNotFoundError):
            raise missing from None
        return rec, bucket, name

    async def delete_checkpoint(self, user: str, run_id: str, checkpoint_id: str) -> None:
        """Delete checkpoint `checkpoint_id` of `user`'s run `run_id` (its object: the
        store space is the user's again). Raises ApiError 404 for none such."""
        rec, bucket, name = await self._object(user, run_id, checkpoint_id)
        await self.bus.delete_object(bucket, name)
        kind, _, save = checkpoint_id.partition("/")
        with contextlib.suppress(KeyNotFoundError):
            await (await self.bus.kv(S.KV_TINKER)).purge(checkpoint_key(rec.job_id, kind, save))

    async def weights_info(self, user: str, tinker_path: str) -> dict:
        """tinker.types.WeightsInfoResponse of the save at `tinker_path`, one of `user`'s.
        Raises ApiError 400 for a path that is not a save's, 404 for none such."""
        try:
            mid, kind, name = wire.parse_save_path(tinker_path)
        except wire.WireError:
            raise ApiError(400, f"tinker_path: {tinker_path[:200]!r} is not tinker://<model_id>/weights/<name> "
                                "or tinker://<model_id>/sampler_weights/<name>") from None
        rec, _, _ = await self._object(user, mid, f"{kind}/{name}")
        return weights_info(rec)
