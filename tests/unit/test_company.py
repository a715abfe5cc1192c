"""Unit tests for the company a queued request can expect (scheduler/company.py): pure, time passed in."""
from __future__ import annotations

import math

import pytest

from scheduler.company import CompanyRate


def test_unknown_until_enough_waiting_was_seen_with_that_many_queued():
    c = CompanyRate(tau=1.0, min_exposure_s=0.002)
    assert c.rate(1, now=0.0) is None
    c.observe(waiting=1, arrivals=0, seconds=0.0015, now=0.0015)
    assert c.rate(1, now=0.0015) is None
    c.observe(waiting=1, arrivals=0, seconds=0.0015, now=0.003)
    assert c.rate(1, now=0.003) == 0.0  # a lone client: nobody joins its request


def test_the_rate_is_per_number_waiting():
    """Four clients that send one request at a time: arrivals join one, two or three waiting
    requests, never four."""
    c = CompanyRate(tau=1.0, min_exposure_s=0.002)
    for step in range(100):
        t = step * 0.01
        c.observe(waiting=1, arrivals=1, seconds=0.001, now=t + 0.001)
        c.observe(waiting=3, arrivals=1, seconds=0.002, now=t + 0.003)
        c.observe(waiting=4, arrivals=0, seconds=0.005, now=t + 0.008)
    assert c.rate(1, now=1.0) == pytest.approx(1000.0)
    assert c.rate(3, now=1.0) == pytest.approx(500.0)
    assert c.rate(4, now=1.0) == 0.0
    assert c.rate(2, now=1.0) is None  # never seen: not known


def test_what_was_seen_fades_and_becomes_unknown_again():
    c = CompanyRate(tau=1.0, min_exposure_s=0.002)
    c.observe(waiting=4, arrivals=0, seconds=0.01, now=0.0)
    assert c.rate(4, now=1.0) == 0.0  # 0.01 s faded to 0.0037 s
    assert c.rate(4, now=math.log(5.0) + 0.01) is None  # faded below 0.002 s: try waiting again


def test_new_evidence_outweighs_faded_evidence():
    c = CompanyRate(tau=1.0, min_exposure_s=0.002)
    c.observe(waiting=2, arrivals=0, seconds=1.0, now=1.0)
    c.observe(waiting=2, arrivals=100, seconds=1.0, now=4.0)
    # The 1 s without arrivals counts for e^-3 of a second by now.
    assert c.rate(2, now=4.0) == pytest.approx(100 / (1 + math.exp(-3.0)))


def test_nothing_waiting_is_no_evidence():
    c = CompanyRate()
    c.observe(waiting=0, arrivals=5, seconds=1.0, now=1.0)
    c.observe(waiting=1, arrivals=5, seconds=0.0, now=1.0)
    assert c.rate(0, now=1.0) is None and c.rate(1, now=1.0) is None
