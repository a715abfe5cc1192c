"""The recovery role: handing an executor's batches back to their queues.

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

from batchline.contract import calls
from batchline.contract import keys as k
from batchline.contract.keys import ModelKey
from batchline.contract.slots import Rounds, get_many
from batchline.contract.store import Store
from batchline.protocol import internal_pb2 as pb


class RecoveryStore(Store):
    """The recovery role's reads and writes: the scheduler's for a dead executor, an executor's for
    its own batches."""

    async def requeue_held_batches(
        self,
        executor_id: str,
        *,
        include_queued: bool,
        skip: set[str] | frozenset[str] = frozenset(),
        older_than_us: int | None = None,
    ) -> Counter[ModelKey]:
        """Requeue the live members of the batches `executor_id` holds; returns how many, per (model, version).

        include_queued=False leaves the batches still waiting in its work list
        alone (a restarted executor runs them itself); `skip` leaves the batches
        being run; `older_than_us` only takes batches dispatched before then (one
        just popped from the work list may not have reached its worker yet).
        """
        # Its in-flight sets are per model, in each model's slot: the served set says which models.
        models = sorted(k.parse_model_tag(t) for t in await self.client.smembers(k.served(executor_id)))
        async with self.client.pipeline(transaction=False) as pipe:
            for m in models:
                pipe.smembers(k.inflight(m, executor_id))
            pipe.lrange(k.work(executor_id), 0, -1)
            *held, queued = await pipe.execute()
        model_of = {b.decode(): m for m, ids in zip(models, held) for b in ids}
        ids = set(model_of) - set(skip)
        if not include_queued:
            ids -= {pb.Batch.FromString(blob).batch_id for blob in queued}
        if not ids and not (include_queued and queued):
            return Counter()
        ordered = sorted(ids)
        blobs = await get_many(self.client, [k.batch(model_of[b], b) for b in ordered]) if ordered else []
        batches = [pb.Batch.FromString(b) for b in blobs if b is not None]
        # A batch whose key expired has nothing left to run: only its id is dropped.
        expired = [bid for bid, blob in zip(ordered, blobs) if blob is None]
        if older_than_us is not None:
            batches = [b for b in batches if b.dispatched_us < older_than_us]
            ordered = sorted(expired + [b.batch_id for b in batches])
            if not ordered:
                return Counter()
        entries = [(b, e) for b in batches for e in b.members]
        payloads = [k.payload((b.model_name, b.model_version), e.request_id) for b, e in entries]
        alive = await self.client.exists(*payloads) if entries else 0
        # EXISTS counts; fetch per key only when some are gone.
        if entries and alive != len(entries):
            async with self.client.pipeline(transaction=False) as pipe:
                for key in payloads:
                    pipe.exists(key)
                flags = await pipe.execute()
            entries = [pair for pair, flag in zip(entries, flags) if flag]
        # Each model's requeue and clean-up land before the report that wakes the scheduler for them.
        rounds = Rounds(self.client, atomic=True)
        pipe = rounds.next()
        for b, e in entries:
            key = k.queue((b.model_name, b.model_version))
            pipe.zadd(key, {e.SerializeToString(): k.queue_score(e.priority, e.deadline_us)})
            pipe.expire(key, k.QUEUE_TTL)
        for bid in ordered:
            pipe.delete(k.batch(model_of[bid], bid))
            pipe.srem(k.inflight(model_of[bid], executor_id), bid)
        pipe = rounds.next()
        if include_queued:
            pipe.delete(k.work(executor_id))
            for m in models:
                pipe.delete(k.inflight(m, executor_id))
        # An event for the scheduler, which listens to reports always (not to the arrivals of a
        # queue that waits for a busy executor): this executor holds fewer batches now.
        calls.report(pipe, pb.ExecutionReport(executor_id=executor_id).SerializeToString())
        await rounds.execute()
        return Counter((b.model_name, b.model_version) for b, _ in entries)

    async def hand_back(self, executor_id: str, batch: pb.Batch) -> int:
        """Put one batch sent to `executor_id` back in its queue, untouched (it no longer serves the
        model); returns how many members went back."""
        model = (batch.model_name, batch.model_version)
        key = k.queue(model)
        rounds = Rounds(self.client, atomic=True)
        pipe = rounds.next()
        if batch.members:
            pipe.zadd(key, {e.SerializeToString(): k.queue_score(e.priority, e.deadline_us) for e in batch.members})
            pipe.expire(key, k.QUEUE_TTL)
        pipe.delete(k.batch(model, batch.batch_id))
        pipe.srem(k.inflight(model, executor_id), batch.batch_id)
        calls.report(rounds.next(), pb.ExecutionReport(executor_id=executor_id).SerializeToString())
        await rounds.execute()
        return len(batch.members)
