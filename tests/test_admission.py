"""Unit tests for admission control (gateway/admission.py): pure, no I/O, explicit numbers."""
from __future__ import annotations

import pytest

from batchline.errors import DeadlineExceeded, ResourceExhausted
from batchline.protocol import internal_pb2 as pb
from gateway.admission import admit, batch_cost_s, drain_s, predicted_finish_s

MODEL = pb.ModelInfo(name="m", version="1", max_batch_size=8)


def load(*, per_row=0.01, fixed=0.02, margin=0.0, overhead=0.0, executors=1, backlog=0.0, queued=(0,)):
    return pb.ModelLoad(cost_per_row_s=per_row, cost_fixed_s=fixed, cost_margin_s=margin, overhead_s=overhead,
                        executors=executors, backlog_s=backlog, queued_rows=list(queued), policy="deadline")


def test_batch_cost_is_the_profile_plus_margin_and_overhead():
    assert batch_cost_s(load(margin=0.005, overhead=0.001), 4) == pytest.approx(0.04 + 0.02 + 0.005 + 0.001)


def test_drain_spreads_full_batches_over_executors():
    one, two = load(executors=1), load(executors=2)
    # 8 rows = one full batch: 0.1 s whatever the executors
    assert drain_s(one, 8, 8) == pytest.approx(0.1)
    # 32 rows = four full batches: one after another on one executor, two rounds on two
    assert drain_s(one, 8, 32) == pytest.approx(0.4)
    assert drain_s(two, 8, 32) == pytest.approx(0.2)
    # fewer rows than a batch: one smaller batch
    assert drain_s(one, 8, 2) == pytest.approx(0.04)


def test_prediction_counts_only_rows_at_this_priority_or_higher():
    view = load(queued=(8, 24))  # 8 rows at priority 1, 24 at priority 2
    assert predicted_finish_s(view, 8, 1, 1) == pytest.approx(drain_s(view, 8, 9))
    assert predicted_finish_s(view, 8, 2, 1) == pytest.approx(drain_s(view, 8, 33))


def test_prediction_adds_what_was_admitted_since_the_view_and_subtracts_the_time_worked_since():
    view = load(queued=(8,), backlog=0.3, executors=1)
    assert predicted_finish_s(view, 8, 1, 1) == pytest.approx(0.3 + drain_s(view, 8, 9))
    # 0.1 s later, with 16 more rows admitted meanwhile by this gateway:
    assert predicted_finish_s(view, 8, 1, 1, admitted_since=16, elapsed_s=0.1) == pytest.approx(0.2 + drain_s(view, 8, 25))
    # the backlog is spread over the executors, and never negative
    two = load(backlog=0.3, executors=2)
    assert predicted_finish_s(two, 8, 1, 1) == pytest.approx(0.15 + batch_cost_s(two, 1))
    assert predicted_finish_s(two, 8, 1, 1, elapsed_s=1.0) == pytest.approx(batch_cost_s(two, 1))


def test_admits_what_fits_in_the_budget():
    assert admit(load(queued=(8,)), MODEL, 1, 1, budget_s=1.0) is None


def test_overload_is_resource_exhausted_with_a_retry_hint():
    view = load(queued=(64,))
    finish = predicted_finish_s(view, 8, 1, 1)
    err = admit(view, MODEL, 1, 1, budget_s=0.2)
    assert isinstance(err, ResourceExhausted)
    assert err.retry_after_s == pytest.approx(finish - 0.2)
    assert "overloaded" in str(err) and "64 rows queued ahead" in str(err) and "200 ms budget" in str(err)


def test_rows_admitted_since_the_view_can_tip_the_balance():
    view = load(queued=(8,))
    assert admit(view, MODEL, 1, 1, budget_s=0.2) is None
    assert isinstance(admit(view, MODEL, 1, 1, budget_s=0.2, admitted_since=64), ResourceExhausted)


def test_a_budget_below_the_run_time_alone_is_deadline_exceeded():
    err = admit(load(), MODEL, 1, 4, budget_s=0.05)  # alone: 0.06 s
    assert isinstance(err, DeadlineExceeded)
    assert "raise the timeout" in str(err)


def test_headroom_refuses_earlier():
    view = load(queued=(8,))
    finish = predicted_finish_s(view, 8, 1, 1)
    assert admit(view, MODEL, 1, 1, budget_s=finish * 1.1) is None
    assert isinstance(admit(view, MODEL, 1, 1, budget_s=finish * 1.1, headroom=0.8), ResourceExhausted)


def test_higher_priority_is_admitted_where_lower_is_refused():
    view = load(queued=(0, 64))
    assert admit(view, MODEL, 1, 1, budget_s=0.2) is None
    assert isinstance(admit(view, MODEL, 2, 1, budget_s=0.2), ResourceExhausted)


def test_drain_uses_the_batch_size_the_scheduler_recently_sent():
    small = load(executors=1)
    small.batch_rows = 4.0
    # Under tight deadlines the scheduler sends batches of ~4, not 8: 32 rows take 8 of them.
    assert drain_s(small, 8, 32) == pytest.approx(batch_cost_s(small, 4) * 8)
    # never more than max_batch_size
    small.batch_rows = 100.0
    assert drain_s(small, 8, 32) == pytest.approx(drain_s(load(), 8, 32))
