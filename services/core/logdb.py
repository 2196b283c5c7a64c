"""The trajectory log's schema and DuckDB views over it: `opentinker query "SQL"`.

Shared by the recorder (which writes the Parquet parts) and every reader (the CLI,
the learner's SFT-from-log path, `opentinker infer`): the log is a contract, like
the bus messages.

Views (one row per thing, however often the recorder wrote it):
- `trajectories`: one row per (job_id, episode_id); columns as in store.SCHEMAS.
- `metrics`: long format, one row per (job_id, split, step, key), e.g.
      SELECT step, value FROM metrics WHERE job_id = 'my-job' AND key = 'reward_mean'
- `events`: one row per distinct job state change.
- `images`: every image a vision-language episode showed the policy, once per
  (job_id, sha256): `data` holds its PNG/JPEG bytes; `trajectories.image_sha256` lists
  an episode's images in order (TurnRecord.images says which turn showed them), e.g.
      SELECT i.data FROM trajectories t, unnest(t.image_sha256) u(h)
      JOIN images i ON i.job_id = t.job_id AND i.sha256 = u.h WHERE t.episode_id = '...'
- `steps`: the groups (request ids) each train step of an RL job was trained on, from
  the step's latest report (a step redone after a resume counts once, as redone):
      SELECT s.step, count(*) FROM steps s JOIN trajectories t USING (job_id, request_id)
      WHERE s.job_id = 'my-job' GROUP BY s.step
- Per-step mean reward:
      SELECT step, avg(reward) FROM trajectories WHERE job_id = 'my-job' GROUP BY step ORDER BY step

A message redelivered after a recorder crash (written, not yet acked) is written twice;
the views keep one copy (the latest stream sequence), so queries never double count.

`run_query` is for the operator (full DuckDB, the whole log). SQL from a tenant (a job's
`sft_query`) goes through `run_user_query`: only that tenant's jobs' rows, no file or
network access, one SELECT.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from opentinker.schemas.job import JOB_ID_RE

TURN = pa.struct([
    ("gen_start", pa.int32()), ("gen_end", pa.int32()), ("obs_end", pa.int32()),
    ("reward", pa.float64()), ("policy_version", pa.int64()), ("finish_reason", pa.string()),
    ("action", pa.string()), ("observation", pa.string()),
    ("gen_ms", pa.float64()), ("env_ms", pa.float64()), ("images", pa.int32()),
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
        # a multi-agent episode's seat, and the game its seats share ("" single-agent)
        ("agent", pa.string()), ("game_id", pa.string()),
        # the episode's images (sha256 hex, in placeholder order): rows of `images`
        ("image_sha256", pa.list_(pa.string())),
        # the job whose policy played this seat, when another job's (JobSpec.opponents)
        ("policy_of", pa.string()),
        # on-policy distillation (JobSpec.teacher): the teacher's logprob of each token,
        # aligned with token_ids as `logprobs` is (0 off the policy's tokens); empty without
        ("teacher_logprobs", pa.list_(pa.float32())),
    ]),
    # each image once per job, by content hash (a group's episodes share theirs)
    "images": pa.schema([
        ("job_id", pa.string()), ("sha256", pa.string()), ("data", pa.binary()),
        ("width", pa.int32()), ("height", pa.int32()), ("seq", pa.int64()),
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
    # the groups each train step was trained on (Metrics.groups): join `trajectories`
    # on (job_id, request_id) for the episodes of a step
    "steps": pa.schema([
        ("job_id", pa.string()), ("step", pa.int64()), ("policy_version", pa.int64()),
        ("request_id", pa.string()), ("seq", pa.int64()),
    ]),
}


# What identifies one logical row; duplicates of it are the same message written twice
# (or a learner re-logging a step after resuming, where the latest wins).
KEYS = {
    "trajectories": ("job_id", "episode_id"),
    "metrics": ("job_id", "split", "step", "key"),
    "events": ("job_id", "state", "reason", "step", "time_s", "source"),
    "steps": ("job_id", "step", "request_id"),
    "images": ("job_id", "sha256"),
}
# tables whose rows come several to a message and where only the latest message of a
# key counts: a step redone after a resume names its groups anew, and the redone ones
# replace the lost run's
LATEST_MESSAGE_OF = {"steps": ("job_id", "step")}


def _sql_str(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def _dedup(table: str, source: str) -> str:
    """SELECT one row per KEYS[table] (the latest stream sequence) from `source`; for a
    LATEST_MESSAGE_OF table, the rows of the latest message of each of its keys."""
    keys = ", ".join(KEYS[table])
    if table in LATEST_MESSAGE_OF:
        latest = ", ".join(LATEST_MESSAGE_OF[table])
        return (f"SELECT * FROM {source} "
                f"QUALIFY row_number() OVER (PARTITION BY {keys}, seq) = 1 "
                f"AND dense_rank() OVER (PARTITION BY {latest} ORDER BY seq DESC) = 1")
    return (f"SELECT * FROM {source} "
            f"QUALIFY row_number() OVER (PARTITION BY {keys} ORDER BY seq DESC) = 1")


def _read_parquet(files: str | list[str]) -> str:
    """A read_parquet(...) over a glob or a list of files under `<table>/job_id=<id>/`."""
    arg = _sql_str(files) if isinstance(files, str) else "[" + ", ".join(_sql_str(f) for f in files) + "]"
    # job_id is read as text even for an all-digit id ("123").
    return (f"read_parquet({arg}, hive_partitioning = true, union_by_name = true, "
            "hive_types = {'job_id': VARCHAR})")


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
            source = _read_parquet(str(folder / "*" / "*.parquet"))
        else:
            con.register(f"_empty_{table}", schema.empty_table())
            source = f"_empty_{table}"
        con.execute(f"CREATE VIEW {table} AS {_dedup(table, source)}")
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


# What one tenant's query may use. The tables of the slice count against the memory too;
# nothing spills to disk (no temp_directory), so a query that needs more fails.
USER_MEMORY_LIMIT = "1GB"
USER_THREADS = 2
USER_TIMEOUT_S = 300.0
USER_MAX_ROWS = 200_000


def _user_files(data_dir: Path, table: str, job_ids: list[str] | None) -> list[str]:
    folder = data_dir / table
    if job_ids is None:
        return sorted(str(p) for p in folder.glob("job_id=*/*.parquet"))
    return sorted(str(p) for j in job_ids for p in (folder / f"job_id={j}").glob("*.parquet"))


def run_user_query(sql: str, data_dir: str | Path, job_ids: Iterable[str] | None, *,
                   field: str = "sft_query", timeout_s: float = USER_TIMEOUT_S,
                   max_rows: int = USER_MAX_ROWS) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Run untrusted `sql` (one SELECT) over the rows of `job_ids` only; returns
    (column names, rows).

    The tables `trajectories`, `metrics` and `events` hold only the partitions
    `<data_dir>/<table>/job_id=<id>/*.parquet` of `job_ids` (None: every job, for an
    admin or operator), one row per key as in the views of `connect`. They are copied
    into memory first; then DuckDB's external access is turned off and the
    configuration locked (DuckDB's "Securing DuckDB" guide), so the query cannot read
    or write a file (read_text, read_csv, COPY, ATTACH, glob), reach the network, or
    install or load an extension, and cannot turn any of that back on with SET. It runs
    with USER_THREADS threads and USER_MEMORY_LIMIT of memory (the loaded slice
    included), is interrupted after `timeout_s` seconds, and may return at most
    `max_rows` rows.

    Raises ValueError naming `field` (and DuckDB's message) for a bad job id, SQL that
    is not exactly one SELECT, or a query that fails, runs out of time or memory, or
    returns too many rows. Since the query cannot open a file, no file's contents can
    reach the message.
    """
    ids = None if job_ids is None else sorted(set(job_ids))
    for j in ids or ():
        # validated before it becomes part of a path
        if not JOB_ID_RE.match(j):
            raise ValueError(f"{field}: job id {j!r} must match {JOB_ID_RE.pattern}")
    con = duckdb.connect(":memory:", config={
        "threads": USER_THREADS, "memory_limit": USER_MEMORY_LIMIT, "temp_directory": "",
        "autoinstall_known_extensions": False, "autoload_known_extensions": False,
        # no query may read a Python object of the calling frames by its name
        "python_enable_replacements": False,
    })
    timer = threading.Timer(timeout_s, con.interrupt)
    try:
        try:
            for table, schema in SCHEMAS.items():
                files = _user_files(Path(data_dir), table, ids)
                if files:
                    source = _read_parquet(files)
                else:
                    con.register(f"_empty_{table}", schema.empty_table())
                    source = f"_empty_{table}"
                con.execute(f"CREATE TABLE {table} AS {_dedup(table, source)}")
                if not files:
                    con.unregister(f"_empty_{table}")
        except duckdb.Error as e:
            raise ValueError(f"{field}: could not load the log at {data_dir}: {e}") from None
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
        try:
            statements = con.extract_statements(sql)
        except duckdb.Error as e:
            raise ValueError(f"{field}: the query failed: {e}") from None
        if len(statements) != 1 or statements[0].type != duckdb.StatementType.SELECT:
            got = ", ".join(st.type.name for st in statements) or "nothing"
            raise ValueError(f"{field}: must be exactly one SELECT statement over trajectories, metrics "
                             f"and events (got {got})")
        timer.start()
        try:
            cur = con.execute(statements[0])
            cols = [d[0] for d in cur.description] if cur.description else []
            rows = cur.fetchmany(max_rows + 1)
        except duckdb.InterruptException:
            raise ValueError(f"{field}: the query ran longer than {timeout_s:g} s") from None
        except duckdb.Error as e:
            raise ValueError(f"{field}: the query failed: {e}") from None
        if len(rows) > max_rows:
            raise ValueError(f"{field}: the query returned more than {max_rows} rows; narrow it "
                             "(WHERE, LIMIT)")
        return cols, rows
    finally:
        timer.cancel()
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
