"""The leader's demand and capacity signals, per model: what the autoscalers size the mesh by.

Every `forecast_step_s` the leader reads how many requests the gateways received per model
(gateway/arrivals.py), turns the counts into per-second rates and forecasts them `horizon` ahead
(batchline.planning.forecast); it takes one executor's capacity within the model's default budget
from the learned profile by the shared planning model (batchline.planning.capacity), and so the
executors each model needs, never fewer than finish its queue within one budget. The sum over the
models, rounded up, is `executors wanted`: published in Redis (bl:demand, for `batchline up
--autoscale`), as Prometheus gauges (for KEDA) and in `batchline status`, and logged when it changes.

The horizon defaults to the executors' measured start-to-serving time (their registrations carry
it): an executor asked for now serves that much later, so that is how far ahead demand must be seen.

A generative model has no batch profile: one executor's capacity is its sequences at once (its
cache slots, fewer where the time-per-token budget bounds the decode batch) over the time a
sequence holds its slot, measured as in-flight sequences over the arrival rate (Little's law;
docs/design/autoscaling.md#generative-models).
"""
from __future__ import annotations

import collections
import logging
import statistics
from dataclasses import dataclass

from batchline import metrics, telemetry
from batchline.contract.keys import ModelKey
from batchline.contract.scheduler_store import SchedulerStore
from batchline.planning import BatchCost, BatchingRule
from batchline.planning.capacity import Need, executor_capacity, generation_capacity, need, queued_rate, wanted
from batchline.planning.forecast import ArrivalRate, Holt
from batchline.protocol import internal_pb2 as pb
from batchline.registry import Registry

log = logging.getLogger(__name__)

# Before any executor reported its start-to-serving time, the forecast looks this far ahead.
DEFAULT_HORIZON_S = 10.0
# Weight of a step's count in the moving average of a generative model's sequences in flight.
IN_FLIGHT_WEIGHT = 0.3
# The share of an executor's capacity the forecast may fill. The capacity is already the rate whose
# every request finishes within the budget, so this margin is only for the forecast's error and the
# arrivals' noise; 0.85 is admission's own headroom (docs/design/autoscaling.md has the replays
# that chose it).
TARGET_UTILISATION = 0.85


@dataclass(frozen=True, slots=True)
class DemandSettings:
    step_s: float = 1.0                # how often rates are measured and forecast
    horizon_s: float = 0.0             # how far ahead; 0: the measured executor start time
    target_utilisation: float = TARGET_UTILISATION
    season_s: float = 0.0              # a known period of the demand (0: none)


def executor_start_s(registry: Registry) -> float:
    """The median start-to-serving time the live executors reported (0: none did)."""
    times = [info.start_s for info in registry.executors.values() if info.start_s > 0]
    return statistics.median(times) if times else 0.0


def _processes(holders: list[str]) -> collections.Counter[str]:
    """The executor processes among `holders`, with their lanes (instance_count): ids ID and ID#k."""
    return collections.Counter(eid.split("#")[0] for eid in holders)


def lanes_per_executor(registry: Registry, holders: list[str]) -> int:
    """Lanes of one executor process (instance_count)."""
    return max(_processes(holders).values(), default=1)


class Demand:
    def __init__(self, store: SchedulerStore, scheduler_id: str, settings: DemandSettings) -> None:
        self.store = store
        self.scheduler_id = scheduler_id
        self.settings = settings
        self.rates: dict[ModelKey, ArrivalRate] = {}
        self.stepped_at = 0.0
        self.last: pb.MeshDemand | None = None
        # The last capacity per model and what it was computed from: it is played again only when they change.
        self._capacity: dict[ModelKey, tuple[tuple, float]] = {}
        self._in_flight: dict[ModelKey, float] = {}  # generative models' sequences in flight, averaged
        # Generative models' sequences sent to executors, per second: their throughput. Arrivals count
        # refused requests too, so at saturation they would make each sequence's hold look short.
        self._started: dict[ModelKey, ArrivalRate] = {}

    def due(self, now: float) -> bool:
        return now - self.stepped_at >= self.settings.step_s

    def _rate(self, key: ModelKey) -> ArrivalRate:
        r = self.rates.get(key)
        if r is None:
            period = round(self.settings.season_s / self.settings.step_s)
            r = self.rates[key] = ArrivalRate(self.settings.step_s, Holt.for_period(period))
        return r

    def capacity(self, key: ModelKey, rule: BatchingRule, cost: BatchCost, budget_s: float, lanes: int,
                 length: int = 1) -> float:
        # To two significant digits: the profile moves a little with every report, and a play of the
        # stream costs milliseconds of the scheduler's loop; a capacity 5% off moves nothing.
        basis = (rule, *map(_rounded, (cost.per_unit_s, cost.fixed_s, cost.margin_s, *cost.margin_by_size_s,
                                       cost.overhead_s)), budget_s, lanes, length)
        known = self._capacity.get(key)
        if known is None or known[0] != basis:
            known = self._capacity[key] = (basis, executor_capacity(rule, cost, budget_s, lanes, length))
        return known[1]

    def generation(self, key: ModelKey, registry: Registry, holders: list[str], in_flight: int, started: int,
                   now: float, arrivals: float) -> float:
        """One executor's capacity for a generative model (generation_capacity), from its holders'
        registrations and the sequences in flight, averaged over the steps, each held for in flight
        / sent per second (Little's law; `started`: the sequences sent so far, a count; `arrivals`,
        the arrival rate, until sending is measured)."""
        held = self._in_flight[key] = in_flight if key not in self._in_flight else \
            self._in_flight[key] + IN_FLIGHT_WEIGHT * (in_flight - self._in_flight[key])
        sent = self._started.setdefault(key, ArrivalRate())
        sent.observe(now, started)
        # Smoothed: a step of long generations may send none, and hold times are not that long.
        level = sent.holt.level
        rate = level if level is not None and level > 0 else arrivals
        infos = [m for e in holders if e in registry.executors for m in registry.executors[e].models
                 if (m.name, m.version) == key]
        slots = min((m.generation_slots for m in infos), default=0)
        row_s = max((m.decode_step_s / m.generation_running for m in infos if m.generation_running), default=0.0)
        tpot_s = registry.models[key].tpot_ms / 1000 if key in registry.models else 0.0
        return generation_capacity(slots, held / rate if rate > 0 else 0.0, row_s, tpot_s)

    async def step(self, registry: Registry, plans: dict[ModelKey, tuple[BatchingRule, BatchCost, list[str], int]],
                   depths: dict[ModelKey, int], now: float,
                   sequences: dict[ModelKey, tuple[list[str], int, int]] | None = None,
                   queued: dict[ModelKey, tuple[int, float]] | None = None) -> pb.MeshDemand:
        """Measure, forecast and publish. `plans`: per model served, its rule, its cost, its holders and
        its requests' typical elements per row (Profiles.length);
        `sequences`: per generative model served, its holders, its sequences in flight and the
        sequences sent to executors so far; `queued`: per model, the requests the step read from
        its queue and the age of the oldest of them (planning.capacity.queued_rate)."""
        self.stepped_at = now
        sequences = sequences or {}
        queued = queued or {}
        models = sorted(set(plans) | set(sequences))
        totals = await self.store.arrival_counts(models)
        start_s = executor_start_s(registry)
        horizon = self.settings.horizon_s or start_s or DEFAULT_HORIZON_S
        demand = pb.MeshDemand(horizon_s=horizon, executor_start_s=start_s, updated_us=int(now * 1e6),
                               scheduler_id=self.scheduler_id)
        needs: list[Need] = []
        for key in [k for k in self.rates if k not in models]:
            del self.rates[key]  # no longer served: nor its gauges
            self._capacity.pop(key, None)
            self._in_flight.pop(key, None)
            self._started.pop(key, None)
            self._remove_gauges(key)
        for key, total in zip(models, totals):
            rate = self._rate(key)
            rate.observe(now, total)
            forecast = rate.ahead(horizon)
            budget_s = registry.models[key].default_timeout_ms / 1000
            if key in sequences:
                capacity = self.generation(key, registry, *sequences[key], now, rate.rate)
            else:
                rule, cost, holders, length = plans[key]
                capacity = self.capacity(key, rule, cost, budget_s, lanes_per_executor(registry, holders), length)
            now_rate = 0.0
            if key not in sequences and key in queued:
                now_rate = queued_rate(*queued[key], capacity * budget_s * len(_processes(plans[key][2])))
            n = need(forecast, capacity, self.settings.target_utilisation, depths.get(key, 0), budget_s, now_rate)
            needs.append(n)
            demand.models.append(pb.MeshDemand.Model(
                name=key[0], version=key[1], arrival_rate=rate.rate, forecast_rate=forecast, capacity=capacity,
                budget_s=budget_s, backlog=depths.get(key, 0), by_forecast=n.by_forecast, by_backlog=n.by_backlog,
                queued_rate=now_rate))
            metrics.ARRIVAL_RATE_FORECAST.labels(*key).set(forecast)
            metrics.EXECUTOR_CAPACITY.labels(*key).set(capacity)
        demand.executors_wanted = wanted(needs)
        metrics.EXECUTORS_WANTED.set(demand.executors_wanted)
        metrics.EXECUTOR_START.set(start_s)
        self._trace(demand)
        await self.store.publish_demand(demand.SerializeToString())
        self.last = demand
        return demand

    def _trace(self, demand: pb.MeshDemand) -> None:
        changed = self.last is None or self.last.executors_wanted != demand.executors_wanted
        if changed:
            log.info("executors wanted: %d (%s; horizon %.1f s)", demand.executors_wanted, explain(demand),
                     demand.horizon_s)
        if telemetry.enabled():
            with telemetry.tracer("batchline.scheduler").start_as_current_span("demand") as span:
                span.set_attribute("batchline.executors_wanted", demand.executors_wanted)
                span.set_attribute("batchline.horizon_s", demand.horizon_s)
                span.set_attribute("batchline.demand", explain(demand))

    def forget(self) -> None:
        """Another scheduler led meanwhile: measure again from the next reads (its sequences in flight
        and capacities too, which this one's last term left)."""
        self.rates.clear()
        self._in_flight.clear()
        self._started.clear()
        self._capacity.clear()
        self.last = None

    def forget_gauges(self) -> None:
        """The lease is lost: a standby wants nothing, so that max() over the schedulers is the leader's."""
        metrics.EXECUTORS_WANTED.set(0)
        for key in self.rates:  # every model measured, generative ones (no batch capacity cached) included
            self._remove_gauges(key)

    @staticmethod
    def _remove_gauges(key: ModelKey) -> None:
        for gauge in (metrics.ARRIVAL_RATE_FORECAST, metrics.EXECUTOR_CAPACITY):
            try:
                gauge.remove(*key)
            except KeyError:
                pass


def _rounded(x: float) -> float:
    return float(f"{x:.2g}")


def explain(demand: pb.MeshDemand) -> str:
    """The numbers behind a decision, one model after another."""
    return "; ".join(
        f"{m.name}:{m.version} {m.arrival_rate:.1f}/s now, {m.forecast_rate:.1f}/s forecast, "
        + (f"{m.queued_rate:.1f}/s by its queue, " if m.queued_rate > m.forecast_rate else "")
        + f"{m.capacity:.1f}/s per executor within {m.budget_s * 1000:.0f} ms, {m.backlog} queued: "
        f"{max(m.by_forecast, m.by_backlog):.2f} executors" for m in demand.models) or "nothing served"
