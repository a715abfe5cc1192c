"""A REST client that hangs up while its request waits: ASGI tells an app of a disconnect only
through a receive() it makes, so one is awaited beside a unary inference, and the inference
cancelled when the client goes. queue_and_wait then takes the request back out of the queue, as it
does for a cancelled gRPC call: no executor runs a request whose answer nobody would read."""
from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

T = TypeVar("T")


class ClientGone(Exception):
    """The client hung up before its answer: there is nobody to send one to."""


async def _cancel_when_gone(receive, task: asyncio.Task) -> None:
    # The body has been read: what receive() answers next is the disconnect (uvicorn wakes it
    # with nothing else), or nothing until the watch is cancelled with the answer.
    while (await receive())["type"] != "http.disconnect":
        pass
    task.cancel()


async def unless_gone(receive, answer: Awaitable[T]) -> T:
    """`answer` awaited in this task, cancelled if the client hangs up first (raising ClientGone).
    One task watches: cheaper than running `answer` in a task of its own and waiting on both
    (asyncio.wait), measured in docs/design/rest.md."""
    handler = asyncio.current_task()
    assert handler is not None
    watch = asyncio.create_task(_cancel_when_gone(receive, handler))
    try:
        return await answer
    except asyncio.CancelledError:
        # Ours only if the watch ended by cancelling, and nobody else (the server stopping) did too.
        if watch.done() and not watch.cancelled() and watch.exception() is None and handler.uncancel() == 0:
            raise ClientGone() from None
        raise
    finally:
        watch.cancel()
