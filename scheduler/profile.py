"""Per-model latency profile: predicted service time of a batch of n units.

A batch's units are its rows times its length (elements per row at the
model's variable dims, 1 for fixed shapes: batchline.sizing), so one profile
serves a text model's short and long sequences alike. Learned online from
executors' reports (and their warm-up runs at load) as a fit of ``a·n + b``
over a sliding window. The fit goes through the median time of each size seen, so that a few slow outliers (a noisy
neighbour, a GC pause) do not tilt it; the margin added to a prediction is a
high quantile of the residuals, so a prediction errs late rather than early.
Before any sample it predicts a default cost so a fresh model is not
scheduled blind-optimistic.
"""
from __future__ import annotations

from collections import deque

import numpy as np


class LatencyProfile:
    def __init__(self, window: int = 512, default: float = 0.005, margin_quantile: float = 0.99) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        # Timed warm-up runs at load: what the profile goes by until real batches report. Their
        # inputs are made up (zeros, 8-token sequences for a text model), so the first real
        # report retires them rather than mixing with it.
        self._warm_up: deque[tuple[int, float]] = deque(maxlen=window)
        self._default = default
        self._quantile = margin_quantile
        self._fit: tuple[float, float, float] | None = None  # a, b, margin
        # Refitting costs a sort per batch size: on a busy model, refit every few samples, not each.
        self._refit_every = max(1, min(16, window // 8))
        self._unfitted = 0

    def observe(self, units: int, seconds: float, warm_up: bool = False) -> None:
        if warm_up:
            self._warm_up.append((units, seconds))
            if not self._samples:
                self._fit = None
            return
        self._samples.append((units, seconds))
        self._unfitted += 1
        if len(self._samples) == 1 or self._unfitted >= self._refit_every:
            self._fit = None

    def samples(self) -> list[tuple[int, float]]:
        """Samples from real batches, oldest first."""
        return list(self._samples)

    def warm_up_samples(self) -> list[tuple[int, float]]:
        return list(self._warm_up)

    def __len__(self) -> int:
        return len(self._samples) + len(self._warm_up)

    def coefficients(self) -> tuple[float, float, float]:
        """(a, b, margin) of the current fit."""
        if not self._samples and not self._warm_up:
            return 0.0, self._default, 0.0
        if self._fit is None:
            self._fit = self._refit()
            self._unfitted = 0
        return self._fit

    def expected(self, units: int) -> float:
        """The central estimate (no margin)."""
        a, b, _ = self.coefficients()
        return max(0.0, a * units + b)

    def predict(self, units: int) -> float:
        """The estimate plus the margin: late rather than early."""
        return self.expected(units) + self.coefficients()[2]

    def _refit(self) -> tuple[float, float, float]:
        samples = self._samples or self._warm_up
        n = np.array([s[0] for s in samples], dtype=float)
        t = np.array([s[1] for s in samples], dtype=float)
        # The median time of each size: sorted by size then time, the middle of each run.
        order = np.lexsort((t, n))
        ordered = t[order]
        sizes, starts, counts = np.unique(n[order], return_index=True, return_counts=True)
        medians = (ordered[starts + (counts - 1) // 2] + ordered[starts + counts // 2]) / 2
        if len(sizes) < 2:
            # One size seen: assume cost proportional to units through the median.
            a, b = float(medians[0]) / max(float(sizes[0]), 1.0), 0.0
        else:
            weights = np.sqrt(counts)
            a, b = np.polyfit(sizes, medians, 1, w=weights)
            a, b = float(a), float(b)
            if a < 0:  # noise made bigger batches look cheaper: fall back to a flat cost
                a, b = 0.0, float(np.median(t))
        resid = t - (a * n + b)
        margin = max(0.0, float(np.quantile(resid, self._quantile)))
        return a, b, margin
