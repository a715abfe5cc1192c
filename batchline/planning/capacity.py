"""What one executor can serve within a budget, and how many executors a demand wants.

The capacity is found by the same play of a queue that dispatch and admission go by
(batchline.planning.simulation.play): a steady stream of one-row requests of the model's typical
length, each with the model's budget, played on one executor's lanes; the capacity is the highest
rate at which every request of it finishes in time. So it moves with the learned profile, the
model's max_batch_size and its preferred sizes, and is not a constant anyone must keep true.

The length matters as much as the rate: a text model's profile is per token, and a stream of
one-token requests would overstate what an executor serves of 16-token ones about tenfold. In the
play the lanes run each batch for its typical cost, and a batch is judged in time by its finish
plus its own margin: the margin is a high quantile of one batch's overrun, and a steady queue's
wait is a sum of many batches whose overruns do not all reach it at once. Played with the margin
on every batch, one minilm executor on a 2-core host came out at 90 requests/s where it served
about 240 (docs/design/autoscaling.md).

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


def executor_capacity(rule: BatchingRule, cost: Cost, budget_s: float, lanes: int = 1, length: int = 1) -> float:
    """Requests per second one executor of `lanes` lanes answers within `budget_s` each, at most,
    for requests of one row of `length` elements at the model's variable dims (batchline.sizing;
    1 for fixed shapes)."""
    if length < 1:
        raise ValueError(f"length must be at least 1, got {length}")
    if budget_s <= 0 or cost.predict(length) > budget_s:
        return 0.0
    full = max(1, rule.max_batch_size)
    high = lanes * full / max(cost.typical(full * length), 1e-9)  # every lane running full batches back to back
    low = 0.0
    if _in_time(rule, cost, budget_s, lanes, high, length):
        return high
    for _ in range(STEPS):
        mid = (low + high) / 2
        if _in_time(rule, cost, budget_s, lanes, mid, length):
            low = mid
        else:
            high = mid
    return low


def _in_time(rule: BatchingRule, cost: Cost, budget_s: float, lanes: int, rate: float, length: int) -> bool:
    if rate <= 0:
        return True
    stream = [Pending(str(i), 1, 1, i / rate + budget_s, i / rate, length=length) for i in range(STREAM)]
    played = play(stream, [0.0] * lanes, rule, _Typical(cost))
    return not played.shed and sum(len(b.members) for b in played.batches) == STREAM and all(
        b.finish + _margin(cost, len(b.members) * length) <= b.members[0].deadline for b in played.batches)


def _margin(cost: Cost, units: int) -> float:
    return cost.predict(units) - cost.typical(units)


@dataclass(frozen=True, slots=True)
class _Typical:
    """`cost` without its margin: what a lane is taken to run each batch for (see the module's note)."""
    cost: Cost

    def predict(self, units: int) -> float:
        return self.cost.typical(units)

    def typical(self, units: int) -> float:
        return self.cost.typical(units)


def generation_capacity(slots: int, held_s: float, decode_row_s: float = 0.0, tpot_s: float = 0.0) -> float:
    """Requests per second one executor's generation engine answers: as many sequences at once as
    its cache slots hold, each holding its slot `held_s` on average (Little's law: the mean time a
    request is in flight there, prefill and decode steps included). With a time-per-token budget
    `tpot_s`, no more at once than keep a decode step within it, a step taken to grow by
    `decode_row_s` per sequence (the learned step over the batch it was learned at: a bound, since
    a step's cost grows less than in proportion to its batch). 0 until a hold time is measured."""
    if slots <= 0 or held_s <= 0:
        return 0.0
    at_once = slots
    if tpot_s > 0 and decode_row_s > 0:
        at_once = max(1, min(slots, int(tpot_s / decode_row_s)))
    return at_once / held_s


# The rate the queue shows (queued_rate) counts only from this many queued requests, over at least
# this long, and only once the queue holds this share of what the serving executors finish within
# the budget: a batching model's queue holds a batch or two of that in steady traffic, a surge
# fills it toward what admission allows.
QUEUED_FOR_RATE = 16
QUEUED_SPAN_S = 0.01
SURGE_SHARE = 0.25


def queued_rate(queued: int, oldest_age_s: float, holds: float) -> float:
    """Requests/s arriving now, at least, as the queue shows it in a surge: `queued` requests arrived
    since the oldest of them, queued `oldest_age_s` ago, less two standard deviations of a Poisson
    count (requests refused or already served arrived too, so it errs low). A surge fills the queue
    before any rate over a step shows it: this sees it at the next step. `holds`: the requests the
    serving executors finish within the budget (capacity x budget x executors); 0 while the queue
    holds less than SURGE_SHARE of it, or fewer than QUEUED_FOR_RATE requests."""
    if queued < max(QUEUED_FOR_RATE, SURGE_SHARE * holds):
        return 0.0
    return (queued - 2 * math.sqrt(queued)) / max(oldest_age_s, QUEUED_SPAN_S)


@dataclass(frozen=True, slots=True)
class Need:
    """Executors a model wants, and the numbers behind it."""
    executors: float       # the demand in executors (fractional): max(forecast's, backlog's)
    by_forecast: float     # max(forecast rate, queued rate) / (capacity x target utilisation)
    by_backlog: float      # executors that finish the queue within one budget

    @property
    def wanted(self) -> int:
        return math.ceil(self.executors - 1e-9)


def need(forecast_rate: float, capacity: float, target_utilisation: float, backlog: int, budget_s: float,
         now_rate: float = 0.0) -> Need:
    """What a model's forecast and backlog ask for. Floors for surges no forecast saw: the backlog,
    and `now_rate`, the rate the queue shows arriving now (queued_rate), which the forecast, a
    rate over whole steps, sees a step later."""
    if capacity <= 0:
        # Not even one request fits the budget: more executors do not help, one serves what it can.
        busy = 1.0 if forecast_rate > 0 or backlog else 0.0
        return Need(busy, busy, busy)
    by_forecast = max(forecast_rate, now_rate) / (capacity * target_utilisation)
    by_backlog = backlog / (capacity * budget_s) if budget_s > 0 else 0.0
    return Need(max(by_forecast, by_backlog), by_forecast, by_backlog)


def wanted(needs: list[Need]) -> int:
    """Executors the mesh wants: each serves every model, so the models' fractional needs add up."""
    return math.ceil(sum(n.executors for n in needs) - 1e-9)
