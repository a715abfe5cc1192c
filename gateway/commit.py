"""The gateway's group commit: the requests that arrive while one write to Redis is in flight go
out together in the next, in one command (contract.enqueue) with a single scheduler wake-up, so
Redis round trips grow with time, not with the request rate. Under load a commit may wait a
moment for company (gateway/linger.py); a group that reaches `max_group` requests goes at once."""
from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from batchline.contract.gateway_store import GatewayStore

from batchline import contract, metrics
from batchline.contract.keys import ModelKey
from batchline.clock import now_us
from batchline.errors import BatchlineError, Internal, ResourceExhausted, Unavailable
from batchline.redis_client import REDIS_ERRORS, REDIS_REFUSALS, unreachable
from gateway.linger import Linger

log = logging.getLogger(__name__)

# A commit waits for company at most this share of the tightest budget among its requests.
LINGER_BUDGET_SHARE = 0.1
# A request refused because its queue is full is told to come back this much later.
QUEUE_FULL_RETRY_S = 0.1
# Removals of requests nobody waits for, kept for the next commit while Redis fails them (the
# newest; older ones are left to their keys' expiry), and how often they are tried alone.
ABANDONS_KEPT = 10_000
ABANDON_RETRY_S = 0.2


@dataclass(slots=True)
class _Waiting:
    """A write and the request waiting for it."""
    write: contract.QueueWrite
    deadline_us: int
    done: asyncio.Future


def _end_wait(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class GroupCommit:
    def __init__(self, store: GatewayStore, gateway_id: str, heartbeat_ttl_ms: int, linger_s: float,
                 in_flight: Callable[[], int], max_group: int = 0) -> None:
        self.store = store
        self.gateway_id = gateway_id
        self.address = ""  # written with every commit: executors skip a gateway without a heartbeat key
        self.heartbeat_ttl_ms = heartbeat_ttl_ms
        self.in_flight = in_flight  # requests in the gateway now: a busy gateway's commits wait for company
        self._outbox: list[_Waiting] = []
        self._abandoned: list[contract.Abandoned] = []
        self._abandoning: list[asyncio.Future] = []  # each abandoned request's: True once its removal landed
        self._flusher: asyncio.Task | None = None
        self._linger = Linger(linger_s)
        self._lingering: asyncio.Future | None = None  # a commit's wait for company, while it lasts
        self._linger_until = 0.0  # when that wait ends (loop time)
        self.max_group = max_group  # a group this large goes at once (0: no cap)
        self._landing: set[asyncio.Task] = set()  # groups sent at once, until Redis has answered

    async def write(self, write: contract.QueueWrite, deadline_us: int, run_budget_s: float) -> None:
        """Queue `write` with the next commit; returns once Redis has it, or raises why not
        (ResourceExhausted: its queue is full; Unavailable: Redis is unreachable or refusing)."""
        loop = asyncio.get_running_loop()
        waiting = _Waiting(write, deadline_us, loop.create_future())
        self._linger.arrived(now_us() / 1e6)
        self._outbox.append(waiting)
        if self.max_group and len(self._outbox) >= self.max_group and self._send_now():
            await waiting.done
            return
        if self._lingering is not None and loop.time() + run_budget_s * LINGER_BUDGET_SHARE < self._linger_until:
            _end_wait(self._lingering)  # a waiting commit must not spend more than its share of this budget
        self._kick()
        await waiting.done

    def abandon(self, request_id: str, model: ModelKey, member: bytes) -> asyncio.Future:
        """Remove a request nobody waits for any more, with the next commit (if Redis is gone,
        its keys expire on their own). The future says whether the removal landed (after the
        request's own write, if that was still going out)."""
        self._abandoned.append(contract.Abandoned(request_id, model, member))
        landed = asyncio.get_running_loop().create_future()
        self._abandoning.append(landed)
        self._kick()
        return landed

    def fail(self, error: BatchlineError) -> None:
        """Answer every write not yet committed with `error` (shutting down)."""
        for w in self._outbox:
            if not w.done.done():
                w.done.set_exception(error)

    def _send_now(self) -> bool:
        """Send the waiting group now, in the turn of the writer that filled it. The flusher is a task
        and runs only after every request read in this turn of the event loop: a burst (the callers
        of an answered batch sending again at once) would reach Redis whole, and the scheduler and
        the executors would start on none of it until the gateway had read all of it. False, with
        nothing sent, where the store cannot send at once."""
        sent_at = time.perf_counter()
        sent = self.store.enqueue_now(self.gateway_id, self.address, self.heartbeat_ttl_ms,
                                      [w.write for w in self._outbox])
        if sent is None:
            return False
        batch, self._outbox = self._outbox, []
        landing = asyncio.get_running_loop().create_task(self._land(batch, [], [], sent, sent_at),
                                                         context=contextvars.Context())
        self._landing.add(landing)
        landing.add_done_callback(self._landing.discard)
        return True

    def _kick(self) -> None:
        if self._flusher is None or self._flusher.done():
            # In a context of its own: it writes for every request, not for the one that started it
            # (whose log context, request id and all, it would otherwise carry).
            self._flusher = asyncio.get_running_loop().create_task(self._flush(), context=contextvars.Context())

    async def _flush(self) -> None:
        """Write everything queued for Redis in one command, until nothing is left."""
        while self._outbox or self._abandoned:
            if self._outbox:
                wait = self._linger.wait_s(self.in_flight())
                if wait:
                    await self._wait_for_company(wait)
                if not self._outbox and not self._abandoned:
                    continue  # sent meanwhile, by a writer that filled the group
            batch, self._outbox = self._outbox, []
            abandoned, self._abandoned = self._abandoned, []
            abandoning, self._abandoning = self._abandoning, []
            sent = self.store.enqueue(self.gateway_id, self.address, self.heartbeat_ttl_ms,
                                      [w.write for w in batch], abandoned)
            if not await self._land(batch, abandoned, abandoning, sent) and not self._outbox:
                await asyncio.sleep(ABANDON_RETRY_S)  # Redis is away: no tight loop of removals

    async def _land(self, batch: list[_Waiting], abandoned: list[contract.Abandoned],
                    abandoning: list[asyncio.Future], sent: Awaitable[list[int | Exception]],
                    sent_at: float | None = None) -> bool:
        """Tell each writer of a group sent to Redis how its write ended; whether Redis answered.
        `sent_at`: when a group sent at once went out (time.perf_counter), its round trip's start."""
        try:
            async with metrics.redis_rtt("gateway", "enqueue", sent_at):
                queued = await sent
        except Exception as exc:  # noqa: BLE001 - every writer must hear how its write ended
            error = _commit_error(exc)
            for w in batch:
                if not w.done.done():
                    w.done.set_exception(error)
            # The removals go again with the next commit: a request left in its queue would be run
            # (a generation to its end, its cache slot held) for nobody. Its keys expire meanwhile.
            dropped = max(0, len(abandoned) - max(0, ABANDONS_KEPT - len(self._abandoned)))
            self._abandoned[:0], self._abandoning[:0] = abandoned[dropped:], abandoning[dropped:]
            _settle(abandoning[:dropped], False)
            return False
        # (On a cluster a model's shard may have refused its part: those removals did not land.)
        for landed, ok in zip(abandoning, _abandon_results(abandoned, batch, queued)):
            _settle([landed], ok)
        refusals: dict[int, BatchlineError] = {}  # one per shard's error, logged once
        for w, ok in zip(batch, queued):
            if w.done.done():
                continue
            if isinstance(ok, Exception):  # its shard of a cluster refused it: not its neighbours
                if id(ok) not in refusals:
                    refusals[id(ok)] = _commit_error(ok)
                w.done.set_exception(refusals[id(ok)])
                continue
            if ok:
                w.done.set_result(None)
                continue
            name, version = w.write.model
            metrics.REJECTED.labels(name, version, "queue_full").inc()
            w.done.set_exception(ResourceExhausted(
                f"the queue of model '{name}' is full ({w.write.max_queue_size} requests, its "
                "max_queue_size): retry later", retry_after_s=QUEUE_FULL_RETRY_S))
        return True

    async def _wait_for_company(self, wait: float) -> None:
        """Let more requests join the next commit for `wait` s, or the tightest waiting budget's
        share; a request whose budget is tighter still cuts the wait short (see `write`)."""
        tightest_s = (min(w.deadline_us for w in self._outbox) - now_us()) / 1e6
        wait = min(wait, tightest_s * LINGER_BUDGET_SHARE)
        if wait <= 0:
            return
        loop = asyncio.get_running_loop()
        self._lingering = loop.create_future()
        self._linger_until = loop.time() + wait
        timer = loop.call_later(wait, _end_wait, self._lingering)
        try:
            await self._lingering
        finally:
            timer.cancel()
            self._lingering = None


def _settle(futures: list[asyncio.Future], landed: bool) -> None:
    for f in futures:
        if not f.done():
            f.set_result(landed)


def _abandon_results(abandoned: list[contract.Abandoned], batch: list[_Waiting], queued: list) -> list[bool]:
    """Whether each removal landed: not where a write of the same model failed with a shard's error
    (the removals go in the same script as the writes of their model)."""
    failed = {w.write.model for w, ok in zip(batch, queued) if isinstance(ok, Exception)}
    return [a.model not in failed for a in abandoned]


def _commit_error(exc: Exception) -> BatchlineError:
    if isinstance(exc, REDIS_ERRORS):
        return Unavailable(f"cannot queue the request: {unreachable(exc)}")
    if isinstance(exc, REDIS_REFUSALS):
        # Out of memory (maxmemory) or a replica mid-failover: the server's state, and passing.
        return Unavailable(f"cannot queue the request: Redis refuses writes right now ({exc}): retry")
    # The traceback from `exc` itself: a shard's error reaches here outside any except block.
    log.error("group commit failed: %s", exc, exc_info=exc)
    return Internal(f"cannot queue the request: {exc}")
