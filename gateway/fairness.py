"""Weighted fair shares of a model between tenants, on top of priorities and deadlines.

Each gateway keeps, per model, two decaying counts per tenant over about WINDOW_S: the work the
tenant offered and the work admitted for it, in the latency profile's units (rows × length, so a
row of a long text counts for what it costs). Among the tenants that offered anything in the last
IDLE_S, a tenant whose share of the admitted work is above its weight's share is *over its
share*: its requests are queued OVER_SHARE levels below the priority they asked for (the queue
is ordered by level, then deadline).

That one rule makes both halves share by weight. The scheduler serves lower levels only when
the higher ones leave room, so a tenant within its share is served first and keeps its latency.
Admission control plays the queue at a request's own level, so the over-share tenant's requests
see everyone's work ahead of them and are the ones refused (RESOURCE_EXHAUSTED with a retry hint)
when the model is full; the others see only the work at their level. This is max-min fairness:
a tenant that wants less than its share gets what it wants, and the rest goes to the others.
Counts are per gateway: with several gateways, each sees its part of every tenant's traffic, and
the shares come out the same. Without tokens (one tenant, "") nothing changes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from batchline.contract import MAX_PRIORITY_LEVELS, OVER_SHARE
from batchline.contract.keys import ModelKey

WINDOW_S = 1.0  # the time constant of the decaying counts
# A tenant that offered nothing for this long is no longer sharing: the others' shares follow
# who is sending now, not a decaying count that a busy tenant's burst keeps above zero for many
# windows (a tenant left alone was counted over its share for about ten seconds so).
IDLE_S = 1.0


@dataclass
class _Counts:
    offered: float = 0.0
    admitted: float = 0.0
    at: float = 0.0
    last_offer: float = 0.0

    def decay(self, now: float, window_s: float) -> None:
        if now > self.at:
            f = math.exp(-(now - self.at) / window_s)
            self.offered *= f
            self.admitted *= f
            self.at = now


@dataclass
class FairShares:
    window_s: float = WINDOW_S
    idle_s: float = IDLE_S
    _models: dict[ModelKey, dict[str, _Counts]] = field(default_factory=dict)
    _weights: dict[str, float] = field(default_factory=dict)

    def level(self, model: ModelKey, tenant: str, weight: float, priority: int, units: int, now: float) -> int:
        """The level to queue a request of `tenant` at (its `priority`, or OVER_SHARE below it); counts it as
        offered."""
        tenants = self._models.setdefault(model, {})
        self._weights[tenant] = weight
        mine = tenants.setdefault(tenant, _Counts(at=now))
        for counts in tenants.values():
            counts.decay(now, self.window_s)
        mine.offered += units
        mine.last_offer = now
        for name in [n for n, c in tenants.items() if now - c.last_offer > self.idle_s]:
            del tenants[name]
        if len(tenants) < 2:
            return priority
        admitted = sum(c.admitted for c in tenants.values())
        weights = sum(self._weights[n] for n in tenants)
        if admitted <= 0 or weights <= 0 or mine.admitted / admitted <= weight / weights:
            return priority
        return min(priority + OVER_SHARE, MAX_PRIORITY_LEVELS)

    def admitted(self, model: ModelKey, tenant: str, units: int, now: float) -> None:
        counts = self._models.get(model, {}).get(tenant)
        if counts is not None:
            counts.decay(now, self.window_s)
            counts.admitted += units

    def shares(self, model: ModelKey) -> dict[str, float]:
        """Each active tenant's share of the work admitted in the window (for tests and status)."""
        tenants = self._models.get(model, {})
        total = sum(c.admitted for c in tenants.values())
        return {n: (c.admitted / total if total else 0.0) for n, c in tenants.items()}
