"""The arrival-rate forecaster: Holt's linear smoothing of per-second rates, damped, with an
additive seasonal term when a period is configured (Holt-Winters).

Why this one (docs/design/autoscaling.md has the measurements): it is three numbers a person can
read (the level, the trend, the season's offset now), it reacts within a few seconds to a ramp,
the damping keeps a burst's slope from being extrapolated past the horizon, and it needs no
history beyond its state. Pure: every step is given its time and its count; nothing reads a clock.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

# Smoothing of the level, the trend and the seasonal term, and the trend's damping per step.
# Chosen by replaying step, ramp, periodic and noisy traces (benchmarks/forecasters.py).
ALPHA = 0.5
BETA = 0.2
GAMMA = 0.3
PHI = 0.9
# With a seasonal term the season carries the swings, so the level and the trend follow slowly:
# at ALPHA and BETA they would chase the wave themselves and fight it.
SEASONAL_ALPHA = 0.2
SEASONAL_BETA = 0.05


@dataclass
class Holt:
    """Damped Holt (optionally Holt-Winters) on a series of one value per step."""
    alpha: float = ALPHA
    beta: float = BETA
    phi: float = PHI
    period: int = 0          # steps per season; 0: no seasonal term
    gamma: float = GAMMA
    level: float | None = None
    trend: float = 0.0
    season: list[float] = field(default_factory=list)
    steps: int = 0

    @classmethod
    def for_period(cls, period: int) -> Holt:
        """The forecaster for a demand with `period` steps per season (0: none)."""
        return cls(SEASONAL_ALPHA, SEASONAL_BETA, period=period) if period else cls()

    def update(self, value: float) -> None:
        s = self._season(self.steps)
        if self.level is None:
            self.level = value - s
        else:
            previous = self.level
            self.level = self.alpha * (value - s) + (1 - self.alpha) * (previous + self.phi * self.trend)
            self.trend = self.beta * (self.level - previous) + (1 - self.beta) * self.phi * self.trend
        if self.period:
            i = self.steps % self.period
            if self.steps < self.period:
                # The first season is only recorded; at its end the level restarts from its mean
                # and each offset from its step's deviation from that mean (the classical start).
                self.season.append(value)
                if len(self.season) == self.period:
                    mean = sum(self.season) / self.period
                    self.season = [v - mean for v in self.season]
                    self.level, self.trend = mean, 0.0
            else:
                self.season[i] = self.gamma * (value - self.level) + (1 - self.gamma) * s
        self.steps += 1

    def forecast(self, steps_ahead: float) -> float:
        """The value expected `steps_ahead` steps after the last update (never below 0)."""
        if self.level is None:
            return 0.0
        damped = sum(self.phi ** i for i in range(1, int(steps_ahead) + 1)) if self.phi < 1 else steps_ahead
        return max(0.0, self.level + damped * self.trend + self._season(self.steps - 1 + round(steps_ahead)))

    def _season(self, step: int) -> float:
        """The seasonal offset of step number `step` (0 until a whole season has been seen)."""
        if not self.period or len(self.season) < self.period or self.steps < self.period:
            return 0.0
        return self.season[step % self.period]


@dataclass
class ArrivalRate:
    """Per-second arrival rates from a cumulative count read now and then, smoothed by Holt.

    `observe(t, total)` takes the count of arrivals ever (gateways add to it); a count that went
    down (its key expired, Redis restarted) starts a new baseline. Reads more than a step apart
    feed one rate for each step they span, so a late read does not look like a burst."""
    step_s: float = 1.0
    holt: Holt = field(default_factory=Holt)
    last_t: float | None = None
    last_total: int = 0
    rate: float = 0.0        # the last step's measured rate

    def observe(self, t: float, total: int) -> bool:
        """Record the count at time `t`; True when a step was completed (the forecast moved)."""
        if self.last_t is None or total < self.last_total:
            self.last_t, self.last_total = t, total
            return False
        elapsed = t - self.last_t
        if elapsed < self.step_s:
            return False
        self.rate = (total - self.last_total) / elapsed
        for _ in range(min(int(elapsed / self.step_s), 60)):
            self.holt.update(self.rate)
        self.last_t, self.last_total = t, total
        return True

    def forecast(self, horizon_s: float) -> float:
        """Arrivals per second expected `horizon_s` from the last step."""
        return self.holt.forecast(horizon_s / self.step_s)

    def ahead(self, horizon_s: float) -> float:
        """The highest rate expected from now until executors asked for at the next step serve:
        `horizon_s` (their start time) and one step more. The executors serving now must serve now;
        those asked for now serve from `horizon_s` on, and the next step's only a step later, so
        what is wanted now must cover that step too (without it a rise a start time ahead is met
        a step late, which is a second of refusals on every burst)."""
        steps = math.ceil(horizon_s / self.step_s - 1e-9) + 1
        return max(self.holt.forecast(k) for k in range(steps + 1))
