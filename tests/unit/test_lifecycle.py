"""stop_tasks: background loops end even when a cancellation is swallowed once."""
from __future__ import annotations

import asyncio

from batchline.lifecycle import stop_tasks


async def test_a_loop_that_swallows_a_cancellation_is_cancelled_again_until_it_ends():
    swallowed = 0

    async def stubborn():
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                # what a retry loop does when a client library turns the cancel into an error
                swallowed += 1
                if swallowed < 3:
                    continue
                raise

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    await stop_tasks([task], timeout=5)
    assert task.done() and task.cancelled()
    assert swallowed == 3


async def test_done_tasks_and_an_empty_list_return_at_once():
    done = asyncio.create_task(asyncio.sleep(0))
    await done
    await stop_tasks([done])
    await stop_tasks([])
