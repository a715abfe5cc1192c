"""`batchline up --autoscale MIN:MAX`: executors started and stopped to follow what the leader
scheduler wants (scheduler/demand.py publishes it in bl:demand).

The policy (`ScalePolicy`, pure, time passed in) starts executors at once when more are wanted, up
to MAX: an executor takes its start time to serve, which the forecast already looked ahead by.
It stops them only when fewer have been wanted for a whole cool-down, with a hysteresis: the
demand must fit in fewer executors with HYSTERESIS of an executor to spare, so that a demand
hovering at a boundary does not start and stop one executor over and over; and it stops only as
many as the highest demand of the cool-down leaves spare. The cool-down is insurance against a
return the forecast does not see: while every rise has been foreseen (the executors were asked for
before the rate reached them), it shortens to the forecast's horizon. Without a published demand
(no leader) it keeps what runs. A stopping executor drains: it finishes or hands back the batches
it holds, so no request is lost and none runs twice. Each decision is logged with the numbers
behind it and counted in batchline_scale_events_total{direction,reason}.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from batchline.protocol import internal_pb2 as pb

# Of an executor: the demand must fit in fewer executors with this much to spare before they stop.
HYSTERESIS = 0.2
COOL_DOWN_S = 30.0
# For this many cool-downs after the demand rose past what its forecast had asked for, the whole
# cool-down holds (ten: 300 s at the default, Kubernetes' own scale-down stabilisation window).
SURPRISE_COOL_DOWNS = 10
# How often `batchline up` reads the demand.
READ_EVERY_S = 1.0


def parse_bounds(text: str) -> tuple[int, int]:
    """MIN:MAX, e.g. 1:4 (MIN >= 1: a mesh without executors answers nothing, and measures no start time)."""
    low, sep, high = text.partition(":")
    try:
        bounds = int(low), int(high if sep else low)
    except ValueError:
        raise ValueError(f"--autoscale takes MIN:MAX, e.g. 1:4, not {text!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise ValueError(f"--autoscale {text}: need 1 <= MIN <= MAX")
    return bounds


@dataclass(frozen=True, slots=True)
class Decision:
    target: int
    direction: str   # up | down
    reason: str      # forecast | queue | backlog | bounds | cool_down
    why: str         # the numbers behind it, for the log


def needed(demand: pb.MeshDemand) -> tuple[float, str]:
    """The fractional executors the demand asks for, and which term asks most: backlog, queue (the
    rate a model's queue shows arriving, above its forecast) or forecast."""
    by_forecast = sum(m.by_forecast for m in demand.models)
    by_backlog = sum(max(0.0, m.by_backlog - m.by_forecast) for m in demand.models)
    surge = any(m.queued_rate > m.forecast_rate for m in demand.models)
    return by_forecast + by_backlog, ("backlog" if by_backlog > 0 else "queue" if surge else "forecast")


def arriving(demand: pb.MeshDemand) -> float:
    """The executors that the rate arriving now (the last step's, not the forecast) fills to capacity."""
    return sum(m.arrival_rate / m.capacity for m in demand.models if m.capacity > 0)


def explain(demand: pb.MeshDemand) -> str:
    return "; ".join(f"{m.name}:{m.version} {m.forecast_rate:.1f}/s forecast"
                     + (f", {m.queued_rate:.1f}/s arriving now by its queue" if m.queued_rate > m.forecast_rate else "")
                     + f", {m.capacity:.1f}/s per executor, {m.backlog} queued"
                     for m in demand.models) or "no model served"


@dataclass
class ScalePolicy:
    low: int
    high: int
    cool_down_s: float = COOL_DOWN_S
    hysteresis: float = HYSTERESIS
    # The highest demand (fractional executors) since fewer executors began to suffice; None: they do not.
    _peak: float | None = None
    _since: float = 0.0
    # When the demand last rose past what its forecast had asked for (None: not yet).
    _surprised: float | None = None

    def cool_down(self, now: float, demand: pb.MeshDemand) -> float:
        """The cool-down that holds now. It insures against a return that no forecast sees, so it is
        whole for SURPRISE_COOL_DOWNS cool-downs after a rise the forecast did not ask for (or while
        the forecast has no horizon); otherwise it is the forecast's horizon, the time an executor
        takes to serve again, which the forecast looks ahead by."""
        memory = SURPRISE_COOL_DOWNS * self.cool_down_s
        if demand.horizon_s <= 0 or (self._surprised is not None and now - self._surprised < memory):
            return self.cool_down_s
        return min(self.cool_down_s, demand.horizon_s)

    def decide(self, now: float, running: int, demand: pb.MeshDemand | None) -> Decision | None:
        """What to do with `running` executors given the leader's `demand` (None: none published)."""
        if running < self.low or running > self.high:
            target = min(self.high, max(self.low, running))
            return Decision(target, "up" if target > running else "down", "bounds",
                            f"--autoscale {self.low}:{self.high}")
        if demand is None:
            self._peak = None
            return None
        need, reason = needed(demand)
        up = min(self.high, max(self.low, math.ceil(need - 1e-9)))
        if up > running:
            self._peak = None
            if reason != "forecast" or arriving(demand) > running:
                self._surprised = now  # the rise came before the executors asked for it
            return Decision(up, "up", reason, f"{need:.2f} executors wanted: {explain(demand)}")
        fits = min(self.high, max(self.low, math.ceil(need + self.hysteresis - 1e-9)))
        if fits >= running:
            self._peak = None
            return None
        if self._peak is None:
            self._peak, self._since = need, now
        self._peak = max(self._peak, need)
        cool_down = self.cool_down(now, demand)
        if now - self._since < cool_down:
            return None
        target = min(running - 1, max(self.low, math.ceil(self._peak + self.hysteresis - 1e-9)))
        peak, self._peak = self._peak, None
        return Decision(target, "down", "cool_down",
                        f"at most {peak:.2f} executors wanted for {cool_down:.0f} s: {explain(demand)}")
