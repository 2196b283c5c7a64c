"""The trajectory log on disk: bus messages -> rows -> Parquet parts.

Layout (hive partitioning, one folder per job):
    <log_dir>/<table>/job_id=<id>/part-<unix_ms>-<uuid8>.parquet
Tables: `trajectories` (one row per episode), `metrics` (long format: one row per
step and metric key), `events` (one row per job state change), `steps` (one row per
group a train step was trained on). Every row carries
`seq`, the JetStream stream sequence of the message it came from, so a message
redelivered after a crash is recognisable as the same message.
"""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq

from opentinker.schemas import JobStateChanged, Metrics, Trajectory
from opentinker.services.core.logdb import SCHEMAS

# what converting rows that do not fit a schema raises (pyarrow.ArrowInvalid is a
# ValueError, ArrowTypeError a TypeError); an OSError (a full disk) is not among them
MISFIT = (ValueError, TypeError, OverflowError, pa.ArrowNotImplementedError)


class RowError(ValueError):
    """Rows that do not fit their table's schema: `field` names the column (dotted into
    a struct, e.g. "turns.gen_start") and `value` the first value it cannot hold."""

    def __init__(self, table: str, field: str, value: Any, reason: str):
        text = repr(value)
        super().__init__(f"`{field}` = {text[:200]}{'...' if len(text) > 200 else ''} does not fit "
                         f"the {table} table's column: {reason}")
        self.field, self.value = field, value


def to_table(table: str, rows: list[dict[str, Any]]) -> pa.Table:
    """`rows` as an Arrow table of SCHEMAS[table] (the Parquet columns).

    Raises RowError naming the first column (and value) that cannot hold a value: an
    integer beyond the column's type (a step >= 2**63 for int64, a token id or turn
    offset >= 2**31 for int32), a wrong type. (A float beyond float32 becomes inf.)
    """
    schema = SCHEMAS[table]
    try:
        return pa.Table.from_pylist(rows, schema=schema)
    except MISFIT as e:
        for f in schema:
            bad = _misfit(f.name, f.type, [r.get(f.name) for r in rows])
            if bad is not None:
                raise RowError(table, *bad) from None
        raise RowError(table, "?", None, str(e)) from None


def _misfit(name: str, typ: pa.DataType, values: list[Any]) -> tuple[str, Any, str] | None:
    """The first (dotted field, value, error) among `values` that a column of `typ`
    cannot hold, or None when all fit."""
    try:
        pa.array(values, type=typ)
        return None
    except MISFIT as e:
        error = str(e)
    if pa.types.is_struct(typ):
        for f in typ:
            bad = _misfit(f"{name}.{f.name}", f.type, [v.get(f.name) if isinstance(v, dict) else None for v in values])
            if bad is not None:
                return bad
    elif pa.types.is_list(typ) or pa.types.is_large_list(typ):
        for v in values:
            if isinstance(v, list) and (bad := _misfit(name, typ.value_type, v)) is not None:
                return bad
    for v in values:
        try:
            pa.array([v], type=typ)
        except MISFIT as e:
            return name, v, str(e)
    return name, None, error


def trajectory_rows(t: Trajectory, seq: int) -> list[dict[str, Any]]:
    """One row per episode. `env_info` is stored as a JSON string."""
    return [{
        "job_id": t.job_id, "step": t.step, "episode_id": t.episode_id, "request_id": t.request_id,
        "group_index": t.group_index, "group_size": t.group_size, "split": t.split, "env": t.env,
        "reward": t.reward, "policy_version": t.policy_version, "num_turns": len(t.turns),
        "num_tokens": len(t.token_ids), "num_policy_tokens": sum(1 for x in t.loss_mask if x),
        "prompt_len": t.prompt_len, "token_ids": t.token_ids, "loss_mask": t.loss_mask,
        "logprobs": t.logprobs, "turns": msgspec.to_builtins(t.turns),
        "env_info": msgspec.json.encode(t.env_info).decode(), "error": t.error, "worker": t.worker,
        "engine": t.engine, "gen_ms": t.gen_ms, "env_ms": t.env_ms, "created_s": t.created_s,
        "seq": seq, "agent": t.agent, "game_id": t.game_id,
        "image_sha256": [hashlib.sha256(b).hexdigest() for b in t.images],
        "policy_of": t.policy_of, "teacher_logprobs": t.teacher_logprobs,
    }]


def image_rows(t: Trajectory, seq: int) -> list[dict[str, Any]]:
    """One row per distinct image of the episode (logdb's `images` table, keyed by
    (job_id, sha256)); none for a text episode. Raises ValueError for bytes that are
    not an image (the message is dead-lettered)."""
    from opentinker.environment.images import decode_image

    rows, seen = [], set()
    for b in t.images:
        h = hashlib.sha256(b).hexdigest()
        if h in seen:
            continue
        seen.add(h)
        w, hgt = decode_image(b).size
        rows.append({"job_id": t.job_id, "sha256": h, "data": b, "width": w, "height": hgt, "seq": seq})
    return rows


def metrics_rows(m: Metrics, seq: int) -> list[dict[str, Any]]:
    """One row per metric key (long format); none for an empty `values`."""
    return [{"job_id": m.job_id, "step": m.step, "policy_version": m.policy_version,
             "split": m.split, "time_s": m.time_s, "key": k, "value": v, "seq": seq}
            for k, v in m.values.items()]


def step_rows(m: Metrics, seq: int) -> list[dict[str, Any]]:
    """One row per group a train step was trained on (Metrics.groups); none for an
    evaluation or a step that names none."""
    return [{"job_id": m.job_id, "step": m.step, "policy_version": m.policy_version, "request_id": r, "seq": seq}
            for r in m.groups] if m.split == "train" else []


def event_rows(e: JobStateChanged, seq: int) -> list[dict[str, Any]]:
    return [{"job_id": e.job_id, "state": e.state.value, "reason": e.reason, "step": e.step,
             "time_s": e.time_s, "source": e.source, "seq": seq}]


def write_part(log_dir: str | Path, table: str, job_id: str, rows: list[dict[str, Any]] | pa.Table) -> Path:
    """Write `rows` (dicts, or an Arrow table from `to_table`) as one new Parquet part
    of `table` for `job_id`; returns its path.

    Durable before it returns: written under a temporary name (that readers' globs do
    not match), fsynced, renamed into place, and the folder fsynced, so a crash
    leaves either the whole part or nothing. `job_id` must already be validated (it
    becomes a folder name). Raises RowError for rows that do not fit the schema,
    OSError for a failed write.
    """
    folder = Path(log_dir) / table / f"job_id={job_id}"
    folder.mkdir(parents=True, exist_ok=True)
    name = f"part-{int(time.time() * 1000)}-{uuid.uuid4().hex[:8]}.parquet"
    tmp = folder / f".{name}.tmp"
    data = rows if isinstance(rows, pa.Table) else to_table(table, rows)
    try:
        pq.write_table(data, tmp, compression="zstd")
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, folder / name)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return folder / name
