"""What the commands share: the home folder, the NATS URL, job specs from TOML with
`--set` overrides, the console, and running a client body against the embedded stack."""

from __future__ import annotations

import argparse
import asyncio
import os
import tomllib
from pathlib import Path
from typing import Any


def home() -> str:
    from opentinker.services.core.config import default_home

    return default_home()


def nats_url(args: argparse.Namespace) -> str:
    """--nats-url, else $NATS_URL, else a running `opentinker up`'s, else nats://127.0.0.1:4222."""
    from opentinker.services.core.config import default_nats_url

    return default_nats_url(args.nats_url)


def data_dir(args: argparse.Namespace) -> str:
    """--data-dir, else `<home>/data` (the recorder's Parquet log)."""
    return args.data_dir or str(Path(home()) / "data")


def console():
    """A rich console; when output is not a terminal (pipes, CI), wide enough that
    tables are never truncated."""
    from rich.console import Console

    c = Console()
    return c if c.is_terminal else Console(width=240)


def parse_value(raw: str) -> Any:
    """A TOML value (`3`, `0.5`, `true`, `"x"`, `[1, 2]`), else the raw string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def load_job_config(path: str, sets: list[str]) -> dict[str, Any]:
    """A job spec as plain data: the TOML file, then `--set a.b=value` overrides."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    for item in sets:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE")
        node = data
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = parse_value(raw)
    return data


def job_arg(job_id: str) -> str:
    """A job id checked as a subject token; exits naming the problem otherwise."""
    from opentinker.schemas.subjects import check_job_id

    try:
        return check_job_id(job_id)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def run_client(args: argparse.Namespace, body) -> int:
    """asyncio.run(body(args, nats_url)), against the embedded stack (started for the
    command and stopped after it) with --up, else the configured NATS server."""
    if not args.up:
        return asyncio.run(body(args, nats_url(args)))
    from opentinker.ops.stack import Stack

    stack = Stack(home(), nats_url=os.environ.get("NATS_URL") or None).start()
    print(f"stack up: NATS {stack.nats_url}, logs in {stack.log_dir}", flush=True)
    try:
        return asyncio.run(body(args, stack.nats_url))
    finally:
        stack.stop()
