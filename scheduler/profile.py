"""Per-model latency profile: predicted execution time of a batch of n rows.

Learned online from executors' reports as a least-squares fit of
``a·n + b`` over a sliding window, plus a margin of the residuals' spread so
that a prediction errs late rather than early. Before any report it predicts
from a default cost so a fresh model is not scheduled blind-optimistic.
"""
from __future__ import annotations

from collections import deque

import numpy as np


class LatencyProfile:
    def __init__(self, window: int = 256, default: float = 0.005, margin_sigmas: float = 2.0) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._default = default
        self._sigmas = margin_sigmas
        self._fit: tuple[float, float, float] | None = None  # a, b, margin

    def observe(self, rows: int, seconds: float) -> None:
        self._samples.append((rows, seconds))
        self._fit = None

    @property
    def samples(self) -> int:
        return len(self._samples)

    def predict(self, rows: int) -> float:
        if not self._samples:
            return self._default
        if self._fit is None:
            self._fit = self._refit()
        a, b, margin = self._fit
        return max(0.0, a * rows + b) + margin

    def _refit(self) -> tuple[float, float, float]:
        n = np.array([s[0] for s in self._samples], dtype=float)
        t = np.array([s[1] for s in self._samples], dtype=float)
        if len(set(n.tolist())) < 2:
            # One batch size seen: assume cost proportional to rows through the mean.
            mean = float(t.mean())
            return mean / max(float(n.mean()), 1.0), 0.0, self._sigmas * float(t.std())
        a, b = np.polyfit(n, t, 1)
        a = max(float(a), 0.0)
        resid = t - (a * n + b)
        return a, float(b), self._sigmas * float(resid.std())
