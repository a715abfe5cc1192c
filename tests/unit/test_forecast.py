"""The arrival-rate forecaster (batchline/planning/forecast.py): pure, driven by explicit times."""
from __future__ import annotations

import math

import pytest

from batchline.planning.forecast import ArrivalRate, Holt


def feed(holt: Holt, values) -> Holt:
    for v in values:
        holt.update(v)
    return holt


def test_a_constant_rate_is_forecast_as_itself():
    h = feed(Holt(), [50.0] * 30)
    assert h.forecast(0) == pytest.approx(50.0)
    assert h.forecast(10) == pytest.approx(50.0)


def test_a_ramp_is_forecast_ahead_of_the_last_value_but_damped():
    h = feed(Holt(), [10.0 * t for t in range(40)])
    last = 390.0
    ahead = h.forecast(10)
    assert ahead > last + 20, "the trend carries the forecast up"
    assert ahead < last + 10 * 10, "damping: not more than the slope times the horizon"


def test_a_falling_rate_never_forecasts_below_zero():
    h = feed(Holt(), [100.0 - 10 * t for t in range(11)] + [0.0] * 3)
    assert h.forecast(30) >= 0.0


def test_the_seasonal_term_sees_the_next_peak_coming():
    period = 20
    wave = [100 + 80 * math.sin(2 * math.pi * t / period) for t in range(period * 6)]
    plain = feed(Holt(), wave)
    seasonal = feed(Holt.for_period(period), wave)
    # After six periods, at the wave's zero crossing: the peak is 5 steps ahead.
    truth = 100 + 80 * math.sin(2 * math.pi * (len(wave) + 4) / period)
    assert abs(seasonal.forecast(5) - truth) < abs(plain.forecast(5) - truth) / 2


def test_rates_come_from_cumulative_counts_at_explicit_times():
    r = ArrivalRate(step_s=1.0)
    assert not r.observe(100.0, 1_000)  # the baseline
    assert not r.observe(100.5, 1_010)  # within a step: no rate yet
    assert r.observe(101.0, 1_020)
    assert r.rate == pytest.approx(20.0)
    assert r.forecast(0) == pytest.approx(20.0)


def test_a_late_read_spreads_its_count_over_the_steps_it_spans():
    r = ArrivalRate(step_s=1.0)
    r.observe(0.0, 0)
    r.observe(1.0, 10)
    r.observe(5.0, 50)  # four seconds at 10/s, not one at 40/s
    assert r.rate == pytest.approx(10.0)
    assert r.holt.steps == 5
    assert r.forecast(3) == pytest.approx(10.0)


def test_a_count_that_went_down_starts_a_new_baseline():
    r = ArrivalRate(step_s=1.0)
    r.observe(0.0, 500)
    r.observe(1.0, 600)
    assert not r.observe(2.0, 5)  # the key expired or Redis restarted
    assert r.observe(3.0, 105)
    assert r.rate == pytest.approx(100.0)


def test_what_is_wanted_ahead_covers_now_and_one_step_past_the_horizon():
    period, burst = 10, [100.0] * 8 + [300.0] * 2
    r = ArrivalRate(step_s=1.0, holt=Holt.for_period(period))
    total, t = 0, 0.0
    r.observe(t, total)
    for value in burst * 4 + [100.0] * 3:  # the next burst begins 6 steps after the last one read
        t, total = t + 1, total + int(value)
        r.observe(t, total)
    assert r.forecast(5) < 200 < r.forecast(6)
    assert r.ahead(5) == pytest.approx(r.forecast(6))  # an executor asked for a step later would be late
    falling = ArrivalRate(step_s=1.0)
    for second, count in enumerate([0, 300, 550, 750, 900, 1000]):  # 300/s falling by 50/s a second
        falling.observe(float(second), count)
    assert falling.forecast(5) < falling.forecast(0) == falling.ahead(5)  # those serving now serve now
