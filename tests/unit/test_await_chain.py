"""`runner.await_chain`: where an asyncio task waits, every awaited coroutine down to
the future (what SIGUSR1 logs for each task of a service, runner.dump_stacks)."""

import asyncio

from opentinker.services.core.runner import await_chain


async def test_the_chain_names_each_awaited_coroutine_down_to_the_future():
    ev = asyncio.Event()

    async def inner_wait():
        await ev.wait()

    async def outer_step():
        await inner_wait()

    task = asyncio.create_task(outer_step())
    await asyncio.sleep(0)
    try:
        # asyncio's own stack of a suspended task stops at its first frame
        assert [f.f_code.co_name for f in task.get_stack()] == ["outer_step"]
        chain = "".join(await_chain(task))
        assert chain.index("outer_step") < chain.index("inner_wait") < chain.index("in wait"), chain
        assert "await inner_wait()" in chain and "suspended on <Future pending" in chain, chain
    finally:
        ev.set()
        await task
    assert await_chain(task) == []  # a finished task waits on nothing
