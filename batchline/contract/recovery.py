"""The recovery role: handing an executor's batches back to their queues.

Used by the scheduler when an executor's heartbeat expires (it died), and by
an executor at start-up for the batches a previous incarnation with the same
id had taken but not answered. Members whose payload is gone were answered
or abandoned meanwhile and are not requeued; the others go back with their
original score (priority, deadline), so they are first in line again and
the policy sheds those that can no longer make their deadline. A batch goes
back only through the call that takes it off the executor's in-flight set
(one script per batch), so two parties recovering the same batch requeue it
once, and a recovery interrupted by a crash is simply done again.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable

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
        models: Iterable[ModelKey] = (),
    ) -> Counter[ModelKey]:
        """Requeue the live members of the batches `executor_id` holds; returns how many, per (model, version).

        include_queued=False leaves the batches still waiting in its work list
        alone (a restarted executor runs them itself); `skip` leaves the batches
        being run; `older_than_us` only takes batches dispatched before then (one
        just popped from the work list may not have reached its worker yet); `models`: the models
        the executor serves (or last registered), looked at besides those its served set names.
        """
        # Its in-flight sets are per model, in each model's slot: the served set says which models. On
        # a cluster the set is written by the half of a dispatch in the executor's slot, which may
        # fail where the model's half landed: the models it serves are looked at too.
        served = {k.parse_model_tag(t) for t in await self.client.smembers(k.served(executor_id))}
        models = sorted(served | set(models))
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
        # Each model's requeue and clean-up land before the report that wakes the scheduler for them.
        rounds = Rounds(self.client, atomic=True)
        pipe = rounds.next()
        for b in batches:
            calls.hand_back(pipe, executor_id, b)
        handed = {b.batch_id for b in batches}
        for bid in ordered:
            if bid not in handed:
                pipe.srem(k.inflight(model_of[bid], executor_id), bid)
        pipe = rounds.next()
        if include_queued:
            # Only what was read: a batch dispatched since (the scheduler has not seen the executor
            # go yet) stays, in its work list and in-flight set, for the next recovery.
            for blob in queued:
                pipe.lrem(k.work(executor_id), 1, blob)
        # An event for the scheduler, which listens to reports always (not to the arrivals of a
        # queue that waits for a busy executor): this executor holds fewer batches now.
        calls.report(pipe, pb.ExecutionReport(executor_id=executor_id).SerializeToString())
        results = await rounds.execute()
        requeued: Counter[ModelKey] = Counter()
        for b, n in zip(batches, results):
            if int(n) > 0:
                requeued[(b.model_name, b.model_version)] += int(n)
        return requeued

    async def hand_back(self, executor_id: str, batch: pb.Batch) -> int:
        """Put one batch sent to `executor_id` back in its queue, untouched (it no longer serves the
        model); returns how many members went back (none when recovery had taken it already)."""
        rounds = Rounds(self.client, atomic=True)
        calls.hand_back(rounds.next(), executor_id, batch)
        calls.report(rounds.next(), pb.ExecutionReport(executor_id=executor_id).SerializeToString())
        n, *_ = await rounds.execute()
        return max(0, int(n))
