"""A user's submit lock, across every scheduler on one NATS (every pool's).

A scheduler counts a user's unfinished jobs and writes the new record under it, so the
`max_unfinished_jobs_per_user` limit holds for submits that reach several schedulers at
once (two pools, or two schedulers of one pool); each scheduler's own asyncio lock only
orders the submits it takes itself.

The lock is a key of the S.KV_LOCKS bucket: JetStream's create-if-absent is the
acquire (it fails while another holds the key), a delete the release. A holder that
died frees it when the bucket's TTL (S.LOCK_TTL_S) removes the key.

That TTL also frees the key of a holder that is alive but slow (a NATS outage in the
middle of its count, a long wait for its own scheduler's lock), and another scheduler
may then take it. So a hold is a lease: it must write within LEASE_S of its acquire,
LOCK_TTL_S less a margin for that write (a JetStream request, 5 s at most) and for
clock drift between this host and the server; past it, `Lease.expired()` is True and
the holder must not write (the scheduler refuses the submit, "try again").
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
LEASE_S = S.LOCK_TTL_S - 10.0  # how long after its acquire a holder may still write


class Lease:
    """A submit lock's hold: true when held (false when another holder kept it for
    WAIT_S); `expired()` once LEASE_S have passed since the acquire (never for an
    exempt holder)."""

    def __init__(self, held: bool, until: float):
        self.held, self.until = held, until

    def __bool__(self) -> bool:
        return self.held

    def expired(self) -> bool:
        return time.monotonic() > self.until


@contextlib.asynccontextmanager
async def submit_lock(bus, user: str, exempt: bool = False, lease_s: float = LEASE_S) -> AsyncIterator[Lease]:
    """Hold `user`'s submit lock for the block; yields a held Lease, or one that is not
    held when another holder kept it for WAIT_S (the block must then not count or
    write; nor once the lease has expired, `lease_s` after the acquire, at most
    LEASE_S). `exempt` (an admin, who has no limit to count): no lock, a held Lease
    that never expires."""
    if exempt:
        yield Lease(True, float("inf"))
        return
    kv = await bus.kv(S.KV_LOCKS)
    key = "submit." + hashlib.sha256(user.encode()).hexdigest()[:32]  # any name, a valid key
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            # the lease counts from before the create: the server's TTL from its write
            lease = Lease(True, time.monotonic() + min(lease_s, LEASE_S))
            await kv.create(key, b"")
            break
        except KeyWrongLastSequenceError:
            if time.monotonic() > deadline:
                yield Lease(False, 0.0)
                return
            await asyncio.sleep(POLL_S)
    try:
        yield lease
    finally:
        with contextlib.suppress(Exception):  # else the TTL frees it
            await kv.delete(key)
