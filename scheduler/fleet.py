"""The executors a scheduler dispatches to: the registry as Redis holds it, read again every
registry_refresh_s (or at the next step when asked), and the batches of the executors that
stopped heartbeating handed back to their queues."""
from __future__ import annotations

import logging
import time

from batchline import metrics
from batchline.heartbeats import HeartbeatTrust
from batchline.contract.scheduler_store import SchedulerStore
from batchline.registry import Registry

log = logging.getLogger(__name__)


class Fleet:
    def __init__(self, store: SchedulerStore, refresh_s: float) -> None:
        self.store = store
        self.refresh_s = refresh_s
        self.registry = Registry()
        self.read_at = 0.0  # time.monotonic() of the last complete read; 0: read at the next step
        self.heartbeats = HeartbeatTrust()  # whether an executor without a heartbeat is gone
        # The models each executor last registered, kept until it is forgotten: recovery looks at
        # their in-flight sets whatever its served set says (on a cluster, written apart from the
        # dispatch), also at a refresh later than the first after its registration expired.
        self._models: dict[str, set[tuple[str, str]]] = {}

    def due(self) -> bool:
        return time.monotonic() - self.read_at >= self.refresh_s or not self.registry.models

    def read_again(self) -> None:
        """What the registry was is no guide (e.g. another scheduler led meanwhile): read it at the next step."""
        self.read_at = 0.0

    async def refresh(self) -> dict[str, int]:
        """Read the registry; hand back the batches of the executors whose heartbeat expired and
        forget them. Returns those executors, with how many requests each had."""
        self.registry = await Registry.load(self.store)
        for eid, info in self.registry.executors.items():
            self._models[eid] = {(m.name, m.version) for m in info.models}
        for eid in [e for e in self._models if e not in self.registry.executors and e not in self.registry.stale]:
            del self._models[eid]  # forgotten (by another scheduler, say)
        gone: dict[str, int] = {}
        if self.registry.stale and self.heartbeats.heartbeats_tell():
            for eid in self.registry.stale:
                # The models it last registered, and (a scheduler that never saw it) those served now.
                models = self._models.get(eid, set()) | set(self.registry.models)
                gone[eid] = await self._recover(eid, sorted(models))
        elif self.registry.stale:
            # Their keys may have expired in an outage or a failover: a live executor beats again
            # soon and runs its batches; handing them back now would run them twice.
            log.info("executors %s have no heartbeat right after Redis was away: their batches stay theirs "
                     "for now", ", ".join(self.registry.stale))
        # Only now: a recovery that failed is tried again at the next step.
        self.read_at = time.monotonic()
        return gone

    async def _recover(self, eid: str, models: list[tuple[str, str]]) -> int:
        requeued = await self.store.requeue_held_batches(eid, include_queued=True, models=models)
        if not requeued:
            # Forgotten only once a recovery finds nothing left: a batch dispatched to it while this
            # one ran (by a scheduler that had not seen it go) is recovered at the next refresh.
            await self.store.forget_executor(eid)
            self._models.pop(eid, None)
        for key, count in requeued.items():
            metrics.REDISPATCHED.labels(*key).inc(count)
        n = sum(requeued.values())
        if n:
            log.warning("executor %s stopped heartbeating; requeued %d of its requests", eid, n)
        return n
