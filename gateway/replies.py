"""The answers a gateway waits for: one future per queued request, resolved from its reply list."""
from __future__ import annotations

import asyncio
import logging

from redis.asyncio import Redis

from batchline import contract
from batchline.errors import BatchlineError
from batchline.protocol import internal_pb2 as pb
from batchline.redis_client import REDIS_ERRORS, ListPop

log = logging.getLogger(__name__)

# Replies one read takes at most.
DRAIN = 10_000
# After a failed read of the reply list, the next one begins this much later.
RETRY_S = 0.2


class Replies:
    def __init__(self, redis: Redis, blocking: Redis, gateway_id: str) -> None:
        self.redis = redis
        self.blocking = blocking
        self.key = contract.reply(gateway_id)
        self.waiting: dict[str, asyncio.Future] = {}  # request id -> its answer, for the requests queued

    def expect(self, request_id: str) -> asyncio.Future:
        fut = self.waiting[request_id] = asyncio.get_running_loop().create_future()
        return fut

    def forget(self, request_id: str) -> None:
        self.waiting.pop(request_id, None)

    def fail(self, error: BatchlineError) -> None:
        """Answer every waiting request with `error` (shutdown, or Redis lost: its replies may never come)."""
        for fut in self.waiting.values():
            if not fut.done():
                fut.set_exception(error)

    async def read(self) -> None:
        """Read the reply list for as long as the gateway runs (its own task)."""
        pop = ListPop(self.blocking)
        while True:
            try:
                item = await pop([self.key], DRAIN)
            except REDIS_ERRORS as exc:
                log.warning("reading replies failed: %s", exc)
                await asyncio.sleep(RETRY_S)
                continue
            if item is None:
                continue
            blobs = item[1]
            if not pop.all_at_once:
                try:
                    blobs += await self.redis.lpop(self.key, DRAIN) or []
                except REDIS_ERRORS as exc:
                    # The first is already off the list: answer it whatever happens to the rest.
                    log.warning("reading replies failed: %s", exc)
            for blob in blobs:
                self._answer(blob)

    def _answer(self, blob: bytes) -> None:
        try:
            reply = pb.Reply.FromString(blob)
        except Exception:  # noqa: BLE001 - one unreadable reply must not stop the reader
            log.exception("an unreadable reply (%d bytes) was dropped", len(blob))
            return
        fut = self.waiting.pop(reply.request_id, None)
        # A second answer to the same request (a batch re-dispatched
        # while the first executor was only slow) finds no future.
        if fut is not None and not fut.done():
            fut.set_result(reply)
