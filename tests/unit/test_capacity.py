"""One executor's capacity within a budget, and the executors a demand wants
(batchline/planning/capacity.py): pure, with costs given as functions."""
from __future__ import annotations

import pytest

from batchline.planning import BatchingRule, FunctionCost, Pending, play
from batchline.planning.capacity import QUEUED_FOR_RATE, QUEUED_SPAN_S, executor_capacity, need, queued_rate, wanted

COST = FunctionCost(lambda units: 0.004 + 0.001 * units)  # 4 ms a batch plus 1 ms a row


def served_in_time(rule: BatchingRule, budget_s: float, rate: float, n: int = 400) -> bool:
    stream = [Pending(str(i), 1, 1, i / rate + budget_s, i / rate) for i in range(n)]
    played = play(stream, [0.0], rule, COST)
    return not played.shed and all(b.finish <= min(m.deadline for m in b.members) for b in played.batches)


@pytest.mark.parametrize("budget_s", [0.02, 0.05])
def test_capacity_is_the_highest_rate_the_play_serves_in_time(budget_s):
    rule = BatchingRule(32)
    capacity = executor_capacity(rule, COST, budget_s)
    assert served_in_time(rule, budget_s, capacity * 0.98)
    assert not served_in_time(rule, budget_s, capacity * 1.1)


def test_a_loose_budget_reaches_the_saturation_of_full_batches():
    assert executor_capacity(BatchingRule(32), COST, 10.0) == pytest.approx(32 / 0.036)


def test_capacity_follows_the_batching_rule_and_the_lanes():
    assert executor_capacity(BatchingRule(0), COST, 1.0) == pytest.approx(1 / 0.005)  # one request a batch
    one = executor_capacity(BatchingRule(8), COST, 1.0)
    assert executor_capacity(BatchingRule(8), COST, 1.0, lanes=2) == pytest.approx(2 * one)


def test_a_budget_no_request_fits_gives_no_capacity():
    assert executor_capacity(BatchingRule(8), COST, 0.004) == 0.0


def test_the_forecast_is_met_at_the_target_utilisation():
    n = need(forecast_rate=140.0, capacity=100.0, target_utilisation=0.7, backlog=0, budget_s=0.1)
    assert n.by_forecast == pytest.approx(2.0)
    assert n.wanted == 2


def test_the_backlog_is_a_floor_the_forecast_cannot_lower():
    n = need(forecast_rate=0.0, capacity=100.0, target_utilisation=0.7, backlog=45, budget_s=0.1)
    assert n.by_backlog == pytest.approx(4.5)
    assert n.wanted == 5


def test_the_mesh_adds_the_models_fractional_needs():
    a = need(35.0, 100.0, 0.7, 0, 0.1)  # half an executor
    b = need(35.0, 100.0, 0.7, 0, 0.1)
    assert wanted([a, b]) == 1
    assert wanted([]) == 0


def test_a_generative_models_capacity_is_its_slots_over_the_time_a_sequence_holds_one():
    from batchline.planning.capacity import generation_capacity

    # 16 slots, a sequence in flight 2 s: 8 requests/s.
    assert generation_capacity(16, 2.0) == pytest.approx(8.0)
    # A 50 ms budget per token with decode steps of 5 ms per sequence: 10 at once, not 16.
    assert generation_capacity(16, 2.0, decode_row_s=0.005, tpot_s=0.05) == pytest.approx(5.0)
    # A budget no step meets still runs one at a time; nothing measured yet is no capacity.
    assert generation_capacity(16, 2.0, decode_row_s=0.1, tpot_s=0.05) == pytest.approx(0.5)
    assert generation_capacity(16, 0.0) == 0.0 and generation_capacity(0, 2.0) == 0.0


def test_capacity_is_played_with_requests_of_the_typical_length():
    # A per-token cost: 16-token requests are 16 units each, so an executor serves far fewer of them.
    rule, budget_s = BatchingRule(32), 0.2
    short = executor_capacity(rule, COST, budget_s)
    long = executor_capacity(rule, COST, budget_s, length=16)
    assert long < short / 4
    rate = 0.95 * long
    stream = [Pending(str(i), 1, 1, i / rate + budget_s, i / rate, length=16) for i in range(400)]
    played = play(stream, [0.0], rule, COST)
    assert not played.shed and all(b.finish <= min(m.deadline for m in b.members) for b in played.batches)
    with pytest.raises(ValueError, match="length must be at least 1, got 0"):
        executor_capacity(rule, COST, budget_s, length=0)


def test_the_margin_counts_once_per_request_not_once_per_batch_queued_ahead():
    # A steady queue's wait is many batches' typical runs; only the request's own batch is taken at its margin.
    margin = 0.02
    with_margin = FunctionCost(lambda units: 0.004 + 0.001 * units + margin, lambda units: 0.004 + 0.001 * units)
    rule = BatchingRule(8)
    assert executor_capacity(rule, with_margin, 0.2) == pytest.approx(executor_capacity(rule, COST, 0.2 - margin))
    assert executor_capacity(rule, with_margin, 0.2) > 0.9 * executor_capacity(rule, COST, 0.2)


def test_the_queue_shows_a_surge_before_a_rate_over_a_step_does():
    # 128 requests queued in the last 20 ms, a quarter of what one executor finishes in the budget
    # (1600/s x 0.2 s = 320) and more: at least (128 - 2 sqrt(128)) / 0.02 = 5,269/s arriving now.
    assert queued_rate(128, 0.02, 320) == pytest.approx((128 - 2 * 128 ** 0.5) / 0.02)
    # A queue a batching model keeps in steady traffic says nothing: under a quarter of it, or too few.
    assert queued_rate(79, 0.002, 320) == 0.0
    assert queued_rate(QUEUED_FOR_RATE - 1, 0.002, 0) == 0.0
    # A span too short to divide by.
    assert queued_rate(100, 0.0, 320) == pytest.approx((100 - 20) / QUEUED_SPAN_S)
    # The forecast still says 800/s: the queue's rate is the floor, at the same target utilisation.
    n = need(800.0, 1600.0, 0.8, 128, 0.2, now_rate=6400.0)
    assert n.by_forecast == pytest.approx(5.0) and n.wanted == 5
    # Below the forecast it changes nothing.
    assert need(800.0, 1600.0, 0.8, 0, 0.2, now_rate=100.0) == need(800.0, 1600.0, 0.8, 0, 0.2)
