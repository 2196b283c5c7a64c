"""The trajectory log's schema and DuckDB views over it: `opentinker query "SQL"`.

Shared by the recorder (which writes the Parquet parts) and every reader (the CLI,
the learner's SFT-from-log path, `opentinker infer`): the log is a contract, like
the bus messages.

Views (one row per thing, however often the recorder wrote it):
- `trajectories`: one row per (job_id, episode_id); columns as in store.SCHEMAS.
- `metrics`: long format, one row per (job_id, split, step, key), e.g.
      SELECT step, value FROM metrics WHERE job_id = 'my-job' AND key = 'reward_mean'
- `events`: one row per distinct job state change.
- Per-step mean reward:
      SELECT step, avg(reward) FROM trajectories WHERE job_id = 'my-job' GROUP BY step ORDER BY step

A message redelivered after a recorder crash (written, not yet acked) is written twice;
the views keep one copy (the latest stream sequence), so queries never double count.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

TURN = pa.struct([
    ("gen_start", pa.int32()), ("gen_end", pa.int32()), ("obs_end", pa.int32()),
    ("reward", pa.float64()), ("policy_version", pa.int64()), ("finish_reason", pa.string()),
    ("action", pa.string()), ("observation", pa.string()),
    ("gen_ms", pa.float64()), ("env_ms", pa.float64()),
])

SCHEMAS: dict[str, pa.Schema] = {
    "trajectories": pa.schema([
        ("job_id", pa.string()), ("step", pa.int64()), ("episode_id", pa.string()),
        ("request_id", pa.string()), ("group_index", pa.int64()), ("group_size", pa.int64()),
        ("split", pa.string()), ("env", pa.string()), ("reward", pa.float64()),
        ("policy_version", pa.int64()), ("num_turns", pa.int64()), ("num_tokens", pa.int64()),
        ("num_policy_tokens", pa.int64()), ("prompt_len", pa.int64()),
        ("token_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())),
        ("logprobs", pa.list_(pa.float32())), ("turns", pa.list_(TURN)),
        ("env_info", pa.string()), ("error", pa.string()), ("worker", pa.string()),
        ("engine", pa.string()), ("gen_ms", pa.float64()), ("env_ms", pa.float64()),
        ("created_s", pa.float64()), ("seq", pa.int64()),
    ]),
    # Long format so `SELECT step, value FROM metrics WHERE key = 'reward_mean'` needs
    # no knowledge of which keys a job happened to log.
    "metrics": pa.schema([
        ("job_id", pa.string()), ("step", pa.int64()), ("policy_version", pa.int64()),
        ("split", pa.string()), ("time_s", pa.float64()), ("key", pa.string()),
        ("value", pa.float64()), ("seq", pa.int64()),
    ]),
    "events": pa.schema([
        ("job_id", pa.string()), ("state", pa.string()), ("reason", pa.string()),
        ("step", pa.int64()), ("time_s", pa.float64()), ("source", pa.string()),
        ("seq", pa.int64()),
    ]),
}


# What identifies one logical row; duplicates of it are the same message written twice
# (or a learner re-logging a step after resuming, where the latest wins).
KEYS = {
    "trajectories": ("job_id", "episode_id"),
    "metrics": ("job_id", "split", "step", "key"),
    "events": ("job_id", "state", "reason", "step", "time_s", "source"),
}


def _sql_str(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def connect(data_dir: str | Path) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with the views `trajectories`, `metrics` and
    `events` over `<data_dir>/<table>/job_id=*/*.parquet`.

    A table with no files yet gets an empty view with the right columns; that view
    stays empty for this connection's life (connect again to see new files).
    """
    con = duckdb.connect(":memory:")
    for table, schema in SCHEMAS.items():
        folder = Path(data_dir) / table
        if any(folder.glob("job_id=*/*.parquet")):
            # job_id is read as text even for an all-digit id ("123").
            source = (f"read_parquet({_sql_str(str(folder / '*' / '*.parquet'))}, "
                      "hive_partitioning = true, union_by_name = true, "
                      "hive_types = {'job_id': VARCHAR})")
        else:
            con.register(f"_empty_{table}", schema.empty_table())
            source = f"_empty_{table}"
        keys = ", ".join(KEYS[table])
        con.execute(
            f"CREATE VIEW {table} AS SELECT * FROM {source} "
            f"QUALIFY row_number() OVER (PARTITION BY {keys} ORDER BY seq DESC) = 1")
    return con


def run_query(sql: str, data_dir: str | Path) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Run `sql` against the views; returns (column names, rows).

    Raises duckdb.Error (e.g. duckdb.ParserException, duckdb.BinderException) with
    DuckDB's message for bad SQL.
    """
    con = connect(data_dir)
    try:
        cur = con.execute(sql)
        cols = [d[0] for d in cur.description] if cur.description else []
        return cols, cur.fetchall()
    finally:
        con.close()


def export_query(sql: str, data_dir: str | Path, out: str | Path) -> int:
    """Write the rows of `sql` (over the views) to `out`: Parquet for `.parquet`,
    newline-delimited JSON for `.jsonl`/`.json`. Returns the row count. Raises
    ValueError for another suffix, duckdb.Error for bad SQL."""
    out = Path(out)
    fmt = {".parquet": "PARQUET", ".jsonl": "JSON", ".json": "JSON"}.get(out.suffix)
    if fmt is None:
        raise ValueError(f"export to {out.name}: use a .parquet or .jsonl file")
    out.parent.mkdir(parents=True, exist_ok=True)
    con = connect(data_dir)
    try:
        n = con.execute(f"SELECT count(*) FROM ({sql})").fetchone()[0]
        con.execute(f"COPY ({sql}) TO {_sql_str(str(out))} (FORMAT {fmt})")
    finally:
        con.close()
    return int(n)
