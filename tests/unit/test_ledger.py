"""The admission ledger's reuse of an overload refusal: later requests like a refused one are refused
by its verdict without playing the queue again, and only while nothing it was judged on changed."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchline import metrics
from batchline.errors import DeadlineExceeded, ResourceExhausted
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import internal_pb2 as pb
from gateway.ledger import AdmissionLedger
from gateway.request import Call

MODEL = pb.ModelInfo(name="m", version="1", max_batch_size=8)
NOW_US = 1_000_000_000


def view(updated_us: int = NOW_US, busy_s: float = 0.5, queued: int = 64) -> pb.ModelLoad:
    """One executor busy for `busy_s` from `updated_us` with `queued` rows ahead (10 ms a row + 20 ms a batch)."""
    free = updated_us / 1e6 + busy_s
    return pb.ModelLoad(cost_per_unit_s=0.01, cost_fixed_s=0.02, executors=1, queued_rows=[queued], policy="deadline",
                        updated_us=updated_us, tails=[pb.QueueTail(free_s=[free])])


def call(rows: int = 1, budget_s: float = 0.2, priority: int = 1, length: int = 1) -> Call:
    return Call(ipb.ModelInferRequest(model_name="m"), MODEL, rows, length, priority, budget_s, budget_s)


def reused() -> float:
    return metrics.REFUSALS_REUSED.labels("m", "1")._value.get()


def outcome(ledger: AdmissionLedger, load: pb.ModelLoad, c: Call, at_us: int):
    """The admitted request's ticket (queued at `at_us`, as the gateway stamps it), or the refusal."""
    try:
        ticket = ledger.check(load, c, at_us, 1)
    except (ResourceExhausted, DeadlineExceeded) as exc:
        return exc
    ticket.queued(at_us)
    return ticket


def test_a_request_like_one_just_refused_is_refused_by_its_verdict():
    ledger, load = AdmissionLedger("gw", 1.0, 0.0), view()
    first = outcome(ledger, load, call(), NOW_US)
    assert isinstance(first, ResourceExhausted)
    before = reused()
    second = outcome(ledger, load, call(), NOW_US + 10_000)
    assert isinstance(second, ResourceExhausted) and reused() == before + 1
    # The same words, 10 ms on: the finish and the wait are that much nearer.
    assert "overloaded" in str(second) and "64 rows queued ahead" in str(second)
    assert second.retry_after_s <= first.retry_after_s
    # With less time: refused by it too.
    assert isinstance(outcome(ledger, load, call(budget_s=0.1), NOW_US + 20_000), ResourceExhausted)
    assert reused() == before + 2
    # Too little to be worth running, or another size: judged again.
    assert isinstance(outcome(ledger, load, call(budget_s=0.02), NOW_US + 21_000), DeadlineExceeded)
    for c in (call(rows=2), call(length=3)):
        assert isinstance(outcome(ledger, load, c, NOW_US + 22_000), ResourceExhausted)
    assert reused() == before + 2


def test_what_the_verdict_does_not_cover_is_judged_again():
    ledger, load = AdmissionLedger("gw", 1.0, 0.0), view(busy_s=0.25, queued=0)
    assert isinstance(outcome(ledger, load, call(budget_s=0.2), NOW_US), ResourceExhausted)
    before = reused()
    # More time, another priority, a new view: judged again (and these fit).
    assert not isinstance(outcome(ledger, load, call(budget_s=0.3), NOW_US + 1_000), Exception)
    assert not isinstance(outcome(ledger, view(NOW_US + 5_000, busy_s=0.0, queued=0), call(), NOW_US + 6_000),
                          Exception)
    assert reused() == before


def test_an_answered_request_ends_the_verdicts_judged_while_it_was_queued():
    ledger, load = AdmissionLedger("gw", 1.0, 0.0), view(busy_s=0.0, queued=0)
    # Admitted until the batch they share would miss 80 ms; the next is refused.
    records = []
    while not isinstance(last := outcome(ledger, load, call(budget_s=0.08), NOW_US), Exception) and len(records) < 20:
        records.append(last)
    assert isinstance(last, ResourceExhausted) and 1 < len(records) < 8
    before = reused()
    records[0].over()
    assert not isinstance(outcome(ledger, load, call(budget_s=0.08), NOW_US + 1), Exception)
    assert reused() == before


def test_the_verdict_lapses_when_the_same_request_would_fit():
    ledger, load = AdmissionLedger("gw", 1.0, 0.0), view(busy_s=0.25, queued=0)
    refused = outcome(ledger, load, call(budget_s=0.2), NOW_US)
    assert isinstance(refused, ResourceExhausted)
    later_us = NOW_US + int(refused.retry_after_s * 1e6) + 1_000
    before = reused()
    assert not isinstance(outcome(ledger, load, call(budget_s=0.2), later_us), Exception)
    assert reused() == before


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(
    st.sampled_from(["arrive", "arrive", "arrive", "answer", "view"]),
    st.integers(1, 4),                      # rows
    st.sampled_from([0.05, 0.1, 0.2, 0.4]),  # budget
    st.integers(1, 2),                      # priority
    st.integers(0, 30_000),                 # µs since the last event
), min_size=1, max_size=60))
def test_reusing_refusals_never_changes_a_decision(events):
    """A ledger that reuses refusals decides as one that plays the queue for every request."""
    reusing, playing = AdmissionLedger("gw", 1.0, 0.0), AdmissionLedger("gw", 1.0, 0.0)
    now_us, load = NOW_US, view(busy_s=0.1, queued=8)
    records: list[tuple] = []
    for kind, rows, budget, priority, gap in events:
        now_us += gap
        if kind == "view":
            load = view(now_us, busy_s=0.05 * rows, queued=rows * 4)
        elif kind == "answer" and records:
            a, b = records.pop(0)
            a.over()
            b.over()
        elif kind == "arrive":
            c = call(rows, budget, priority)
            playing._refusals.clear()
            a, b = outcome(reusing, load, c, now_us), outcome(playing, load, c, now_us)
            assert type(a) is type(b), (kind, rows, budget, priority, a, b)
            if not isinstance(a, Exception):
                records.append((a, b))


def test_a_ticket_is_over_once_and_feeds_the_calibration_once():
    ledger = AdmissionLedger("gw", 0.5, 0.99)
    ticket = ledger.check(view(busy_s=0.0, queued=0), call(), NOW_US, 1)
    assert ticket.calibration is ledger.calibration(("m", "1")) and not ticket.record.over
    ticket.queued(NOW_US)
    ticket.confirmed(NOW_US + 5)
    assert (ticket.record.enqueued_us, ticket.record.confirmed_us) == (NOW_US, NOW_US + 5)
    start = ticket.calibration.headroom
    ticket.over(in_time=False)
    lowered = ticket.calibration.headroom
    assert ticket.record.over and lowered < start
    ticket.over(in_time=False)  # given up after it was judged late: learned from once
    ticket.over()
    assert ticket.calibration.headroom == lowered
    # Over without a verdict (e.g. an error that says nothing of the prediction): nothing learned.
    other = ledger.check(view(busy_s=0.0, queued=0), call(), NOW_US, 1)
    other.over()
    assert other.record.over and ticket.calibration.headroom == lowered


@pytest.mark.parametrize("headroom", [0.5, 0.9])
def test_a_changed_headroom_is_judged_again(headroom):
    ledger, load = AdmissionLedger("gw", 1.0, 0.99), view(busy_s=0.25, queued=0)
    calibration = ledger.calibration(("m", "1"))
    calibration.headroom = 1.0
    first = outcome(ledger, load, call(budget_s=0.2), NOW_US)
    assert isinstance(first, ResourceExhausted)
    calibration.headroom = headroom
    before = reused()
    outcome(ledger, load, call(budget_s=0.2), NOW_US + 1)
    assert reused() == before


def test_another_read_of_the_same_view_is_judged_again():
    # Two reads of one update may differ in what they say this gateway's requests are counted to
    # (seen_us): a verdict is bound to the view object it was judged by.
    ledger, load = AdmissionLedger("gw", 1.0, 0.0), view()
    assert isinstance(outcome(ledger, load, call(), NOW_US), ResourceExhausted)
    again = pb.ModelLoad()
    again.CopyFrom(load)
    again.seen_us["gw"] = NOW_US
    before = reused()
    assert isinstance(outcome(ledger, again, call(), NOW_US + 1_000), ResourceExhausted)
    assert reused() == before
