"""Every generation stream's write of one model on an executor, gathered into one Redis round trip.

After an engine step every running sequence's consumer wakes in the same turn of the event loop;
those whose tokens are due to go each ask for a write here, and the writes asked for in one turn
go together in the next: one pipeline of every stream's push, record of the tokens sent and
check that its request is still awaited. So Redis sees a round trip per step that has writes, not
one per stream.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from dataclasses import dataclass

from batchline.clock import now_us
from batchline.contract import keys as k
from batchline.contract.executor_store import ExecutorStore
from batchline.contract.keys import ModelKey
from batchline.redis_client import REDIS_ERRORS, WAIT_RETRY_S

log = logging.getLogger(__name__)

# How long a write keeps trying through a Redis outage before the streams in it end with the error
# (their batches then go back to their queues by recovery, and continue elsewhere).
REDIS_PATIENCE_S = 5.0


@dataclass
class _Write:
    gateway_id: str
    replies: list[bytes]  # serialized Replies to push
    request_id: str
    sent: bytes  # every token id sent so far, int64
    watch_gateway: bool  # whether the gateway's heartbeat counts in "still awaited"
    record_ttl_s: int  # how long the record of `sent` lives: as long as the request can be taken over
    done: asyncio.Future


class StreamWrites:
    def __init__(self, store: ExecutorStore, model: ModelKey) -> None:
        self.store = store
        self.model = model
        self.round_trips = 0
        self._asked: list[_Write] = []
        self._tasks: set[asyncio.Task] = set()

    @property
    def asked(self) -> bool:
        """Whether a write has been asked for in this turn of the loop (one more joins it for free)."""
        return bool(self._asked)

    async def write(self, gateway_id: str, replies: list[bytes], request_id: str, sent: bytes,
                    watch_gateway: bool, deadline_us: int = 0) -> bool:
        """Push `replies` to the gateway and record `sent`, with the other writes asked for in this turn
        of the loop; whether the request is still awaited. The record lives as long as the request's
        payload may (`deadline_us`, its deadline; 0: none), so that an executor taking the request
        over at any time before then continues after the tokens sent rather than from the start."""
        loop = asyncio.get_running_loop()
        if not self._asked:
            loop.call_soon(self._start)
        ttl_s = max(k.REPLY_TTL, -(-k.payload_ttl_ms(deadline_us, now_us()) // 1000)) if deadline_us else k.REPLY_TTL
        write = _Write(gateway_id, replies, request_id, sent, watch_gateway, ttl_s, loop.create_future())
        self._asked.append(write)
        return await write.done

    def _start(self) -> None:
        writes, self._asked = self._asked, []
        task = asyncio.create_task(self._send(writes))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, writes: list[_Write]) -> None:
        replies: dict[str, list[bytes]] = defaultdict(list)
        for w in writes:
            if w.replies:
                replies[w.gateway_id] += w.replies
        give_up = time.monotonic() + REDIS_PATIENCE_S
        while True:
            self.round_trips += 1
            try:
                found = await self.store.stream_tokens(
                    self.model, replies, {w.request_id: w.sent for w in writes},
                    {w.request_id: w.gateway_id for w in writes if w.watch_gateway},
                    {w.request_id: w.record_ttl_s for w in writes})
                break
            except REDIS_ERRORS as exc:
                # A dropped connection (Redis failing over) must not end the streams: the same write again
                # (a response pushed twice is dropped by the gateway, which forwards each index once).
                if time.monotonic() < give_up:
                    log.warning("generation writes of %s:%s: Redis failed (%s); trying again", *self.model, exc)
                    await asyncio.sleep(WAIT_RETRY_S)
                    continue
                self._fail(writes, exc)
                return
            except Exception as exc:  # noqa: BLE001 - each stream's own write fails with it
                self._fail(writes, exc)
                return
        for w in writes:
            if not w.done.done():
                w.done.set_result(found[w.request_id])

    @staticmethod
    def _fail(writes: list[_Write], exc: Exception) -> None:
        for w in writes:
            if not w.done.done():
                w.done.set_exception(exc)
