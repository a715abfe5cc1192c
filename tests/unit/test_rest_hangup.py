"""A REST client hanging up mid-inference (gateway/rest_hangup.py), with a connection's receive()
as uvicorn's is once the body has been read: it answers only when the client goes."""
from __future__ import annotations

import asyncio

import pytest

from gateway.rest_hangup import ClientGone, unless_gone


class _Connection:
    def __init__(self) -> None:
        self.closed = asyncio.Event()
        self.reads = 0

    async def receive(self) -> dict:
        self.reads += 1
        await self.closed.wait()
        return {"type": "http.disconnect"}


def _others() -> set[asyncio.Task]:
    return asyncio.all_tasks() - {asyncio.current_task()}


async def test_an_answer_in_time_leaves_no_watch_behind():
    connection = _Connection()
    assert await unless_gone(connection.receive, asyncio.sleep(0, "answer")) == "answer"
    assert connection.reads == 1
    await asyncio.sleep(0)  # the watch's cancellation is delivered
    assert not _others()


async def test_a_hang_up_cancels_the_inference_and_raises_client_gone():
    connection = _Connection()
    cancelled = asyncio.Event()

    async def queued() -> str:
        try:
            await asyncio.Event().wait()  # never answered
        except asyncio.CancelledError:
            cancelled.set()  # where queue_and_wait withdraws the request
            raise
        return "never"

    async def handler() -> None:
        with pytest.raises(ClientGone):
            await unless_gone(connection.receive, queued())
        # Not left cancelled: the app's next await (none here) would go on.
        assert asyncio.current_task().cancelling() == 0
        await asyncio.sleep(0)

    task = asyncio.create_task(handler())
    await asyncio.sleep(0)
    connection.closed.set()
    await task
    assert cancelled.is_set() and not _others()


async def test_the_servers_cancellation_is_not_taken_for_a_hang_up():
    connection = _Connection()
    inference = asyncio.Event()

    async def handler() -> None:
        await unless_gone(connection.receive, inference.wait())

    task = asyncio.create_task(handler())
    await asyncio.sleep(0)
    connection.closed.set()
    await asyncio.sleep(0)
    assert task.cancelling() == 1  # by the watch, for the hang-up
    # The server stops too before the handler runs again: it ends cancelled, as the server asked.
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0)
    assert not _others()
