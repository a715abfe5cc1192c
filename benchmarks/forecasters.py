"""Which arrival-rate forecaster the autoscaler uses: synthetic demand traces replayed through
candidate forecasters, by their error at the horizon and how early they see a rise coming.

    python benchmarks/forecasters.py [--horizon-s 10] [--seed 1]

Each trace is a true rate per second (documented below) with Poisson arrivals drawn from it at a
fixed seed; a forecaster sees the counts of each second and, after each, forecasts the rate
`horizon` seconds ahead. Per trace and forecaster: the mean absolute error against the true rate
there (MAE), the mean shortfall (the part of the error that under-provisions), and the lead: how
many seconds before the true rate first rises through three quarters of the way to its peak
(after the warm-up) the forecast said it would (negative: after; the horizon is the most a
forecaster can lead by). docs/design/autoscaling.md cites the table.
"""
from __future__ import annotations

import argparse
import math
import random
from typing import Callable

from batchline.planning.forecast import Holt

SECONDS = 240
WARM_UP = 30  # seconds every candidate needs before it is judged
PERIOD = 60


def step(t: int) -> float:
    return 50.0 if t < 120 else 150.0                              # 3x at t = 120 s


def ramp(t: int) -> float:
    return 50.0 + 200.0 * min(1.0, max(0.0, (t - 60) / 120))      # 50 to 250/s over two minutes


def periodic(t: int) -> float:
    return 100.0 + 60.0 * math.sin(2 * math.pi * t / PERIOD)      # a 60 s cycle between 40 and 160/s


def noisy(t: int) -> float:
    return 100.0                                                   # constant: any move is noise


TRACES: dict[str, Callable[[int], float]] = {"step": step, "ramp": ramp, "periodic": periodic, "noisy": noisy}


class Last:
    """The last second's rate, held: what a reactive scaler goes by."""
    def __init__(self) -> None:
        self.value = 0.0

    def update(self, v: float) -> None:
        self.value = v

    def forecast(self, ahead: float) -> float:
        return self.value


class Ewma(Last):
    def __init__(self, alpha: float) -> None:
        super().__init__()
        self.alpha, self.seen = alpha, False

    def update(self, v: float) -> None:
        self.value = v if not self.seen else self.alpha * v + (1 - self.alpha) * self.value
        self.seen = True


class LinearFit(Last):
    """Least squares over the last `window` seconds, extrapolated."""
    def __init__(self, window: int) -> None:
        super().__init__()
        self.window, self.history = window, []

    def update(self, v: float) -> None:
        self.history = (self.history + [v])[-self.window:]

    def forecast(self, ahead: float) -> float:
        n = len(self.history)
        if n < 2:
            return self.history[-1] if self.history else 0.0
        xs = range(n)
        mx, my = (n - 1) / 2, sum(self.history) / n
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, self.history)) / sum((x - mx) ** 2 for x in xs)
        return max(0.0, my + slope * (n - 1 - mx + ahead))


CANDIDATES: dict[str, Callable[[], object]] = {
    "last value": Last,
    "EWMA a=0.3": lambda: Ewma(0.3),
    "linear fit 20 s": lambda: LinearFit(20),
    "Holt a=.5 b=.2": lambda: Holt(0.5, 0.2, phi=1.0),
    "damped Holt a=.5 b=.2 phi=.9": Holt,
    "damped Holt a=.3 b=.1 phi=.9": lambda: Holt(0.3, 0.1),
    "Holt-Winters (period 60 s)": lambda: Holt.for_period(PERIOD),
}


def poisson(rng: random.Random, mean: float) -> int:
    # Knuth's for small means, normal beyond (exact enough for rates of 50-250/s).
    if mean > 30:
        return max(0, round(rng.gauss(mean, math.sqrt(mean))))
    limit, k, p = math.exp(-mean), 0, 1.0
    while p > limit:
        k, p = k + 1, p * rng.random()
    return k - 1


def score(trace: Callable[[int], float], make: Callable[[], object], horizon: int,
          seed: int) -> tuple[float, float, float | None]:
    rng = random.Random(seed)
    f = make()
    errors, shortfalls, warned = [], [], None
    low, high = min(trace(t) for t in range(SECONDS)), max(trace(t) for t in range(SECONDS))
    mark = low + 0.75 * (high - low)
    crossed = next((t for t in range(WARM_UP + 2 * horizon, SECONDS) if trace(t - 1) < mark <= trace(t)), None) \
        if high > low * 1.2 else None
    for t in range(SECONDS - horizon):
        f.update(float(poisson(rng, trace(t))))
        predicted, truth = f.forecast(horizon), trace(t + horizon)
        if t >= WARM_UP:
            errors.append(abs(predicted - truth))
            shortfalls.append(max(0.0, truth - predicted))
        if warned is None and crossed is not None and t >= crossed - 2 * horizon and predicted >= mark:
            warned = t
    lead = None if crossed is None or warned is None else crossed - warned
    return sum(errors) / len(errors), sum(shortfalls) / len(shortfalls), lead


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--horizon-s", type=int, default=10)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()
    print(f"horizon {a.horizon_s} s, seed {a.seed}; MAE / mean shortfall in requests/s; lead in s")
    print(f"{'forecaster':32}" + "".join(f"{name:>24}" for name in TRACES))
    for label, make in CANDIDATES.items():
        cells = []
        for trace in TRACES.values():
            mae, short, lead = score(trace, make, a.horizon_s, a.seed)
            cells.append(f"{mae:6.1f} / {short:5.1f} / " + (f"{lead:+4d}" if lead is not None else "   -"))
        print(f"{label:32}" + "".join(f"{c:>24}" for c in cells))


if __name__ == "__main__":
    main()
