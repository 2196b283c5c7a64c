"""Where a results file came from: the machine, the time, the commit and whether the
working tree differed from it, and the command. Every bench script that writes
bench/results/*.json starts its record with `provenance()`, so a number in the README or
bench/RESULTS.md traces to the code that produced it (a `dirty` record did not run that
commit's code alone)."""

from __future__ import annotations

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


def provenance(argv: list[str] | None = None) -> dict:
    """{"machine", "python", "date" (local, minutes), "commit" (HEAD's full id), "dirty"
    (tracked files differ from HEAD), "command" (the script, relative to the repository,
    and its arguments)} for the running script (`argv`, default sys.argv)."""
    argv = sys.argv if argv is None else argv
    script = Path(argv[0]).resolve()
    name = script.relative_to(ROOT).as_posix() if script.is_relative_to(ROOT) else argv[0]
    return {"machine": f"{platform.machine()} {os.cpu_count()} cores", "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M"), "commit": git("rev-parse", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "command": " ".join([name, *argv[1:]])}


def commit_label(res: dict) -> str:
    """"commit 0123abc", with " (uncommitted changes)" for a dirty record: how a report
    names the code a results file `res` came from."""
    return f"commit {str(res.get('commit') or '?')[:7]}" + (" (uncommitted changes)" if res.get("dirty") else "")
