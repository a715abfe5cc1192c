"""A call's way through Redis and back: written with the next group commit (gateway/commit.py),
its reply awaited on this gateway's reply list (gateway/replies.py) within its budget, and, when
it ends otherwise (timed out, cancelled, refused, Redis gone), taken back out of the queue so no
executor spends time on a request nobody waits for."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

from batchline import contract, logs, metrics, telemetry, tracecontext
from batchline.clock import now_us
from batchline.contract.gateway_store import GatewayStore
from batchline.errors import DeadlineExceeded, ResourceExhausted, duration_text
from batchline.protocol import internal_pb2 as pb
from gateway.commit import GroupCommit
from gateway.ledger import Ticket
from gateway.replies import PartialSink, Replies
from gateway.request import Call, queue_entry
from gateway.sequences import Turn

log = logging.getLogger(__name__)


class Queueing:
    def __init__(self, gateway_id: str, commit: GroupCommit, replies: Replies, store: GatewayStore) -> None:
        self.gateway_id = gateway_id
        self.store = store
        self.settling: set[asyncio.Task] = set()  # sequence requests given up on, until their fate is known
        self.commit = commit
        self.replies = replies

    async def copied_and_queued(self, call: Call, ticket: Ticket | None, traceparent: str, tracestate: str,
                                started: float) -> pb.Reply:
        """The request queued again with its inputs' bytes copied in: an executor could not read the
        regions it references (it runs on another host, or a key names another file now). In the
        time left of its budget."""
        assert call.copied is not None
        spent = time.perf_counter() - started
        if spent >= call.run_budget_s:
            raise DeadlineExceeded(f"no answer from model '{call.model.name}' within the "
                                   f"{duration_text(call.budget_s)} budget")
        request, payload = call.copied()
        log.info("request to model %r: an executor could not read its shared memory regions; queued again with "
                 "their bytes", call.model.name)
        call = replace(call, request=request, payload=payload, copied=None, budget_s=call.budget_s - spent,
                       run_budget_s=call.run_budget_s - spent)
        return await self.queue_and_wait(call, ticket, traceparent, tracestate, started)

    async def queue_and_wait(self, call: Call, ticket: Ticket | None, traceparent: str, tracestate: str,
                             started: float, on_partial: PartialSink | None = None,
                             turn: Turn | None = None) -> pb.Reply:
        """Write the request to Redis with the next group commit and wait for its reply. `turn`: a
        sequence request's, held when it gives up while an executor may still run it."""
        enqueued = now_us()
        deadline = enqueued + int(call.run_budget_s * 1e6)
        entry = queue_entry(call, self.gateway_id, enqueued, deadline, traceparent, tracestate)
        if not logs.structured():
            return await self._write_and_wait(call, entry, enqueued, deadline, ticket, started, on_partial, turn)
        with logs.context(request_id=entry.request_id, trace_id=tracecontext.trace_id(entry.traceparent) or ""):
            return await self._write_and_wait(call, entry, enqueued, deadline, ticket, started, on_partial, turn)

    async def _write_and_wait(self, call: Call, entry: pb.QueueEntry, enqueued: int, deadline: int,
                              ticket: Ticket | None, started: float, on_partial: PartialSink | None,
                              turn: Turn | None) -> pb.Reply:
        """`started`: the request's arrival (perf_counter), where its enqueue stage begins."""
        member = entry.SerializeToString()
        fut = self.replies.expect(entry.request_id, on_partial if call.model.decoupled else None)
        if ticket is not None:
            ticket.queued(enqueued)
        write = contract.QueueWrite(entry.request_id, call.key, call.payload or call.request.SerializeToString(),
                                    contract.payload_ttl_ms(deadline, enqueued), member,
                                    contract.queue_score(call.priority, deadline), call.model.max_queue_size)
        committed = False
        try:
            if telemetry.enabled():
                with telemetry.tracer("batchline.gateway").start_as_current_span("enqueue"):
                    await self.commit.write(write, deadline, call.run_budget_s)
            else:
                await self.commit.write(write, deadline, call.run_budget_s)
            committed = True
            self.replies.queued(entry.request_id, write.model)
            metrics.STAGE_ENQUEUE.labels(*call.key).observe(time.perf_counter() - started)
            if ticket is not None:
                ticket.confirmed(now_us())
            # A timer on the reply's own future rather than asyncio.wait_for, which wraps every
            # request's wait in more futures and callbacks: the gateway's CPU is what small models
            # are bound by.
            timer = asyncio.get_running_loop().call_later(
                max(0.0, enqueued / 1e6 + call.budget_s - time.time()), _time_out, fut)
            try:
                reply = await fut
            except asyncio.TimeoutError:
                raise DeadlineExceeded(
                    f"no answer from model '{call.model.name}' within the {duration_text(call.budget_s)} budget"
                ) from None
            finally:
                timer.cancel()
            if reply.ran_until_us:
                # Measured once this coroutine runs again, so a busy event loop shows up here.
                metrics.STAGE_REPLY.labels(*call.key).observe(max(0, now_us() - reply.ran_until_us) / 1e6)
            return reply
        except BaseException as exc:
            # Timed out, cancelled by the client, refused, or Redis failed: make
            # sure no executor spends time on a request nobody waits for.
            if ticket is not None and now_us() >= deadline:
                # Unanswered at its deadline, whether our timer or the client's (a cancellation) fired first.
                ticket.over(in_time=False)
            self.replies.forget(entry.request_id)
            # (Reading its exception retrieves one an outage set while we were still queueing: answered.)
            ran = fut.done() and not fut.cancelled() and fut.exception() is None
            refused = isinstance(exc, ResourceExhausted) and not committed  # its queue was full
            if turn is None or ran or refused:
                self.commit.abandon(entry.request_id, call.key, member)
            else:
                # Its late reply must find a future from now on (the reader may run before the task).
                ghost = self.replies.watch(entry.request_id)
                settle = asyncio.ensure_future(self._settle(call, entry, member, committed, ghost))
                self.settling.add(settle)
                settle.add_done_callback(self.settling.discard)
                turn.hold(settle)
            raise

    async def _settle(self, call: Call, entry: pb.QueueEntry, member: bytes, committed: bool,
                      ghost: asyncio.Future) -> None:
        """A sequence request given up on: over once no run of it can change its sequence's state
        (taken out of its queue before any dispatch; or its payload removed, which a run's save of
        the state needs: scripts.SAVE_SEQUENCES_LUA), once its reply comes (it was dispatched: its
        payload stays, and its executor answers it, run or refused past its deadline), or at the
        latest once its run would have ended (an executor starts nothing past its deadline: its
        deadline plus its budget)."""
        try:
            removed = False
            bound_s = entry.deadline_us / 1e6 + call.run_budget_s - time.time()
            if committed:
                try:
                    removed = await self.store.withdraw(call.key, entry.request_id, member)
                except Exception as exc:  # noqa: BLE001 - the commit removes it, and the turn waits for that
                    log.warning("withdrawing sequence request %s failed: %s", entry.request_id, exc)
                    removed = await _landed(self.commit.abandon(entry.request_id, call.key, member), bound_s)
            else:
                # Given up while its write was going out: removed after it, if it lands.
                removed = await _landed(self.commit.abandon(entry.request_id, call.key, member), bound_s)
            if not removed:
                bound_s = entry.deadline_us / 1e6 + call.run_budget_s - time.time()
                try:
                    await asyncio.wait_for(asyncio.shield(ghost), max(0.0, bound_s))
                except asyncio.TimeoutError:
                    # No reply by when its run would have ended: its payload goes before the next
                    # request does, so that a run still going (a stalled executor) cannot save a
                    # state behind that request's back.
                    await self.commit.abandon(entry.request_id, call.key, member)
        finally:
            self.replies.unwatch(entry.request_id)


async def _landed(removal: asyncio.Future, within_s: float) -> bool:
    """Whether a removal (GroupCommit.abandon) landed within `within_s` (a Redis away for longer: no)."""
    try:
        return await asyncio.wait_for(asyncio.shield(removal), max(0.0, within_s))
    except asyncio.TimeoutError:
        return False


def _time_out(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(asyncio.TimeoutError())
