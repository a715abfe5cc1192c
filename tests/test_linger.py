"""When the gateway's group commit waits for company (gateway/linger.py): times passed in."""
from __future__ import annotations

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


def test_requests_closer_than_the_window_wait_for_each_other():
    linger = Linger(0.002)
    _arrivals(linger, 10.0, 0.0015, 5)
    assert linger.wait_s(BUSY) == 0.002


def test_requests_further_apart_than_the_window_do_not_wait():
    linger = Linger(0.002)
    _arrivals(linger, 10.0, 0.005, 20)
    assert linger.wait_s(BUSY) == 0.0


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


def test_a_zero_window_never_waits():
    linger = Linger(0.0)
    _arrivals(linger, 10.0, 0.0001, 50)
    assert linger.wait_s(BUSY) == 0.0


def test_a_gateway_with_few_requests_in_flight_does_not_wait():
    linger = Linger(0.002)
    _arrivals(linger, 10.0, 0.0005, 20)
    assert linger.wait_s(7) == 0.0  # close together, but the gateway is not busy
    assert linger.wait_s(8) == 0.002
