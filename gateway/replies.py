"""The answers a gateway waits for: one future per queued request, resolved from its reply list."""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

from batchline.contract.gateway_store import GatewayStore

from batchline import contract
from batchline.contract.keys import ModelKey
from batchline.errors import BatchlineError
from batchline.protocol import internal_pb2 as pb
from batchline.protocol import inference_pb2 as ipb
from batchline.redis_client import REDIS_ERRORS, WAIT_RETRY_S

log = logging.getLogger(__name__)

# Where a decoupled model's responses go as they arrive (called on the reader's task: it must not block).
PartialSink = Callable[[ipb.ModelInferResponse], None]

# Replies one read takes at most.
DRAIN = 10_000
# A new primary (a failover, or a restarted Redis) may lack a queued request's writes (replication
# is asynchronous). A request whose payload it lacks is lost unless its answer is already on the
# reply list: the reader gets this long to deliver such answers before the rest are failed.
RECONCILE_GRACE_S = 0.5
# On a Redis Cluster an answer the failed-over shard lost comes again from its executor once that
# sees the new primary: up to its check interval (0.5 s) after this gateway did, and a write later.
RECONCILE_GRACE_CLUSTER_S = 1.0
# Attempts to read which payloads a new primary holds, WAIT_RETRY_S apart.
RECONCILE_ATTEMPTS = 10


class Replies:
    def __init__(self, store: GatewayStore, gateway_id: str) -> None:
        self.store = store
        self.gateway_id = gateway_id
        self.key = contract.reply(gateway_id)
        self.waiting: dict[str, asyncio.Future] = {}  # request id -> its answer, for the requests queued
        # The waiting requests whose write Redis acknowledged, and their models (whose slot holds the payload).
        self.acknowledged: dict[str, ModelKey] = {}
        # A decoupled model's requests: where their responses go as they arrive, and the index of
        # the next one (a batch run twice sends its responses twice).
        self.partial: dict[str, tuple[PartialSink, int]] = {}
        # Requests nobody waits for any more whose late reply is still looked for (a sequence
        # request given up on: its reply says it ran). Not counted as waiting, nor failed.
        self.watched: dict[str, asyncio.Future] = {}

    def expect(self, request_id: str, on_partial: PartialSink | None = None) -> asyncio.Future:
        """The future of the request's (final) reply; `on_partial` takes the responses before it."""
        fut = self.waiting[request_id] = asyncio.get_running_loop().create_future()
        if on_partial is not None:
            self.partial[request_id] = (on_partial, 0)
        return fut

    def queued(self, request_id: str, model: ModelKey) -> None:
        """Redis acknowledged the request's write: from now on a primary without it has lost it.
        (Not when its answer came first, a fast executor's on a busy loop: nothing waits any more,
        and an entry made now would stay for good.)"""
        waiting = self.waiting.get(request_id)
        if waiting is not None and not waiting.done():
            self.acknowledged[request_id] = model

    def watch(self, request_id: str) -> asyncio.Future:
        """A future its reply will complete, for a request nobody waits for any more."""
        fut = self.watched[request_id] = asyncio.get_running_loop().create_future()
        return fut

    def unwatch(self, request_id: str) -> None:
        self.watched.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        self.waiting.pop(request_id, None)
        self.acknowledged.pop(request_id, None)
        self.partial.pop(request_id, None)

    async def reconcile(self, error: BatchlineError) -> int:
        """After a change of primary, answer `error` to each acknowledged request whose payload the
        new primary does not hold and whose answer does not arrive within RECONCILE_GRACE_S; the
        others are still served. Returns how many were answered so."""
        ids = list(self.acknowledged.items())
        for _ in range(RECONCILE_ATTEMPTS):
            try:
                held = await self.store.payloads_held(ids)
                break
            except REDIS_ERRORS as exc:
                log.warning("reading which queued requests the new Redis primary holds failed: %s", exc)
                await asyncio.sleep(WAIT_RETRY_S)
        else:
            return 0  # they wait for their answers or their deadlines
        missing = [request_id for (request_id, _), n in zip(ids, held) if not n]
        if missing:
            await asyncio.sleep(RECONCILE_GRACE_CLUSTER_S if contract.on_cluster(self.store.client)
                                else RECONCILE_GRACE_S)
        lost = 0
        for request_id in missing:
            fut = self.waiting.get(request_id)
            if fut is not None and not fut.done():
                fut.set_exception(error)
                lost += 1
        return lost

    def fail(self, error: BatchlineError) -> None:
        """Answer every waiting request with `error` (shutdown, or Redis lost: its replies may never come)."""
        for fut in self.waiting.values():
            if not fut.done():
                fut.set_exception(error)

    async def read(self) -> None:
        """Read the reply list for as long as the gateway runs (its own task)."""
        pop = self.store.list_pop()
        while True:
            try:
                item = await pop([self.key], DRAIN)
            except REDIS_ERRORS as exc:
                log.warning("reading replies failed: %s", exc)
                await asyncio.sleep(WAIT_RETRY_S)
                continue
            if item is None:
                continue
            blobs = item[1]
            if not pop.all_at_once:
                try:
                    blobs += await self.store.pop_replies(self.gateway_id, DRAIN)
                except REDIS_ERRORS as exc:
                    # The first is already off the list: answer it whatever happens to the rest.
                    log.warning("reading replies failed: %s", exc)
            for blob in blobs:
                self._answer(blob)

    def _answer(self, blob: bytes) -> None:
        try:
            reply = pb.Reply.FromString(blob)
        except Exception:  # one unreadable reply must not stop the reader
            log.exception("an unreadable reply (%d bytes) was dropped", len(blob))
            return
        if reply.partial:
            self._forward(reply)
            return
        self.partial.pop(reply.request_id, None)
        fut = self.waiting.pop(reply.request_id, None)
        self.acknowledged.pop(reply.request_id, None)
        # A second answer to the same request (a batch re-dispatched
        # while the first executor was only slow) finds no future.
        if fut is None:
            fut = self.watched.pop(reply.request_id, None)
        if fut is not None and not fut.done():
            fut.set_result(reply)

    def _forward(self, reply: pb.Reply) -> None:
        """A decoupled model's response: to its request's sink, once, in order."""
        sink, expected = self.partial.get(reply.request_id, (None, 0))
        if sink is None or reply.index < expected:
            return  # nobody waits, or sent already (by a run of its batch before this one)
        self.partial[reply.request_id] = (sink, reply.index + 1)
        try:
            sink(reply.response)
        except Exception:  # one client's sink must not stop the reader
            log.exception("forwarding a response of request %s failed", reply.request_id)
