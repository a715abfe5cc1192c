"""Observing a batch's worth of values into a Prometheus histogram in one step.

The stage histograms count once per request (their quantiles are the requests' own), but a
batch's members share most of their values: its run time, its wait for the model. prometheus_client
has no weighted observe, and one observe() per member (a lock and a scan of the buckets each) is
per-member work on the services' hot path. These add to a child's buckets and sum what that many
observe() calls would, each bucket touched once.
"""
from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from typing import Iterable

from prometheus_client import Histogram


def observe_times(child: Histogram, value: float, times: int) -> None:
    """What `times` calls of child.observe(value) add."""
    if times <= 0:
        return
    child._raise_if_not_observable()
    child._sum.inc(value * times)
    # observe() counts a value in the first bucket whose bound is >= it: bisect_left finds it (the
    # last bound is +Inf); NaN, which no bound is >=, it adds to the sum alone.
    if value == value:
        child._buckets[bisect_left(child._upper_bounds, value)].inc(times)


def observe_each(child: Histogram, values: Iterable[float]) -> None:
    """What child.observe(v) for every v of `values` adds."""
    bounds = child._upper_bounds
    counts: Counter[int] = Counter()
    total = 0.0
    seen = False
    for v in values:
        seen = True
        total += v
        if v == v:  # (NaN: the sum alone, as observe() does)
            counts[bisect_left(bounds, v)] += 1
    if not seen:
        return
    child._raise_if_not_observable()
    child._sum.inc(total)
    for i, n in counts.items():
        child._buckets[i].inc(n)
