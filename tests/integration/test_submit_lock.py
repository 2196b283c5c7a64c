"""A user's submit lock (scheduler/locks.py) on a real nats-server: one holder at a time
across connections (two schedulers), a waiter let in when the holder releases, a waiter
that gives up after WAIT_S told so, other users and admins not held up."""

import asyncio
import uuid

from opentinker.services.core.bus import Bus
from opentinker.services.scheduler import locks
from opentinker.services.scheduler.locks import submit_lock


async def test_one_holder_of_a_users_lock_at_a_time_across_connections(nats_url, monkeypatch):
    monkeypatch.setattr(locks, "WAIT_S", 0.5)
    bob, carol = f"bob-{uuid.uuid4().hex[:8]}", f"carol-{uuid.uuid4().hex[:8]}"  # the session's NATS is shared
    one, two = await Bus.connect(nats_url, "lock-a"), await Bus.connect(nats_url, "lock-b")
    try:
        await one.ensure_topology()
        async with submit_lock(one, bob) as held:
            assert held
            async with submit_lock(two, bob) as other:
                assert not other  # gave up after WAIT_S
            async with submit_lock(two, carol) as other, submit_lock(two, bob, exempt=True) as admin:
                assert other and admin  # another user's, and no lock for an admin

        async def hold_then_release() -> None:
            async with submit_lock(one, bob) as got:
                assert got
                await asyncio.sleep(0.3)

        monkeypatch.setattr(locks, "WAIT_S", 5.0)
        holder = asyncio.create_task(hold_then_release())
        await asyncio.sleep(0.1)
        async with submit_lock(two, bob) as held:  # waits for the release, then holds it
            assert held and holder.done()
    finally:
        await one.close()
        await two.close()


async def test_a_hold_past_its_lease_is_expired_before_the_ttl_frees_it(nats_url, monkeypatch):
    """A holder slower than LEASE_S (less than the bucket's TTL, which would free the key
    for another scheduler) is told its lease expired, so it writes nothing."""
    assert locks.LEASE_S <= locks.S.LOCK_TTL_S - 5.0  # room for the write and clock drift
    monkeypatch.setattr(locks, "LEASE_S", 0.3)
    dana = f"dana-{uuid.uuid4().hex[:8]}"
    bus = await Bus.connect(nats_url, "lock-lease")
    try:
        await bus.ensure_topology()
        async with submit_lock(bus, dana) as held:
            assert held and not held.expired()
            await asyncio.sleep(0.4)
            assert held.expired()
        async with submit_lock(bus, dana, exempt=True) as admin:
            await asyncio.sleep(0.4)
            assert admin and not admin.expired()
    finally:
        await bus.close()
