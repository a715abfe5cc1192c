"""Per-model latency profile: predicted service time of a batch of n units.

A batch's units are its rows times its length (elements per row at the
model's variable dims, 1 for fixed shapes: batchline.sizing), so one profile
serves a text model's short and long sequences alike. Learned online from
executors' reports (and their warm-up runs at load) as a fit of ``a·n + b``
over a sliding window. The fit goes through the median time of each size seen, so that a few slow outliers (a noisy
neighbour, a GC pause) do not tilt it; the margin added to a prediction is a
high quantile of the residuals, so a prediction errs late rather than early.
Before any sample it predicts a default cost so a fresh model is not
scheduled blind-optimistic. Real batches replace the warm-up runs at once
(made-up inputs time differently), but while they have come in one size
only, the warm-up's line still says how the cost grows with size.

The margin depends on the batch's size: on a shared host a batch of 600
units overruns its fit by tens of milliseconds when one of 30 units overruns
by a few, and a single margin across sizes made every small batch look as
uncertain as the largest (after a spell of large batches, one request alone
was refused a 200 ms budget it met with 150 ms to spare). So the residuals
are taken per size class (units in [2^k, 2^(k+1)), with the classes either
side): `margins()[k]`. A class with too few samples nearby borrows the nearest
measured class's margin, scaled by how the two classes' typical costs compare.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from batchline.planning import BatchCost
from batchline.sizing import margin_for

# Samples a size class (with its neighbours) needs for a margin of its own.
MIN_CLASS_SAMPLES = 20


class LatencyProfile:
    def __init__(self, window: int = 512, default: float = 0.005, margin_quantile: float = 0.99) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        # Timed warm-up runs at load: what the profile goes by until real batches report. Their
        # inputs are made up (zeros, 8-token sequences for a text model), so the first real
        # report retires them rather than mixing with it.
        self._warm_up: deque[tuple[int, float]] = deque(maxlen=window)
        self._default = default
        self._quantile = margin_quantile
        self._fit: tuple[float, float, float] | None = None  # a, b, margin (over every size)
        self._margins: tuple[float, ...] = ()  # per size class; () = the overall margin for all
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
        """(a, b, margin) of the current fit; the margin over batches of every size."""
        if not self._samples and not self._warm_up:
            return 0.0, self._default, 0.0
        if self._fit is None:
            self._fit, self._margins = self._refit()
            self._unfitted = 0
        return self._fit

    def margins(self) -> tuple[float, ...]:
        """The margin per size class k (batches of units in [2^k, 2^(k+1))); () = the overall one for all."""
        self.coefficients()
        return self._margins

    def margin(self, units: int) -> float:
        return margin_for(self.margins(), units, self.coefficients()[2])

    def cost(self, overhead_s: float = 0.0) -> BatchCost:
        """What a batch costs by the current fit, with `overhead_s` per batch outside the model."""
        a, b, margin = self.coefficients()
        return BatchCost(a, b, margin, self._margins, overhead_s)

    def expected(self, units: int) -> float:
        """The central estimate (no margin)."""
        return self.cost().typical(units)

    def predict(self, units: int) -> float:
        """The estimate plus the margin of its size: late rather than early."""
        return self.cost().predict(units)

    def _refit(self) -> tuple[tuple[float, float, float], tuple[float, ...]]:
        n, t = _arrays(self._samples or self._warm_up)
        sizes, medians, counts = _medians(n, t)
        shape = _line(sizes, medians, counts, float(np.median(t)))
        if shape is None:
            # One size seen: the warm-up's line through sizes 1, 2, 4, ... gives the shape (how much
            # of a batch's cost is fixed), scaled to pass through what real batches of that size
            # took; without one, proportional to units through the origin. Proportional from one-row
            # batches would make a model whose cost is nearly all fixed look 64 times dearer at 64
            # rows, and shed a large request as hopeless before it ran.
            warm = self._warm_up_line() if self._samples else None
            size, median = max(float(sizes[0]), 1.0), float(medians[0])
            if warm is not None and warm[0] * size + warm[1] > 0:
                scale = median / (warm[0] * size + warm[1])
                a, b = warm[0] * scale, warm[1] * scale
            else:
                a, b = median / size, 0.0
        else:
            a, b = shape
        resid = t - (a * n + b)
        margin = max(0.0, float(np.quantile(resid, self._quantile)))
        return (a, b, margin), self._class_margins(n, resid, a, b, float(t.max()))

    def _warm_up_line(self) -> tuple[float, float] | None:
        if not self._warm_up:
            return None
        n, t = _arrays(self._warm_up)
        return _line(*_medians(n, t), float(np.median(t)))

    def _class_margins(self, n: np.ndarray, resid: np.ndarray, a: float, b: float,
                       slowest_s: float) -> tuple[float, ...]:
        classes = np.maximum(0, np.floor(np.log2(np.maximum(n, 1)))).astype(int)
        top = int(classes.max())
        own: list[float | None] = []
        for k in range(top + 1):
            near = np.abs(classes - k) <= 1
            own.append(max(0.0, float(np.quantile(resid[near], self._quantile)))
                       if int(near.sum()) >= MIN_CLASS_SAMPLES else None)
        measured = [k for k, m in enumerate(own) if m is not None]
        if not measured:
            return ()

        def typical(k: int) -> float:  # the fit at the middle of class k
            return max(a * 1.5 * 2**k + b, 1e-6)

        table = []
        for k, m in enumerate(own):
            if m is None:
                j = min(measured, key=lambda j: (abs(j - k), -j))
                # Scaled from the nearest class measured, but never past the slowest run seen: a fit
                # whose line is near zero at class j (a negative intercept) would scale it ten-thousandfold.
                m = min(own[j] * typical(k) / typical(j), slowest_s)
            table.append(m)
        return tuple(table)


def _arrays(samples: deque[tuple[int, float]]) -> tuple[np.ndarray, np.ndarray]:
    return (np.array([s[0] for s in samples], dtype=float), np.array([s[1] for s in samples], dtype=float))


def _medians(n: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each size seen, the median time of its samples, and how many it has."""
    # Sorted by size then time, the middle of each run.
    order = np.lexsort((t, n))
    ordered = t[order]
    sizes, starts, counts = np.unique(n[order], return_index=True, return_counts=True)
    return sizes, (ordered[starts + (counts - 1) // 2] + ordered[starts + counts // 2]) / 2, counts


def _line(sizes: np.ndarray, medians: np.ndarray, counts: np.ndarray, flat: float) -> tuple[float, float] | None:
    """a, b of the line through each size's median time, weighted by its samples; None for one size."""
    if len(sizes) < 2:
        return None
    a, b = np.polyfit(sizes, medians, 1, w=np.sqrt(counts))
    if a < 0:  # noise made bigger batches look cheaper: fall back to a flat cost
        return 0.0, flat
    return float(a), float(b)
