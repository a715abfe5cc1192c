"""What one executor can serve within a budget, and how many executors a demand wants.

The capacity is found by the same play of a queue that dispatch and admission go by
(batchline.planning.simulation.play): a steady stream of one-row requests, each with the
model's budget, played on one executor's lanes; the capacity is the highest rate at which
every request of it finishes in time. So it moves with the learned profile, the model's
max_batch_size and its preferred sizes, and is not a constant anyone must keep true.

Pure: time is passed in, nothing is read from a clock.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from batchline.planning.cost import Cost
from batchline.planning.rule import BatchingRule
from batchline.planning.simulation import Pending, play

# Requests in the stream each candidate rate is played with: enough for batches to reach their
# steady size at the rates that matter, few enough to play 20 rates in milliseconds.
STREAM = 256
# Bisection steps between 0 and the saturation rate: a capacity within 1e-6 of it.
STEPS = 20


def executor_capacity(rule: BatchingRule, cost: Cost, budget_s: float, lanes: int = 1) -> float:
    """Requests per second one executor of `lanes` lanes answers within `budget_s` each, at most."""
    if budget_s <= 0 or cost.predict(1) > budget_s:
        return 0.0
    full = max(1, rule.max_batch_size)
    high = lanes * full / max(cost.predict(full), 1e-9)  # every lane running full batches back to back
    low = 0.0
    if _in_time(rule, cost, budget_s, lanes, high):
        return high
    for _ in range(STEPS):
        mid = (low + high) / 2
        if _in_time(rule, cost, budget_s, lanes, mid):
            low = mid
        else:
            high = mid
    return low


def _in_time(rule: BatchingRule, cost: Cost, budget_s: float, lanes: int, rate: float) -> bool:
    if rate <= 0:
        return True
    stream = [Pending(str(i), 1, 1, i / rate + budget_s, i / rate) for i in range(STREAM)]
    played = play(stream, [0.0] * lanes, rule, cost)
    return not played.shed and all(b.finish <= b.members[0].deadline for b in played.batches) \
        and sum(len(b.members) for b in played.batches) == STREAM


@dataclass(frozen=True, slots=True)
class Need:
    """Executors a model wants, and the numbers behind it."""
    executors: float       # the demand in executors (fractional): max(forecast's, backlog's)
    by_forecast: float     # forecast rate / (capacity x target utilisation)
    by_backlog: float      # executors that finish the queue within one budget

    @property
    def wanted(self) -> int:
        return math.ceil(self.executors - 1e-9)


def need(forecast_rate: float, capacity: float, target_utilisation: float, backlog: int, budget_s: float) -> Need:
    """What a model's forecast and backlog ask for; the backlog is a floor for surges no forecast saw."""
    if capacity <= 0:
        # Not even one request fits the budget: more executors do not help, one serves what it can.
        busy = 1.0 if forecast_rate > 0 or backlog else 0.0
        return Need(busy, busy, busy)
    by_forecast = forecast_rate / (capacity * target_utilisation)
    by_backlog = backlog / (capacity * budget_s) if budget_s > 0 else 0.0
    return Need(max(by_forecast, by_backlog), by_forecast, by_backlog)


def wanted(needs: list[Need]) -> int:
    """Executors the mesh wants: each serves every model, so the models' fractional needs add up."""
    return math.ceil(sum(n.executors for n in needs) - 1e-9)
