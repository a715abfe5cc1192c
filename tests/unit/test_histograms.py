"""batchline.histograms adds to a histogram what one observe() per value would."""
import math

import pytest
from prometheus_client import CollectorRegistry, Histogram

from batchline.histograms import observe_each, observe_times
from batchline.metrics import STAGE_BUCKETS

VALUES = [-1.0, 0.0, 0.00025, 0.0002501, 0.003, 0.05, 30.0, 31.0, float("nan")]


def _pair():
    registry = CollectorRegistry()
    make = lambda name: Histogram(name, name, ["model"], buckets=STAGE_BUCKETS, registry=registry).labels("m")  # noqa: E731
    return make("one_by_one"), make("at_once")


def _samples(child) -> list[float]:
    return [s.value for s in child._child_samples()]


def _same(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) or x == pytest.approx(y)
                                    for x, y in zip(a, b))


def test_observe_each_matches_observe():
    one, many = _pair()
    for v in VALUES:
        one.observe(v)
    observe_each(many, VALUES)
    assert _same(_samples(one), _samples(many))


@pytest.mark.parametrize("value", VALUES)
def test_observe_times_matches_observe(value):
    one, many = _pair()
    for _ in range(7):
        one.observe(value)
    observe_times(many, value, 7)
    observe_times(many, value, 0)
    assert _same(_samples(one), _samples(many))


def test_nothing_observed_leaves_the_histogram_alone():
    _, many = _pair()
    before = _samples(many)
    observe_each(many, [])
    observe_times(many, 1.0, 0)
    assert _samples(many) == before
