"""`opentinker tail SUBJECT [--history]`: a subject's messages as JSON lines, decoded
by their `Ot-Schema` header (the NATS CLI's `nats sub`, schema-aware)."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from opentinker.cli.common import nats_url


def tail_record(subject: str, headers: dict[str, str] | None, data: bytes, short: bool) -> dict[str, Any]:
    """One bus message as plain data: its subject, schema (the `Ot-Schema` header) and
    the decoded message, or the reason it does not decode. `short` cuts lists (token
    ids, logprobs) to their first 8 items."""
    import msgspec

    from opentinker.schemas import decode, schema_by_name
    from opentinker.schemas import subjects as S

    name = (headers or {}).get(S.H_SCHEMA, "")
    kind = schema_by_name(name) if name else None
    out: dict[str, Any] = {"subject": subject, "schema": name or None}
    if kind is None:
        out["error"] = f"no schema {name!r}" if name else "no Ot-Schema header"
        out["bytes"] = len(data)
        return out
    try:
        value = msgspec.to_builtins(decode(data, kind))
    except msgspec.MsgspecError as e:
        out["error"] = f"does not decode as {name}: {e}"
        return out
    out["data"] = _shorten(value) if short else value
    return out


def _shorten(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _shorten(x) for k, x in v.items()}
    if isinstance(v, list):
        head = [_shorten(x) for x in v[:8]]
        return head + [f"... {len(v) - 8} more"] if len(v) > 8 else head
    return v


def cmd_tail(args: argparse.Namespace) -> int:
    """Print the messages on SUBJECT (wildcards allowed) as JSON lines, decoded by their
    schema header: with --history first what the streams hold, then live ones."""
    import json

    from opentinker.services.core.bus import Bus

    async def run() -> int:
        bus = await Bus.connect(nats_url(args), "tail")
        printed = 0
        q: asyncio.Queue = asyncio.Queue()
        try:
            sub = await bus.nc.subscribe(args.subject, cb=q.put)
            if args.history:
                for m in await bus.read_raw(args.subject):
                    print(json.dumps(tail_record(m.subject, m.headers, m.data, args.short)), flush=True)
                    printed += 1
                    if args.count and printed >= args.count:
                        return 0
            while not args.count or printed < args.count:
                m = await q.get()
                print(json.dumps(tail_record(m.subject, m.headers, m.data, args.short)), flush=True)
                printed += 1
            await sub.unsubscribe()
        finally:
            await bus.close()
        return 0

    try:
        return asyncio.run(run())
    except KeyboardInterrupt:
        return 0


def register(sub) -> None:
    s = sub.add_parser("tail", help="print a subject's messages as JSON, decoded by their schema")
    s.add_argument("subject", help="e.g. 'ot.job.JOB.>' or 'ot.job.JOB.metrics'")
    s.add_argument("--history", action="store_true", help="first what the streams hold")
    s.add_argument("--count", type=int, default=0, help="stop after this many messages")
    s.add_argument("--short", action="store_true", help="cut long lists (token ids, logprobs) to 8 items")
    s.set_defaults(fn=cmd_tail)

