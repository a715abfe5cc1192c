"""What the scheduler knows of each model's queue between steps: its entries, parsed once for as
long as they stay queued; how much company arrivals bring (scheduler/company.py); and the
pending-requests gauges it reports per priority level."""
from __future__ import annotations

import logging
from typing import Callable, Iterable

from google.protobuf.message import DecodeError

from batchline import metrics
from batchline.contract import OVER_SHARE
from batchline.contract.keys import ModelKey
from batchline.planning import Pending
from batchline.protocol import internal_pb2 as pb
from scheduler.company import CompanyRate
from scheduler.load_views import LoadViews, pending_by_level

# How long the scheduler keeps batches headed by over-share requests short after the last request
# within its tenant's share arrived.
IN_SHARE_MEMORY_S = 2.0

log = logging.getLogger(__name__)


class Queues:
    def __init__(self, views: LoadViews) -> None:
        self.views = views
        self.pending: dict[bytes, Pending] = {}       # queue member -> parsed, while it is queued
        self.entries: dict[bytes, pb.QueueEntry] = {}  # queue member -> its QueueEntry
        self.depths: dict[ModelKey, int] = {}
        self._company: dict[ModelKey, CompanyRate] = {}  # per queue: arrivals seen while n requests waited
        self._last_step: dict[ModelKey, tuple[float, int]] = {}  # per queue: last step's time, requests it left queued
        self._levels: dict[ModelKey, set[int]] = {}  # priority levels with a pending gauge
        self._shares: dict[ModelKey, tuple[float, float]] = {}  # shortest in-share budget lately, last seen

    def read(self, key: ModelKey, members: list[bytes],
             drop: Callable[[list[bytes]], None]) -> tuple[list[Pending], int]:
        """The queue's scanned head as planning sees it, and how many of it are new since the last step.
        A member that is no QueueEntry goes to `drop` (its removal, with the step's writes) and is left
        out: one unreadable entry must not stop the scheduling of every queue, step after step."""
        arrivals = 0
        queue = []
        unreadable = []
        for member in members:
            p = self.pending.get(member)
            if p is None:
                try:
                    e = pb.QueueEntry.FromString(member)
                except DecodeError:
                    unreadable.append(member)
                    continue
                arrivals += 1
                self.entries[member] = e
                self.views.count(key, e)  # every view of this model from now on counts it, queued or sent on
                p = self.pending[member] = Pending(e.request_id, e.rows, e.priority, e.deadline_us / 1e6,
                                                   e.enqueued_us / 1e6, member, e.length or 1)
                if e.priority <= OVER_SHARE:
                    self._in_share(key, p)
            queue.append(p)
        if unreadable:
            log.warning("queue of %s:%s: %d entries that are no QueueEntry were removed", *key, len(unreadable))
            drop(unreadable)
        return queue, arrivals

    def _in_share(self, key: ModelKey, p: Pending) -> None:
        budget = p.deadline - p.enqueued
        shortest, seen = self._shares.get(key, (budget, p.enqueued))
        fresh = p.enqueued - seen < IN_SHARE_MEMORY_S
        self._shares[key] = (min(shortest, budget) if fresh else budget, p.enqueued)

    def in_share_budget(self, key: ModelKey, now: float) -> float | None:
        """The shortest budget of the requests queued within their tenants' shares lately (None: none
        came within IN_SHARE_MEMORY_S): what an over-share batch must leave them room for."""
        shortest, seen = self._shares.get(key, (0.0, float("-inf")))
        return shortest if now - seen < IN_SHARE_MEMORY_S else None

    def company(self, key: ModelKey, waiting: int, arrivals: int, now: float) -> float | None:
        """Arrivals per second expected while `waiting` requests wait, counting the `arrivals` of
        this step against what the last step left queued."""
        rate = self._company.setdefault(key, CompanyRate())
        at, left = self._last_step.get(key, (now, 0))
        rate.observe(left, arrivals, now - at, now)
        return rate.rate(waiting, now)

    def left(self, key: ModelKey, now: float, waiting: int) -> None:
        """What a step left queued, for the next step's company count."""
        self._last_step[key] = (now, waiting)

    def forget_steps(self) -> None:
        """Another scheduler stepped meanwhile: what it left queued, and when, is not known here."""
        self._last_step.clear()

    def keep_only(self, members: set[bytes]) -> None:
        """Forget parsed entries that left every queue."""
        for member in [m for m in self.pending if m not in members]:
            del self.pending[member]
            del self.entries[member]

    def report(self, key: ModelKey, priority_levels: int, queue: list[Pending]) -> None:
        """Set the pending-requests gauges of the model's priority levels; levels reported before
        are set back to 0 once they empty."""
        by_priority = pending_by_level([p.priority for p in queue], self.depths.get(key, len(queue)))
        levels = self._levels.setdefault(key, set(range(1, max(1, priority_levels) + 1)))
        levels.update(by_priority)
        for level in levels:
            metrics.PENDING_REQUESTS.labels(key[0], key[1], str(level)).set(by_priority.get(level, 0))

    def forget_gauges(self, keep: Iterable[ModelKey] = ()) -> None:
        """Drop the queue depths this scheduler reported but those of `keep`: all of them when the lease
        is lost (only the leader's count: an autoscaler sums them), a model's when it is served no more."""
        kept = set(keep)
        for key in [k for k in self._levels if k not in kept]:
            for level in self._levels.pop(key):
                try:
                    metrics.PENDING_REQUESTS.remove(key[0], key[1], str(level))
                except KeyError:
                    pass
            self.depths.pop(key, None)
