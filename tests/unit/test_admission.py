"""Unit tests for admission control (gateway/admission.py): pure, no I/O, explicit numbers.

Cost model throughout: a batch of n units (rows x length; length 1 unless a test says) takes
0.01·n + 0.02 s; max_batch_size 8.
"""
from __future__ import annotations

import pytest

from batchline.errors import DeadlineExceeded, ResourceExhausted, duration_text
from batchline.planning import BatchCost, Pending
from batchline.protocol import internal_pb2 as pb
from gateway.admission import Calibration, Candidate, admit, predicted_finish_s, retry_spacing_s

MODEL = pb.ModelInfo(name="m", version="1", max_batch_size=8)
NOW = 1000.0
INF = float("inf")


def cost(n: int) -> float:
    return 0.01 * n + 0.02


def tail(rows=0, limit=0, start=NOW, executor=0, free=(NOW,), length=0):
    """The view of a play whose last batch holds `rows` one-row requests starting at `start` on
    `executor` (free after it at free[executor]), with room for `limit` rows by its deadline."""
    free = list(free)
    if not rows:
        return pb.QueueTail(free_s=free)
    free[executor] = start
    deadline = INF if limit >= MODEL.max_batch_size else start + cost(limit * max(1, length)) + 1e-9
    item = pb.QueueTail.Item(rows=1, length=length, deadline_s=deadline)
    return pb.QueueTail(free_s=free, items=[item] * rows)


def load(*tails, margin=0.0, overhead=0.0, queued=(0,), executors=1, backlog=0.0):
    return pb.ModelLoad(cost_per_unit_s=0.01, cost_fixed_s=0.02, cost_margin_s=margin, overhead_s=overhead,
                        executors=executors, backlog_s=backlog, queued_rows=list(queued), policy="deadline",
                        tails=list(tails))


def queued(n: int, length: int = 1, priority: int = 1) -> list[Pending]:
    """`n` one-row requests this gateway admitted since the view (queued already, far deadlines)."""
    return [Pending(f"s{i}", 1, priority, INF, -INF, length=length) for i in range(n)]


def finish(view, rows=1, priority=1, since=0, max_batch_size=8, length=1, since_length=1):
    model = pb.ModelInfo(name="m", version="1", max_batch_size=max_batch_size)
    return predicted_finish_s(view, model, Candidate(rows, priority, INF, length), NOW, queued(since, since_length))


def batch_cost_s(view: pb.ModelLoad, units: int) -> float:
    return BatchCost.of_load(view).predict(units)


def test_batch_cost_is_the_profile_plus_margin_and_overhead():
    assert batch_cost_s(load(margin=0.005, overhead=0.001), 4) == pytest.approx(0.04 + 0.02 + 0.005 + 0.001)


def test_a_batch_costs_the_margin_of_its_size_class():
    # Classes 0-1 (1-3 units) 1 ms, 2 (4-7) 5 ms, 3 and beyond 30 ms; the overall margin is unused.
    view = pb.ModelLoad(cost_per_unit_s=0.01, cost_fixed_s=0.02, cost_margin_s=0.3,
                        margin_by_size_s=[0.001, 0.001, 0.005, 0.03])
    assert batch_cost_s(view, 1) == pytest.approx(cost(1) + 0.001)
    assert batch_cost_s(view, 5) == pytest.approx(cost(5) + 0.005)
    assert batch_cost_s(view, 8) == pytest.approx(cost(8) + 0.03)
    assert batch_cost_s(view, 40) == pytest.approx(cost(40) + 0.03)
    # A request alone is admitted against the margin of its own size, not of the largest batches:
    # 1 unit takes 31 ms predicted, within 0.9 of a 40 ms budget (with 0.3 s of margin it would not be).
    idle = pb.ModelLoad(cost_per_unit_s=0.01, cost_fixed_s=0.02, cost_margin_s=0.3,
                        margin_by_size_s=[0.001, 0.001, 0.005, 0.03],
                        executors=1, queued_rows=[0], policy="deadline", tails=[tail(free=(NOW + 0.001,))])
    assert admit(idle, MODEL, Candidate(1, 1, 0.04), NOW, headroom=0.9) is None


def test_nothing_queued_and_an_idle_executor_is_the_run_time_alone():
    assert finish(load(tail())) == pytest.approx(cost(1))
    assert finish(load(tail()), rows=3) == pytest.approx(cost(3))
    # busy for another 0.1 s: after that
    assert finish(load(tail(free=(NOW + 0.1,)))) == pytest.approx(0.1 + cost(1))


def test_a_request_joins_the_plans_last_batch_while_it_has_room():
    # The plan's last batch: 4 rows starting in 0.1 s, room for 8.
    view = load(tail(rows=4, limit=8, start=NOW + 0.1, free=(NOW + 0.1 + cost(4),)))
    assert finish(view) == pytest.approx(0.1 + cost(5))
    # Rows admitted since the view fill the room first: 3 more still fit, the request is the 8th row.
    assert finish(view, since=3) == pytest.approx(0.1 + cost(8))
    # One more and it starts a batch of its own after that one.
    assert finish(view, since=4) == pytest.approx(0.1 + cost(8) + cost(1))


def test_no_room_means_a_new_batch_once_the_executor_is_free():
    # The last batch's earliest deadline lets it hold no more than its 4 rows.
    view = load(tail(rows=4, limit=4, start=NOW + 0.1, free=(NOW + 0.1 + cost(4),)))
    assert finish(view) == pytest.approx(0.1 + cost(4) + cost(1))
    # 20 rows admitted since: batches of 8, 8, then 4 + the request.
    assert finish(view, since=20) == pytest.approx(0.1 + cost(4) + 2 * cost(8) + cost(5))


def test_spilled_rows_go_to_the_executor_free_first():
    view = load(tail(rows=8, limit=8, start=NOW, executor=0, free=(NOW + cost(8), NOW + 0.05)), executors=2)
    assert finish(view) == pytest.approx(0.05 + cost(1))
    # 8 rows since fill executor 1's next batch; the request goes to executor 0, free at cost(8) = 0.1 < 0.05 + 0.1
    assert finish(view, since=8) == pytest.approx(cost(8) + cost(1))


def test_a_level_without_a_plan_of_its_own_has_the_plan_of_the_level_above():
    # Published: level 1 and level 4 (the only lower level with rows queued).
    high = tail(free=(NOW + 0.05,))
    high.level = 1
    low = tail(rows=8, limit=8, start=NOW + 0.5, free=(NOW + 0.5 + cost(8),))
    low.level = 4
    view = load(high, low, queued=(0, 0, 0, 8))
    assert finish(view, priority=3) == finish(view, priority=1) == pytest.approx(0.05 + cost(1))
    assert finish(view, priority=4) == finish(view, priority=900) == pytest.approx(0.5 + cost(8) + cost(1))


def test_each_priority_level_has_its_own_plan():
    high = tail(free=(NOW + 0.05,))  # nothing at level 1: only the dispatched work ahead
    low = tail(rows=8, limit=8, start=NOW + 0.5, free=(NOW + 0.5 + cost(8),))
    view = load(high, low, queued=(0, 64))
    assert finish(view, priority=1) == pytest.approx(0.05 + cost(1))
    assert finish(view, priority=2) == pytest.approx(0.5 + cost(8) + cost(1))
    # a level below the last published one has the plan of the last one
    assert finish(view, priority=5) == finish(view, priority=2)


def test_without_a_batch_dim_every_request_is_a_batch_of_its_own():
    view = load(tail(rows=1, limit=1, start=NOW, free=(NOW + cost(1),)))
    assert finish(view, since=2, max_batch_size=0) == pytest.approx(4 * cost(1))


def test_a_view_without_a_plan_counts_the_dispatched_work():
    assert finish(load(backlog=0.3, executors=2)) == pytest.approx(0.15 + cost(1))


def test_admits_what_fits_in_the_budget():
    assert admit(load(tail()), MODEL, Candidate(1, 1, 1.0), NOW) is None


def test_overload_is_resource_exhausted_with_a_retry_hint():
    view = load(tail(rows=8, limit=8, start=NOW + 0.6, free=(NOW + 0.6 + cost(8),)), queued=(64,))
    err = admit(view, MODEL, Candidate(1, 1, 0.2), NOW)
    assert isinstance(err, ResourceExhausted)
    assert err.retry_after_s == pytest.approx(finish(view) - 0.2)
    assert "overloaded" in str(err) and "64 rows queued ahead" in str(err) and "200 ms budget" in str(err)


def test_a_refusal_is_told_to_come_back_after_those_refused_before_it():
    view = load(tail(rows=8, limit=8, start=NOW + 0.6, free=(NOW + 0.6 + cost(8),)), queued=(64,))
    own = finish(view) - 0.2
    # Earlier refusals expected back later than this one's own wait: it goes after them.
    later = admit(view, MODEL, Candidate(1, 1, 0.2), NOW, retries_at_s=NOW + own + 0.15)
    assert later.retry_after_s == pytest.approx(own + 0.15)
    assert f"retry in {round((own + 0.15) * 1e3)} ms" in str(later)
    # ... but at most one budget after its own: those refused before may never come back.
    capped = admit(view, MODEL, Candidate(1, 1, 0.2), NOW, retries_at_s=NOW + own + 60)
    assert capped.retry_after_s == pytest.approx(own + 0.2)
    # Expected back before this one could fit anyway (or long gone): its own wait stands.
    for retries_at in (NOW + own - 0.1, 0.0):
        assert admit(view, MODEL, Candidate(1, 1, 0.2), NOW,
                     retries_at_s=retries_at).retry_after_s == pytest.approx(own)
    # Only overload is hinted: a budget below the run alone is not worth retrying as is.
    assert admit(view, MODEL, Candidate(4, 1, 0.05), NOW, retries_at_s=NOW + 9).retry_after_s is None


def test_refused_requests_are_spaced_by_their_share_of_a_batch_on_one_executor():
    assert retry_spacing_s(load(executors=1), 8) == pytest.approx(0.08)
    assert retry_spacing_s(load(executors=2), 8) == pytest.approx(0.04)
    assert retry_spacing_s(load(executors=0), 8) == pytest.approx(0.08)  # a view without executors
    # Each of three gateways gives about a third of the refusals and spaces only its own.
    assert retry_spacing_s(load(executors=2), 8, gateways=3) == pytest.approx(0.12)
    assert retry_spacing_s(load(executors=2), 8, gateways=0) == pytest.approx(0.04)


def test_rows_admitted_since_the_view_can_tip_the_balance():
    view = load(tail(rows=4, limit=8, start=NOW, free=(NOW + cost(4),)))
    assert admit(view, MODEL, Candidate(1, 1, 0.2), NOW) is None
    assert isinstance(admit(view, MODEL, Candidate(1, 1, 0.2), NOW, since=queued(16)), ResourceExhausted)


def test_a_budget_below_the_run_time_alone_is_deadline_exceeded():
    err = admit(load(tail()), MODEL, Candidate(4, 1, 0.05), NOW)  # alone: 0.06 s
    assert isinstance(err, DeadlineExceeded)
    assert "raise the timeout" in str(err) and "the 50 ms budget" in str(err)
    # A client's sub-millisecond budget is quoted in µs, not as "0 ms".
    err = admit(load(tail()), MODEL, Candidate(4, 1, 0.0004), NOW)
    assert isinstance(err, DeadlineExceeded) and "the 400 µs budget" in str(err)


@pytest.mark.parametrize("seconds, text",
                         [(0.00085, "850 µs"), (0.0025, "2.5 ms"), (0.2, "200 ms"), (12.5, "12500 ms")])
def test_durations_are_quoted_in_the_unit_a_person_reads(seconds, text):
    assert duration_text(seconds) == text


def test_a_margin_past_the_budget_does_not_refuse_what_runs_in_time_on_an_idle_executor():
    # A spell of slow runs left a 0.3 s margin. Refusing every 0.2 s request on it would leave nothing
    # to run and report, so the margin would stay: only the typical run alone decides DEADLINE_EXCEEDED.
    stale = load(tail(), margin=0.3)
    assert admit(stale, MODEL, Candidate(4, 1, 0.2), NOW) is None  # typical 0.06 s, starts at once
    assert isinstance(admit(stale, MODEL, Candidate(4, 1, 0.05), NOW), DeadlineExceeded)
    # Behind a queue the margin still counts, as it does for everything admission predicts.
    busy = load(tail(free=(NOW + 0.05,)), margin=0.3)
    assert isinstance(admit(busy, MODEL, Candidate(4, 1, 0.2), NOW), ResourceExhausted)


def test_headroom_refuses_earlier():
    view = load(tail(rows=4, limit=8, start=NOW + 0.1, free=(NOW + 0.1 + cost(4),)))
    f = finish(view)
    assert admit(view, MODEL, Candidate(1, 1, f * 1.1), NOW) is None
    assert isinstance(admit(view, MODEL, Candidate(1, 1, f * 1.1), NOW, headroom=0.8), ResourceExhausted)


def test_higher_priority_is_admitted_where_lower_is_refused():
    view = load(tail(), tail(rows=8, limit=8, start=NOW + 0.7, free=(NOW + 0.7 + cost(8),)), queued=(0, 64))
    assert admit(view, MODEL, Candidate(1, 1, 0.2), NOW) is None
    assert isinstance(admit(view, MODEL, Candidate(1, 2, 0.2), NOW), ResourceExhausted)


def test_a_last_batch_about_to_leave_cannot_be_joined():
    # The view is a little old: the batch it planned to start 1 ms from now is on its way already.
    view = load(tail(rows=4, limit=8, start=NOW + 0.001, free=(NOW + 0.001 + cost(4),)))
    assert finish(view) == pytest.approx(0.001 + cost(4) + cost(1))
    view = load(tail(rows=4, limit=8, start=NOW - 0.02, free=(NOW - 0.02 + cost(4),)))
    assert finish(view) == pytest.approx(-0.02 + cost(4) + cost(1))


def test_a_batch_leaving_now_takes_only_the_requests_admitted_before():
    # The executor is (about to be) free: the next batch leaves now with the 3 rows admitted since
    # the view, queued already; the new request, not queued yet, waits for the batch after.
    view = load(tail(free=(NOW + 0.001,)))
    assert finish(view, since=3) == pytest.approx(0.001 + cost(3) + cost(1))
    # Alone, it is the batch that leaves now.
    assert finish(view) == pytest.approx(0.001 + cost(1))
    # Free later: everything admitted goes together.
    view = load(tail(free=(NOW + 0.05,)))
    assert finish(view, since=3) == pytest.approx(0.05 + cost(4))


def calibration(target=0.99, initial=0.7, **kwargs):
    return Calibration(target, initial, **kwargs)


def answer(cal, in_time, n=1):
    for _ in range(n):
        cal.observe(in_time)


def test_calibration_lowers_the_headroom_on_late_answers_and_raises_it_on_timely_ones():
    cal = calibration(step=0.01)
    answer(cal, False)
    assert cal.headroom == pytest.approx(0.7 - 0.0099)
    answer(cal, True, n=99)
    assert cal.headroom == pytest.approx(0.7)  # one late in a hundred: where a 0.99 target keeps it


@pytest.mark.parametrize("late_every, settles_at", [(20, 0.5), (500, 1.0)])
def test_calibration_settles_where_the_target_share_is_in_time(late_every, settles_at):
    # A stand-in host: above a headroom of 0.5, one answer in `late_every` comes late.
    # One in 20 is too many for a 0.99 target (it holds near 0.5); one in 500 is fine (up to 1).
    cal = calibration()
    for i in range(100_000):
        answer(cal, bool(i % late_every) or cal.headroom < 0.5)
    assert cal.headroom == pytest.approx(settles_at, abs=0.02)


def test_calibration_stays_between_its_floor_and_the_plan_itself():
    low, high = calibration(floor=0.25), calibration()
    answer(low, False, n=1000)
    answer(high, True, n=100_000)  # predictions that err late never admit past the budget
    assert (low.headroom, high.headroom) == (0.25, 1.0)


def test_a_request_that_starts_at_once_on_an_idle_executor_is_admitted_whatever_the_headroom():
    idle, busy = load(tail()), load(tail(free=(NOW + 0.001,)))  # busy: the same, 1 ms later
    assert admit(idle, MODEL, Candidate(1, 1, cost(1) * 1.1), NOW, headroom=0.25) is None
    assert isinstance(admit(busy, MODEL, Candidate(1, 1, cost(1) * 1.1), NOW, headroom=0.25), ResourceExhausted)


# --- lengths: a request is costed at its own length, not at what others cost ----------


def test_a_request_is_costed_at_its_rows_times_its_length():
    assert finish(load(tail()), length=16) == pytest.approx(cost(16))
    assert finish(load(tail()), rows=2, length=16) == pytest.approx(cost(32))
    # 0.2 s: 16 units fit alone (0.18), 32 do not (0.34)
    assert admit(load(tail()), MODEL, Candidate(1, 1, 0.2, length=16), NOW) is None
    refusal = admit(load(tail()), MODEL, Candidate(1, 1, 0.2, length=32), NOW)
    assert isinstance(refusal, DeadlineExceeded)


def test_rows_admitted_since_pad_the_batch_they_share_with_the_request():
    # 3 rows of length 10 admitted since the view: the request (length 1) shares their batch of 4 x 10
    # once the executor is free.
    busy = load(tail(free=(NOW + 0.1,)))
    assert finish(busy, since=3, since_length=10) == pytest.approx(0.1 + cost(40))
    # a longer request pads them instead
    assert finish(busy, since=3, since_length=10, length=20) == pytest.approx(0.1 + cost(80))


def test_joining_the_plans_last_batch_pads_to_the_longer_of_the_two():
    view = load(tail(rows=4, limit=8, start=NOW + 0.1, free=(NOW + 0.1 + cost(40),), length=10))
    assert finish(view) == pytest.approx(0.1 + cost(5 * 10))
    assert finish(view, length=20) == pytest.approx(0.1 + cost(5 * 20))
