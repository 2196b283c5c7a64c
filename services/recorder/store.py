"""The trajectory log on disk: bus messages -> rows -> Parquet parts.

Layout (hive partitioning, one folder per job):
    <log_dir>/<table>/job_id=<id>/part-<unix_ms>-<uuid8>.parquet
Tables: `trajectories` (one row per episode), `metrics` (long format: one row per
step and metric key), `events` (one row per job state change). Every row carries
`seq`, the JetStream stream sequence of the message it came from, so a message
redelivered after a crash is recognisable as the same message.
"""

from __future__ import annotations

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
        "seq": seq,
    }]


def metrics_rows(m: Metrics, seq: int) -> list[dict[str, Any]]:
    """One row per metric key (long format); none for an empty `values`."""
    return [{"job_id": m.job_id, "step": m.step, "policy_version": m.policy_version,
             "split": m.split, "time_s": m.time_s, "key": k, "value": v, "seq": seq}
            for k, v in m.values.items()]


def event_rows(e: JobStateChanged, seq: int) -> list[dict[str, Any]]:
    return [{"job_id": e.job_id, "state": e.state.value, "reason": e.reason, "step": e.step,
             "time_s": e.time_s, "source": e.source, "seq": seq}]


def write_part(log_dir: str | Path, table: str, job_id: str, rows: list[dict[str, Any]]) -> Path:
    """Write `rows` as one new Parquet part of `table` for `job_id`; returns its path.

    Durable before it returns: written under a temporary name (that readers' globs do
    not match), fsynced, renamed into place, and the folder fsynced, so a crash
    leaves either the whole part or nothing. `job_id` must already be validated (it
    becomes a folder name). Raises pyarrow errors for rows that do not fit the schema.
    """
    folder = Path(log_dir) / table / f"job_id={job_id}"
    folder.mkdir(parents=True, exist_ok=True)
    name = f"part-{int(time.time() * 1000)}-{uuid.uuid4().hex[:8]}.parquet"
    tmp = folder / f".{name}.tmp"
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMAS[table]), tmp, compression="zstd")
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, folder / name)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return folder / name
