"""Handing an executor's batches back to their queues.

Used by the scheduler when an executor's heartbeat expires (it died), and by
an executor at start-up for the batches a previous incarnation with the same
id had taken but not answered. Members whose payload is gone were answered
or abandoned meanwhile and are not requeued; the others go back with their
original score (priority, deadline), so they are first in line again and
the policy sheds those that can no longer make their deadline. Requeueing is
idempotent (a queue is a set), so a recovery interrupted by a crash is
simply done again.
"""
from __future__ import annotations

from collections import Counter

import redis.asyncio as aioredis

from batchline import contract
from batchline.protocol import internal_pb2 as pb


async def requeue_held_batches(
    redis: aioredis.Redis,
    executor_id: str,
    *,
    include_queued: bool,
    skip: set[str] | frozenset[str] = frozenset(),
    older_than_us: int | None = None,
) -> Counter[tuple[str, str]]:
    """Requeue the live members of the batches `executor_id` holds; returns how many, per (model, version).

    include_queued=False leaves the batches still waiting in its work list
    alone (a restarted executor runs them itself); `skip` leaves the batches
    being run; `older_than_us` only takes batches dispatched before then (one
    just popped from the work list may not have reached its worker yet).
    """
    # Its in-flight sets are per model, in each model's slot: the served set says which models.
    models = sorted(contract.parse_model_tag(t) for t in await redis.smembers(contract.served(executor_id)))
    async with redis.pipeline(transaction=False) as pipe:
        for m in models:
            pipe.smembers(contract.inflight(m, executor_id))
        pipe.lrange(contract.work(executor_id), 0, -1)
        *held, queued = await pipe.execute()
    model_of = {b.decode(): m for m, ids in zip(models, held) for b in ids}
    ids = set(model_of) - set(skip)
    if not include_queued:
        ids -= {pb.Batch.FromString(blob).batch_id for blob in queued}
    if not ids and not (include_queued and queued):
        return Counter()
    ordered = sorted(ids)
    blobs = await contract.get_many(redis, [contract.batch(model_of[b], b) for b in ordered]) if ordered else []
    batches = [pb.Batch.FromString(b) for b in blobs if b is not None]
    # A batch whose key expired has nothing left to run: only its id is dropped.
    expired = [bid for bid, blob in zip(ordered, blobs) if blob is None]
    if older_than_us is not None:
        batches = [b for b in batches if b.dispatched_us < older_than_us]
        ordered = sorted(expired + [b.batch_id for b in batches])
        if not ordered:
            return Counter()
    entries = [(b, e) for b in batches for e in b.members]
    payloads = [contract.payload((b.model_name, b.model_version), e.request_id) for b, e in entries]
    alive = await redis.exists(*payloads) if entries else 0
    # EXISTS counts; fetch per key only when some are gone.
    if entries and alive != len(entries):
        async with redis.pipeline(transaction=False) as pipe:
            for key in payloads:
                pipe.exists(key)
            flags = await pipe.execute()
        entries = [pair for pair, flag in zip(entries, flags) if flag]
    # Each model's requeue and clean-up land before the report that wakes the scheduler for them.
    rounds = contract.Rounds(redis, atomic=True)
    pipe = rounds.next()
    for b, e in entries:
        key = contract.queue(b.model_name, b.model_version)
        pipe.zadd(key, {e.SerializeToString(): contract.queue_score(e.priority, e.deadline_us)})
        pipe.expire(key, contract.QUEUE_TTL)
    for bid in ordered:
        pipe.delete(contract.batch(model_of[bid], bid))
        pipe.srem(contract.inflight(model_of[bid], executor_id), bid)
    pipe = rounds.next()
    if include_queued:
        pipe.delete(contract.work(executor_id))
        for m in models:
            pipe.delete(contract.inflight(m, executor_id))
    # An event for the scheduler, which listens to reports always (not to the arrivals of a
    # queue that waits for a busy executor): this executor holds fewer batches now.
    contract.report(pipe, pb.ExecutionReport(executor_id=executor_id).SerializeToString())
    await rounds.execute()
    return Counter((b.model_name, b.model_version) for b, _ in entries)


async def hand_back(redis: aioredis.Redis, executor_id: str, batch: pb.Batch) -> int:
    """Put one batch sent to `executor_id` back in its queue, untouched (it no longer serves the
    model); returns how many members went back."""
    model = (batch.model_name, batch.model_version)
    key = contract.queue(*model)
    rounds = contract.Rounds(redis, atomic=True)
    pipe = rounds.next()
    if batch.members:
        pipe.zadd(key, {e.SerializeToString(): contract.queue_score(e.priority, e.deadline_us) for e in batch.members})
        pipe.expire(key, contract.QUEUE_TTL)
    pipe.delete(contract.batch(model, batch.batch_id))
    pipe.srem(contract.inflight(model, executor_id), batch.batch_id)
    contract.report(rounds.next(), pb.ExecutionReport(executor_id=executor_id).SerializeToString())
    await rounds.execute()
    return len(batch.members)
