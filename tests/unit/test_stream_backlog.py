"""A stream's unread answers (gateway/stream_backlog.py): bounded in bytes, driven by size."""
from __future__ import annotations

import asyncio

from batchline.protocol import inference_pb2 as ipb
from gateway.stream_backlog import StreamBacklog


def answer(size: int) -> ipb.ModelStreamInferResponse:
    return ipb.ModelStreamInferResponse(error_message="x" * size)


def test_room_closes_at_the_limit_and_opens_when_read_below_it():
    async def scenario() -> None:
        backlog = StreamBacklog(limit_bytes=1000)
        first, second = answer(600), answer(600)
        backlog.put(first)
        await asyncio.wait_for(backlog.room(), 1)  # 600 bytes: room
        backlog.put(second)
        assert backlog.bytes == first.ByteSize() + second.ByteSize()
        waiting = asyncio.create_task(backlog.room())
        await asyncio.sleep(0)
        assert not waiting.done(), "room with more than the limit unread"
        assert await backlog.get() is first
        await asyncio.wait_for(waiting, 1)
        assert await backlog.get() is second and backlog.bytes == 0

    asyncio.run(scenario())


def test_get_waits_for_an_answer_and_none_ends_the_stream():
    async def scenario() -> None:
        backlog = StreamBacklog(limit_bytes=1000)
        getting = asyncio.create_task(backlog.get())
        await asyncio.sleep(0)
        assert not getting.done()
        one = answer(10)
        backlog.put(one)
        backlog.put(None)
        assert await asyncio.wait_for(getting, 1) is one
        assert await backlog.get() is None

    asyncio.run(scenario())
