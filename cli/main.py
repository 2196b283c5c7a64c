"""`opentinker`'s argument parser: each command module registers its own sub-commands."""

from __future__ import annotations

import argparse
import sys

from opentinker.cli import infer, jobs, log, ops, tail, train

MODULES = (train, infer, jobs, log, tail, ops)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="opentinker", description="Agentic RL for LLMs, as a service.")
    p.add_argument("--nats-url", help="NATS server (default: $NATS_URL, a running `opentinker up`, "
                                      "or nats://127.0.0.1:4222)")
    sub = p.add_subparsers(dest="cmd", required=True)
    for m in MODULES:
        m.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # argparse's REMAINDER drops a leading option (`serve-model --adapter X` ->
    # "unrecognized arguments"), so pass-through commands are split off before parsing
    cut = next((i for i, a in enumerate(argv)
                if a in ops.PASSTHROUGH and (i == 0 or argv[i - 1] != "--nats-url")), None)
    if cut is not None:
        args = build_parser().parse_args(argv[:cut + 1])
        args.rest = argv[cut + 1:]
    else:
        args = build_parser().parse_args(argv)
    if args.cmd in ("serve", "envhost"):
        sys.argv = [f"opentinker {args.cmd}", *args.rest]
    try:
        return args.fn(args) or 0
    except ModuleNotFoundError as e:
        # a client-only install runs the user commands; the others need an extra
        top = (e.name or "").split(".")[0]
        if not top or top == "opentinker" or args.cmd == "upstream":  # upstream: the script's own import
            raise
        raise SystemExit(f"opentinker {args.cmd}: the Python package {top!r} is not installed; this command needs "
                         "an extra of opentinker (pip install 'opentinker[server]', or [plot], [wandb])") from None
