"""A user's submit lock, across every scheduler on one NATS (every pool's).

A scheduler counts a user's unfinished jobs and writes the new record under it, so the
`max_unfinished_jobs_per_user` limit holds for submits that reach several schedulers at
once (two pools, or two schedulers of one pool); each scheduler's own asyncio lock only
orders the submits it takes itself.

The lock is a key of the S.KV_LOCKS bucket: JetStream's create-if-absent is the
acquire (it fails while another holds the key), a delete the release. A holder that
died frees it when the bucket's TTL (S.LOCK_TTL_S) removes the key.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import AsyncIterator

from nats.js.errors import KeyWrongLastSequenceError

from opentinker.schemas import subjects as S

WAIT_S = 10.0   # how long a submit waits for another holder
POLL_S = 0.02


@contextlib.asynccontextmanager
async def submit_lock(bus, user: str, exempt: bool = False) -> AsyncIterator[bool]:
    """Hold `user`'s submit lock for the block; yields True, or False when another
    holder kept it for WAIT_S (the block must then not count or write). `exempt` (an
    admin, who has no limit to count): no lock, True."""
    if exempt:
        yield True
        return
    kv = await bus.kv(S.KV_LOCKS)
    key = "submit." + hashlib.sha256(user.encode()).hexdigest()[:32]  # any name, a valid key
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            await kv.create(key, b"")
            break
        except KeyWrongLastSequenceError:
            if time.monotonic() > deadline:
                yield False
                return
            await asyncio.sleep(POLL_S)
    try:
        yield True
    finally:
        with contextlib.suppress(Exception):  # else the TTL frees it
            await kv.delete(key)
