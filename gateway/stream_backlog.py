"""A ModelStreamInfer stream's answers waiting for its client to read them, bounded in bytes.

gRPC hands a stream's next answer to the transport only once the client's flow-control window
has room, so a client that sends and does not read would otherwise leave every answer of every
request it sent in the gateway's memory (a generation's tokens keep coming while it does not
read). Past LIMIT_BYTES unread, the stream's next request waits, and the one after it is not
read, until the client has taken enough: the client's own sends then wait in its transport, and
what the gateway holds is what the limit allows plus the answers of requests already in flight.
"""
from __future__ import annotations

import asyncio
from collections import deque

from batchline.protocol import inference_pb2 as ipb

LIMIT_BYTES = 64 * 1024 * 1024


class StreamBacklog:
    """Answers in the order they came; None ends the stream."""

    def __init__(self, limit_bytes: int = 0) -> None:
        self.limit_bytes = limit_bytes or LIMIT_BYTES
        self.bytes = 0
        self._items: deque[tuple[ipb.ModelStreamInferResponse | None, int]] = deque()
        self._ready = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()

    def put(self, item: ipb.ModelStreamInferResponse | None) -> None:
        size = item.ByteSize() if item is not None else 0
        self._items.append((item, size))
        self.bytes += size
        self._ready.set()
        if self.bytes >= self.limit_bytes:
            self._room.clear()

    async def get(self) -> ipb.ModelStreamInferResponse | None:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item, size = self._items.popleft()
        self.bytes -= size
        if self.bytes < self.limit_bytes:
            self._room.set()
        return item

    async def room(self) -> None:
        """Returns once fewer than limit_bytes wait to be read."""
        await self._room.wait()
