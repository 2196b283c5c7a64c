"""The trajectory log on this machine (DuckDB over the recorder's Parquet):
`query`, `export`, `plot JOB`, `episodes JOB`."""

from __future__ import annotations

import argparse
from pathlib import Path

from opentinker.cli.common import console, data_dir, home, job_arg


def cmd_plot(args: argparse.Namespace) -> int:
    from opentinker.cli.views import plot

    root = data_dir(args)
    out = args.out or str(Path(home()) / "plots" / args.job_id)
    try:
        files = plot(job_arg(args.job_id), root, out)
    except LookupError as e:
        raise SystemExit(str(e)) from None
    for f in files:
        print(f)
    return 0


def cmd_episodes(args: argparse.Namespace) -> int:
    from opentinker.cli.views import episodes, print_episodes

    root = data_dir(args)
    tok = None
    if args.model:
        from transformers import AutoTokenizer

        from opentinker.services.core.models import resolve_model

        tok = AutoTokenizer.from_pretrained(resolve_model(args.model, home()))
    eps = episodes(job_arg(args.job_id), args.step, root, args.limit, args.split, tok)
    if not eps:
        raise SystemExit(f"no {args.split} episodes of job {args.job_id} at step {args.step} in {root}")
    print_episodes(eps, console())
    return 0


def _sql(fn, *args):
    """`fn(*args)`, with bad SQL (DuckDB's parser, binder or catalog error) ending the
    command with DuckDB's message rather than a traceback."""
    import duckdb

    try:
        return fn(*args)
    except duckdb.Error as e:
        raise SystemExit(f"bad SQL: {e}") from None


def cmd_query(args: argparse.Namespace) -> int:
    from rich.table import Table

    from opentinker.services.core.logdb import run_query

    from opentinker.services.core.queries import EXAMPLES

    root = data_dir(args)
    sql = args.sql
    if args.example:
        if not args.job:
            raise SystemExit("--example needs --job JOB")
        sql = EXAMPLES[args.example].format(job=job_arg(args.job))
    elif not sql:
        raise SystemExit("give SQL, or --example NAME --job JOB")
    cols, rows = _sql(run_query, sql, root)
    t = Table(*cols)
    for r in rows:
        t.add_row(*(f"{v:.4f}" if isinstance(v, float) else str(v) for v in r))
    console().print(t)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """A filtered slice of the log to Parquet or JSONL (for SFT, or to share)."""
    from opentinker.services.core.logdb import export_query

    root = data_dir(args)
    n = _sql(export_query, args.sql, root, args.out)
    print(f"{n} rows -> {args.out}")
    return 0


def register(sub) -> None:
    s = sub.add_parser("export", help="write a query's rows (a slice of the log) to .parquet or .jsonl")
    s.add_argument("sql")
    s.add_argument("--out", required=True, help="a .parquet or .jsonl file")
    s.add_argument("--data-dir", help="the log's root (default <home>/data)")
    s.set_defaults(fn=cmd_export)

    s = sub.add_parser("plot", help="PNG charts of a job (reward, eval, KL, entropy, step time) from the log")
    s.add_argument("job_id")
    s.add_argument("--out", help="folder (default <home>/plots/JOB)")
    s.add_argument("--data-dir", help="log root (default <home>/data)")
    s.set_defaults(fn=cmd_plot)

    s = sub.add_parser("episodes", help="a job's sampled episodes at a step, turn by turn, mask visible")
    s.add_argument("job_id")
    s.add_argument("--step", type=int, default=0)
    s.add_argument("--limit", type=int, default=2)
    s.add_argument("--split", default="train", choices=["train", "eval"])
    s.add_argument("--model", help="decode the tokens with this model's tokenizer (else the logged text)")
    s.add_argument("--data-dir", help="log root (default <home>/data)")
    s.set_defaults(fn=cmd_episodes)

    from opentinker.services.core.queries import EXAMPLES

    s = sub.add_parser("query", help="DuckDB SQL over the trajectory log")
    s.add_argument("sql", nargs="?", default="")
    s.add_argument("--example", choices=sorted(EXAMPLES), help="a documented query (with --job)")
    s.add_argument("--job", help="the job an --example is about")
    s.add_argument("--data-dir", help="log root (default <home>/data)")
    s.set_defaults(fn=cmd_query)

