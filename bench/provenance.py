"""Where a results file came from: the machine, the time, the commit and whether the
working tree differed from it, and the command. Every bench script that writes
bench/results/*.json starts its record with `provenance()`, so a number in the README or
bench/RESULTS.md traces to the code that produced it (a `dirty` record did not run that
commit's code alone)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def git(*args: str) -> str:
    """`git ARGS` in the repository, stdout stripped ("" outside a git checkout)."""
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()
    except FileNotFoundError:  # no git on this machine
        return ""


def cpu() -> dict:
    """The host's processor as util-linux's `lscpu -J` reports it: {"model", "sockets",
    "cores_per_socket", "threads_per_core", "amx"} (two hosts that both read "x86_64 2
    cores" can differ here, and an overlapped async run with them); {} without lscpu."""
    try:
        out = subprocess.run(["lscpu", "-J"], capture_output=True, text=True, check=True, timeout=10).stdout
        fields = {row["field"].rstrip(":"): row.get("data") or "" for row in json.loads(out)["lscpu"]}
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, TypeError):
        return {}

    def count(name: str) -> int | None:
        return int(fields[name]) if fields.get(name, "").isdigit() else None

    return {"model": fields.get("Model name", ""), "sockets": count("Socket(s)"),
            "cores_per_socket": count("Core(s) per socket"), "threads_per_core": count("Thread(s) per core"),
            "amx": "amx_tile" in fields.get("Flags", "").split()}


def provenance(argv: list[str] | None = None) -> dict:
    """{"machine", "cpu" (cpu()), "python", "date" (local, minutes), "commit" (HEAD's full
    id), "dirty" (tracked files differ from HEAD), "command" (the script, relative to the
    repository, and its arguments)} for the running script (`argv`, default sys.argv)."""
    argv = sys.argv if argv is None else argv
    script = Path(argv[0]).resolve()
    name = script.relative_to(ROOT).as_posix() if script.is_relative_to(ROOT) else argv[0]
    return {"machine": f"{platform.machine()} {os.cpu_count()} cores", "cpu": cpu(),
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M"), "commit": git("rev-parse", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "command": " ".join([name, *argv[1:]])}


def commit_label(res: dict) -> str:
    """How a report names the code a results file `res` came from: "commit 0123abc", with
    " (uncommitted changes)" for a dirty record; when its seeds ran at different commits
    (`--append`), each commit with its seeds: "commits 0123abc (seed 0), 4567def (seeds 1, 2)"."""
    def one(commit, dirty) -> str:
        return f"{str(commit or '?')[:7]}" + (" (uncommitted changes)" if dirty else "")

    runs = [r for r in res.get("runs", []) if "commit" in r]
    labels: dict[str, list] = {}
    for r in runs:
        labels.setdefault(one(r["commit"], r.get("dirty")), []).append(r.get("seed"))
    if len(labels) > 1:
        return "commits " + ", ".join(f"{c} (seed{'s' if len(s) > 1 else ''} {', '.join(map(str, s))})"
                                      for c, s in labels.items())
    return "commit " + one(res.get("commit"), res.get("dirty"))
