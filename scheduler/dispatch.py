"""What a scheduling step writes: batches sent to executors and requests shed, queued on the
step's pipeline (one Redis round trip per step), then booked once Redis has run them."""
from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

import grpc

from batchline import contract, logs, metrics, telemetry, tracecontext
from batchline.contract.keys import ModelKey
from batchline.contract.scheduler_store import StepWrites
from batchline.clock import now_us
from batchline.errors import duration_text
from batchline.histograms import observe_each
from batchline.planning import Pending
from batchline.protocol import internal_pb2 as pb
from scheduler.policy import PlannedBatch

log = logging.getLogger(__name__)
_tracer = telemetry.tracer("batchline.scheduler")

@dataclass(slots=True)
class Sent:
    """A dispatch queued on a step's writes, booked once Redis has run it."""
    batch_id: str
    executor_id: str
    planned: PlannedBatch
    entries: list[pb.QueueEntry]
    dispatched_us: int
    span: Any  # the batch's span (tracing on), ended once the dispatch is written


def send(writes: StepWrites, key: ModelKey, executor_id: str, planned: PlannedBatch,
         entries: list[pb.QueueEntry]) -> Sent:
    """Queue on `writes` the dispatch of `planned` (its members' queue `entries`) to `executor_id`."""
    batch_id = uuid.uuid4().hex
    dispatched_us = now_us()
    span = None
    if telemetry.enabled():
        # The batch is a trace of its own, linked to every member's request span.
        links = [lk for lk in (telemetry.link(e.traceparent, e.tracestate) for e in entries) if lk]
        span = _tracer.start_span("batch", context=telemetry.extract(""), links=links, attributes={
            "batchline.model": key[0], "batchline.model_version": key[1], "batchline.batch_size": planned.rows,
            "batchline.requests": len(entries), "batchline.dispatch_reason": planned.reason,
            "batchline.min_slack_ms": planned.slack * 1e3, "batchline.executor_id": executor_id,
        })
    batch = pb.Batch(
        batch_id=batch_id, model_name=key[0], model_version=key[1], executor_id=executor_id,
        dispatched_us=dispatched_us, reason=planned.reason, attempt=1,
        traceparent=(telemetry.inject(span)[0] if span else "") or tracecontext.child(None),
    )
    members = [m.member for m in planned.members]
    writes.dispatch(batch, members, contract.payload_ttl_ms(max(e.deadline_us for e in entries), dispatched_us),
                    with_members(batch, members))
    return Sent(batch_id, executor_id, planned, entries, dispatched_us, span)


# Batch.members (field 4), a length-delimited field: its tag byte.
_MEMBERS_TAG = bytes([4 << 3 | 2])


def with_members(batch: pb.Batch, members: list[bytes]) -> bytes:
    """The bytes of `batch` (no members of its own) with `members` (QueueEntry bytes, as queued) as its
    members: each queue member is already its QueueEntry's encoding, so they are appended as they
    are rather than parsed, copied into the Batch and encoded again (a repeated field's elements
    may follow the other fields; parsing keeps their order)."""
    parts = [batch.SerializeToString()]
    for m in members:
        parts += (_MEMBERS_TAG, _varint(len(m)), m)
    return b"".join(parts)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def book(key: ModelKey, sent: Sent, taken: int, counts: Counter) -> bool:
    """Count a dispatch Redis has run (`taken`: members it moved). False: every member had left
    the queue, nothing was dispatched."""
    if not taken:
        return False
    planned = sent.planned
    counts["batches"] += 1
    counts["requests"] += int(taken)
    counts[f"reason:{planned.reason}"] += 1
    metrics.BATCHES_DISPATCHED.labels(key[0], key[1], planned.reason).inc()
    metrics.BATCH_SIZE.labels(key[0], key[1]).observe(planned.rows)
    metrics.DISPATCH_SLACK.labels(key[0], key[1]).observe(planned.slack)  # negative: late, in the le="0" bucket
    dispatched_us = sent.dispatched_us
    observe_each(metrics.STAGE_QUEUE.labels(*key), [max(0, dispatched_us - e.enqueued_us) / 1e6 for e in sent.entries])
    if sent.span is not None:
        for m, e in zip(planned.members, sent.entries):
            telemetry.record_span(
                _tracer, "queue_wait", e.enqueued_us, sent.dispatched_us,
                context=telemetry.extract(e.traceparent, e.tracestate),
                attributes={"batchline.batch_id": sent.batch_id, "batchline.dispatch_reason": planned.reason,
                            "batchline.slack_ms": (m.deadline - planned.finish) * 1e3},
            )
    if log.isEnabledFor(logging.DEBUG):
        with logs.context(batch_id=sent.batch_id):
            log.debug("%s:%s batch of %d rows (%s) -> %s", key[0], key[1], planned.rows, planned.reason,
                      sent.executor_id)
    return True


def shed(writes: StepWrites, key: ModelKey, expired: list[Pending], entries: dict[bytes, pb.QueueEntry]) -> None:
    """Queue on `writes` the answers to requests that cannot make their deadline, and their removal."""
    now = time.time()
    replies: dict[str, list[pb.Reply]] = {}
    for p in expired:
        # The time it had to be run in: its budget less the gateway's answer margin.
        budget = f"{duration_text(p.deadline - p.enqueued)} it had to run in"
        why = (f"the {budget} ran out in the queue of model '{key[0]}'" if p.deadline <= now else
               f"the {budget} cannot be met: model '{key[0]}' would finish it too late")
        reply = pb.Reply(
            request_id=p.request_id,
            code=grpc.StatusCode.DEADLINE_EXCEEDED.value[0],
            message=f"deadline exceeded: {why} (shed before running; retry with a larger timeout or less load)",
        )
        replies.setdefault(entries[p.member].gateway_id, []).append(reply)
    writes.shed(key, [p.member for p in expired], [p.request_id for p in expired], replies)
