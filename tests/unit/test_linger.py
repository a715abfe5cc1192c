"""When the gateway's group commit waits for company (gateway/linger.py): times passed in."""
from __future__ import annotations

import pytest

from gateway.linger import Linger

BUSY = 32  # requests in flight in the gateway


def _arrivals(linger: Linger, start: float, gap: float, n: int) -> float:
    t = start
    for _ in range(n):
        linger.arrived(t)
        t += gap
    return t


def test_a_lone_request_never_waits():
    linger = Linger(0.002)
    assert linger.wait_s(BUSY) == 0.0
    linger.arrived(10.0)
    assert linger.wait_s(BUSY) == 0.0  # no gap seen yet


@pytest.mark.parametrize("window, gap, n, in_flight, wait", [
    (0.002, 0.0015, 5, BUSY, 0.002),   # closer together than the window: they wait for each other
    (0.002, 0.005, 20, BUSY, 0.0),     # further apart: no wait
    (0.0, 0.0001, 50, BUSY, 0.0),      # no window: never
    (0.002, 0.0005, 20, 7, 0.0),       # close together, but the gateway is not busy
    (0.002, 0.0005, 20, 8, 0.002),
])
def test_steady_traffic(window, gap, n, in_flight, wait):
    linger = Linger(window)
    _arrivals(linger, 10.0, gap, n)
    assert linger.wait_s(in_flight) == wait


def test_the_wait_follows_the_rate_both_ways():
    linger = Linger(0.002)
    t = _arrivals(linger, 10.0, 0.0005, 20)
    assert linger.wait_s(BUSY) == 0.002
    # Traffic thins out: within a few arrivals the commit stops waiting ...
    t = _arrivals(linger, t, 0.004, 6)
    assert linger.wait_s(BUSY) == 0.0
    # ... and a burst after a long idle spell waits again within a few arrivals, not hundreds.
    linger.arrived(t + 600.0)
    _arrivals(linger, t + 600.0005, 0.0005, 8)
    assert linger.wait_s(BUSY) == 0.002
