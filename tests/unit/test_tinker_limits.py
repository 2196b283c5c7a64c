"""The tinker service's per-user limits (services/tinker/sessions.py), on the Gateway's
own bookkeeping: operations and samples in flight until their future is retrieved
(count and bytes), long-polls at once. The same limits against the running services:
tests/adversarial/test_capacity.py."""

import asyncio

import pytest

from opentinker.services.core.config import Settings
from opentinker.services.tinker.sessions import ApiError, Gateway


def gateway(**limits) -> Gateway:
    return Gateway(bus=None, home="", settings=Settings(**limits))


def test_in_flight_is_counted_per_user_until_retrieved():
    gw = gateway(tinker_inflight_per_user=3, tinker_inflight_bytes_per_user=1000)
    for i in range(3):
        gw._admit("bob", f"ts-0123456789-m0.{i + 1}", 100)
    gw._admit("bob", "ts-0123456789-m0.1", 100)  # a resent request counts once
    with pytest.raises(ApiError, match="tinker_inflight_per_user = 3") as e:
        gw._admit("bob", "ts-0123456789-m0.4", 100)
    assert e.value.status == 429
    gw._admit("alice", "ts-aaaaaaaaaa-m0.1", 100)  # another user's room is her own
    gw._retrieved("bob", "ts-0123456789-m0.1", "ts-0123456789-m0", 1)
    gw._admit("bob", "ts-0123456789-m0.4", 100)
    with pytest.raises(ApiError, match="tinker_inflight_bytes_per_user = 1000"):
        gateway(tinker_inflight_bytes_per_user=1000)._admit("bob", "ts-0123456789-m0.1", 1001)
    # a retrieved future's op and result are purged later, a model's readiness never
    assert {subj for _, subj in gw._purges} == {"ot.job.ts-0123456789-m0.results.1", "ot.job.ts-0123456789-m0.ops.1"}
    gw._retrieved("bob", "ts-0123456789-m0.0", "ts-0123456789-m0", 0)
    assert len(gw._purges) == 2


def test_long_polls_are_capped_per_user():
    gw = gateway(tinker_polls_per_user=2)

    async def go():
        async with gw._poll_slot("bob", "retrieve_future"), gw._poll_slot("bob", "retrieve_future"):
            with pytest.raises(ApiError, match="tinker_polls_per_user = 2"):
                async with gw._poll_slot("bob", "retrieve_future"):
                    pass
            async with gw._poll_slot("alice", "retrieve_future"):
                pass
        async with gw._poll_slot("bob", "retrieve_future"):  # freed on exit
            pass
        assert not gw._polls

    asyncio.run(go())
