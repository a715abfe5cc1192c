"""The load views the scheduler publishes for the gateways' admission control (deadline policy).

Per model: its batch cost, the rows queued per priority level, and per level
the play of the queue from where arrivals can still change it
(batchline.planning.view). Each view also says, per gateway, the newest
enqueue it has counted (`seen_us`), so that a gateway stops counting the
requests it admitted itself once a view shows them.
"""
from __future__ import annotations

from collections import Counter

from batchline.contract.keys import ModelKey
from batchline.contract.scheduler_store import StepWrites
from batchline.planning import BatchCost, BatchingRule, Pending, queue_tails
from batchline.protocol import internal_pb2 as pb

# A view is published after every step that changed the queue, and at least this often while
# the scheduler steps: a gateway's view is never much older than this.
PUBLISH_EVERY_S = 0.02
# A gateway whose requests no view has counted for this long is forgotten (it stopped, or
# sends nothing): its own count of what it admitted is over long before.
SEEN_KEEP_S = 60.0



def pending_by_level(scanned: list[int], depth: int) -> Counter:
    """Requests waiting per priority level, from the priorities of the queue's scanned head (in
    priority order) and its whole depth: those past the scan limit count at the last level scanned,
    the level the tail starts at, so that the levels add up to the depth."""
    counts = Counter(scanned)
    if scanned and depth > len(scanned):
        counts[scanned[-1]] += depth - len(scanned)
    return counts


class LoadViews:
    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.published_at: dict[ModelKey, float] = {}
        # Per model, per gateway: the latest enqueued_us of its requests a view has counted; never
        # lowered, so requests sent on since still count as seen.
        self.seen: dict[ModelKey, dict[str, int]] = {}

    def count(self, key: ModelKey, entry: pb.QueueEntry) -> None:
        """A queue entry read for the first time: every view of its model from now on counts it."""
        seen = self.seen.setdefault(key, {})
        if entry.enqueued_us > seen.get(entry.gateway_id, 0):
            seen[entry.gateway_id] = entry.enqueued_us

    def due(self, key: ModelKey, now: float, changed: bool) -> bool:
        return changed or now - self.published_at.get(key, 0.0) >= PUBLISH_EVERY_S

    def publish(self, writes: StepWrites, key: ModelKey, info: pb.ModelInfo, idle_at: list[float], cost: BatchCost,
                rule: BatchingRule, queue: list[Pending], now: float, scanned_at: float) -> None:
        """Queue on `writes` the view of `queue` (what is left queued after the step), played by `rule`
        with the model's holders free at `idle_at`; `scanned_at`, when the step began reading the
        queues, dates it."""
        self.published_at[key] = now
        seen = self.seen.setdefault(key, {})
        for gateway in [g for g, t in seen.items() if now - t / 1e6 > SEEN_KEEP_S]:
            del seen[gateway]
        # One slot per level up to the lowest queued, so that a request is only
        # counted behind rows of its own priority or higher.
        rows = [0] * max([1, info.priority_levels, *(p.priority for p in queue)])
        for p in queue:
            rows[p.priority - 1] += p.rows
        load = pb.ModelLoad(
            **cost.load_fields(),
            executors=len(idle_at),
            backlog_s=sum(t - now for t in idle_at),
            queued_rows=rows, policy=self.policy, updated_us=int(min(now, scanned_at or now) * 1e6),
            tails=queue_tails(queue, idle_at or [now], rule, cost), seen_us=seen, **rule.load_fields(),
        )
        writes.publish_load(key, load.SerializeToString())
