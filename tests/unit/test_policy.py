"""Unit tests for the batching decision (scheduler/policy.py) and the latency profile.

Pure: time is passed in as floats (binary-exact values, so "at the instant"
comparisons are exact), predictions are fixed functions, no I/O.
"""
from __future__ import annotations

import pytest

from batchline.contract import OVER_SHARE
from batchline.planning import BatchingRule, FunctionCost, Pending, play, queue_tail
from batchline.protocol import internal_pb2 as pb
from scheduler.policy import (
    DEADLINE, DELAY, FIFO, FULL, NO_COMPANY, PREFERRED, ModelPolicy, PlannedBatch, free_after, over_share_rows, plan,
)
from scheduler.profile import LatencyProfile

FAR = 1000.0  # a deadline far enough never to matter
IDLE = [0.0]  # one executor, idle since time 0


def req(rid: str, rows: int = 1, *, deadline: float = FAR, enqueued: float = 0.0, priority: int = 1,
        length: int = 1) -> Pending:
    return Pending(rid, rows, priority, deadline, enqueued, member=rid.encode(), length=length)


def fixed(cost: float):
    return lambda rows: cost


def ids(batch: PlannedBatch) -> list[str]:
    return [m.request_id for m in batch.members]


class RecordingPredict:
    """A predict() that records the batch sizes it was asked about."""

    def __init__(self, per_row: float) -> None:
        self.per_row = per_row
        self.calls: list[int] = []

    def __call__(self, rows: int) -> float:
        self.calls.append(rows)
        return self.per_row * rows


# --- size-triggered ---------------------------------------------------------


def test_full_queue_dispatches_immediately_with_reason_full():
    policy = ModelPolicy(BatchingRule(4), max_queue_delay=10.0)
    queue = [req(f"r{i}") for i in range(4)]
    p = plan(0.0, queue, policy, free_at=IDLE * 1, cost=FunctionCost(fixed(0.25)))
    assert len(p.batches) == 1
    b = p.batches[0]
    assert b.reason == FULL
    assert b.rows == 4
    assert ids(b) == ["r0", "r1", "r2", "r3"]
    assert [m.member for m in b.members] == [b"r0", b"r1", b"r2", b"r3"]
    assert p.expired == []
    # Nothing left waiting and the only executor now busy until 0.25: look again then.
    assert p.blocked and p.wake_at == 0.25


def test_multi_row_request_counts_its_rows():
    policy = ModelPolicy(BatchingRule(4), max_queue_delay=10.0)
    queue = [req("a", rows=3), req("b", rows=1)]
    p = plan(0.0, queue, policy, free_at=IDLE * 1, cost=FunctionCost(fixed(0.25)))
    assert len(p.batches) == 1
    assert p.batches[0].reason == FULL
    assert p.batches[0].rows == 4
    assert ids(p.batches[0]) == ["a", "b"]


def test_request_that_does_not_fit_stays_queued():
    policy = ModelPolicy(BatchingRule(4), max_queue_delay=10.0)
    queue = [req("a", rows=3, deadline=50.0), req("b", rows=2, deadline=40.0)]
    p = plan(0.0, queue, policy, free_at=IDLE * 1, cost=FunctionCost(fixed(0.25)))
    assert len(p.batches) == 1
    # 'a' alone: the next request would overflow max_batch_size, so nothing more fits.
    assert ids(p.batches[0]) == ["a"]
    assert p.batches[0].rows == 3
    assert p.batches[0].reason == FULL
    # 'b' waits for the only executor, predicted free when 'a' is done.
    assert p.wake_at == 0.25


def test_second_batch_with_two_slots_follows_the_same_rules_and_waits():
    policy = ModelPolicy(BatchingRule(4), max_queue_delay=0.5)
    queue = [req("a", rows=3), req("b", rows=2, enqueued=0.25)]
    p = plan(0.5, queue, policy, free_at=IDLE * 2, cost=FunctionCost(fixed(0.25)))
    # 'b' alone is not full, not preferred, far from its deadline, and has
    # waited only 0.25 of its 0.5 s: it must not be sent just because a slot is free.
    assert [ids(b) for b in p.batches] == [["a"]]
    assert p.wake_at == 0.75  # b.enqueued + max_queue_delay


def test_second_batch_with_two_slots_goes_out_when_its_own_rule_fires():
    policy = ModelPolicy(BatchingRule(4), max_queue_delay=0.5)
    queue = [req("a", rows=3), req("b", rows=2, enqueued=0.25)]
    p = plan(0.75, queue, policy, free_at=IDLE * 2, cost=FunctionCost(fixed(0.25)))
    assert [(ids(b), b.rows, b.reason) for b in p.batches] == [(["a"], 3, FULL), (["b"], 2, DELAY)]
    assert p.blocked and p.wake_at == 1.0  # both executors busy until then


def test_second_batch_with_two_slots_can_be_full_too():
    policy = ModelPolicy(BatchingRule(4), max_queue_delay=10.0)
    queue = [req("a", rows=3), req("b", rows=2), req("c", rows=2), req("d", rows=1)]
    p = plan(0.0, queue, policy, free_at=IDLE * 3, cost=FunctionCost(fixed(0.25)))
    assert [(ids(b), b.rows, b.reason) for b in p.batches] == [(["a"], 3, FULL), (["b", "c"], 4, FULL)]
    # 'd' waits for company; wake when its delay is due
    assert p.wake_at == 10.0


# --- delay-triggered --------------------------------------------------------


def test_delay_not_yet_due_waits_until_oldest_plus_delay():
    policy = ModelPolicy(BatchingRule(8), max_queue_delay=0.5)
    queue = [req("a", enqueued=0.125), req("b", enqueued=0.25)]
    p = plan(0.5, queue, policy, free_at=IDLE * 4, cost=FunctionCost(fixed(0.25)))
    assert p.batches == []
    assert p.expired == []
    assert p.wake_at == 0.625  # oldest (0.125) + 0.5


def test_delay_due_exactly_now_dispatches_with_reason_delay():
    policy = ModelPolicy(BatchingRule(8), max_queue_delay=0.5)
    queue = [req("a", enqueued=0.125), req("b", enqueued=0.25)]
    p = plan(0.625, queue, policy, free_at=IDLE * 4, cost=FunctionCost(fixed(0.25)))
    assert len(p.batches) == 1
    assert p.batches[0].reason == DELAY
    assert ids(p.batches[0]) == ["a", "b"]
    assert p.batches[0].rows == 2
    assert p.wake_at is None


def test_delay_past_dispatches_with_reason_delay():
    policy = ModelPolicy(BatchingRule(8), max_queue_delay=0.5)
    p = plan(3.0, [req("a", enqueued=0.125)], policy, free_at=IDLE * 1, cost=FunctionCost(fixed(0.25)))
    assert [(ids(b), b.reason) for b in p.batches] == [(["a"], DELAY)]


def test_delay_is_measured_from_the_oldest_member_not_the_first():
    policy = ModelPolicy(BatchingRule(8), max_queue_delay=0.5)
    # Queue order is priority-major, so the oldest request need not come first.
    queue = [req("new", enqueued=0.25, priority=1), req("old", enqueued=0.0, priority=2)]
    before = plan(0.375, queue, policy, free_at=IDLE * 1, cost=FunctionCost(fixed(0.25)))
    assert before.batches == []
    assert before.wake_at == 0.5
    at = plan(0.5, queue, policy, free_at=IDLE * 1, cost=FunctionCost(fixed(0.25)))
    assert [b.reason for b in at.batches] == [DELAY]


# --- company-triggered (scheduler/company.py measures the rate) -------------


def test_no_company_expected_sends_at_once_with_reason_no_company():
    policy = ModelPolicy(BatchingRule(8), max_queue_delay=0.5)
    p = plan(0.125, [req("a", enqueued=0.125)], policy, free_at=IDLE, cost=FunctionCost(fixed(0.25)), company=0.0)
    assert [(ids(b), b.reason) for b in p.batches] == [(["a"], NO_COMPANY)]


def test_company_expected_waits_while_one_more_arrival_is_expected_before_the_delay_is_up():
    policy = ModelPolicy(BatchingRule(8), max_queue_delay=0.5)
    queue = [req("a", enqueued=0.0)]
    # 4 arrivals/s: one is expected in the last 0.25 s of the wait, which ends at 0.5.
    early = plan(0.125, queue, policy, free_at=IDLE, cost=FunctionCost(fixed(0.25)), company=4.0)
    assert early.batches == [] and early.wake_at == 0.25
    at = plan(0.25, queue, policy, free_at=IDLE, cost=FunctionCost(fixed(0.25)), company=4.0)
    assert [b.reason for b in at.batches] == [NO_COMPANY]
    # Unknown (None): the whole max_queue_delay, as Triton waits.
    unknown = plan(0.25, queue, policy, free_at=IDLE, cost=FunctionCost(fixed(0.25)), company=None)
    assert unknown.batches == [] and unknown.wake_at == 0.5


def test_the_wait_for_company_ends_by_the_deadline_rule_first():
    policy = ModelPolicy(BatchingRule(8), max_queue_delay=10.0)
    queue = [req("a", deadline=1.0)]
    # send_by = 1.0 - 0.25 = 0.75; one arrival is expected within 0.25 s at 4/s: wait until 0.5.
    p = plan(0.0, queue, policy, free_at=IDLE, cost=FunctionCost(fixed(0.25)), company=4.0)
    assert p.batches == [] and p.wake_at == 0.5


def test_fifo_waits_the_whole_delay_whatever_the_company():
    policy = ModelPolicy(BatchingRule(8, deadline_aware=False), max_queue_delay=0.5)
    p = plan(0.125, [req("a", enqueued=0.0)], policy, free_at=IDLE, cost=FunctionCost(fixed(0.25)), company=0.0)
    assert p.batches == [] and p.wake_at == 0.5


# --- deadline-triggered -----------------------------------------------------


def test_deadline_not_yet_due_wakes_at_latest_dispatch_instant():
    policy = ModelPolicy(BatchingRule(8), max_queue_delay=10.0)
    queue = [req("a", deadline=1.0)]
    p = plan(0.5, queue, policy, free_at=IDLE * 1, cost=FunctionCost(fixed(0.25), overhead_s=0.125))
    assert p.batches == []
    assert p.wake_at == 0.625  # 1.0 - 0.25 - 0.125


def test_deadline_due_dispatches_before_max_queue_delay():
    policy = ModelPolicy(BatchingRule(8), max_queue_delay=10.0)
    queue = [req("a", deadline=1.0)]
    p = plan(0.625, queue, policy, free_at=IDLE * 1, cost=FunctionCost(fixed(0.25), overhead_s=0.125))
    assert len(p.batches) == 1
    assert p.batches[0].reason == DEADLINE
    assert p.batches[0].slack == 0.0
    # later but still able to finish in time: still DEADLINE, not DELAY
    p2 = plan(0.75, queue, policy, free_at=IDLE * 1, cost=FunctionCost(fixed(0.25), fixed(0.125), overhead_s=0.125))
    assert [b.reason for b in p2.batches] == [DEADLINE]
    # too late to finish even if started now: shed, never executed
    p3 = plan(0.875, queue, policy, free_at=IDLE * 1, cost=FunctionCost(fixed(0.25), overhead_s=0.125))
    assert p3.batches == [] and [e.request_id for e in p3.expired] == ["a"]


def test_deadline_uses_earliest_deadline_member_even_when_not_first():
    policy = ModelPolicy(BatchingRule(8), max_queue_delay=10.0)
    # The lower-priority request (second in queue order) has the earlier deadline.
    queue = [req("hi", deadline=5.0, priority=1), req("lo", deadline=1.0, priority=2)]
    before = plan(0.5, queue, policy, free_at=IDLE * 1, cost=FunctionCost(fixed(0.25), overhead_s=0.125))
    assert before.batches == []
    assert before.wake_at == 0.625
    at = plan(0.625, queue, policy, free_at=IDLE * 1, cost=FunctionCost(fixed(0.25), overhead_s=0.125))
    assert len(at.batches) == 1
    assert at.batches[0].reason == DEADLINE
    assert ids(at.batches[0]) == ["hi", "lo"]


def test_deadline_prediction_is_for_the_batch_rows():
    policy = ModelPolicy(BatchingRule(8), max_queue_delay=10.0)
    predict = RecordingPredict(per_row=0.125)
    queue = [req("a", rows=2, deadline=1.0), req("b", rows=3, deadline=2.0)]
    p = plan(0.25, queue, policy, free_at=IDLE * 1, cost=FunctionCost(predict, fixed(0.0)))
    assert set(predict.calls) == {5}  # only ever the whole batch
    assert p.batches == []
    assert p.wake_at == 0.375  # 1.0 - 5 * 0.125


# --- preferred --------------------------------------------------------------


def test_preferred_size_when_everything_queued_is_taken():
    policy = ModelPolicy(BatchingRule(8, (2, 4)), max_queue_delay=10.0)
    queue = [req("a", rows=1), req("b", rows=3)]
    p = plan(0.0, queue, policy, free_at=IDLE * 1, cost=FunctionCost(fixed(0.25)))
    assert len(p.batches) == 1
    assert p.batches[0].reason == PREFERRED
    assert p.batches[0].rows == 4
    assert ids(p.batches[0]) == ["a", "b"]


def test_non_preferred_size_waits():
    policy = ModelPolicy(BatchingRule(8, (2, 4)), max_queue_delay=10.0)
    queue = [req("a", rows=1), req("b", rows=2)]
    p = plan(0.0, queue, policy, free_at=IDLE * 1, cost=FunctionCost(fixed(0.25)))
    assert p.batches == []
    assert p.wake_at == 10.0


# --- expiry -----------------------------------------------------------------


def test_expired_requests_are_shed_and_the_rest_still_planned():
    policy = ModelPolicy(BatchingRule(2), max_queue_delay=10.0)
    queue = [
        req("gone", deadline=0.5),
        req("a", deadline=5.0),
        req("at_now", deadline=1.0),  # deadline == now counts as expired
        req("b", deadline=5.0),
        req("c", deadline=6.0),
    ]
    p = plan(1.0, queue, policy, free_at=IDLE * 4, cost=FunctionCost(fixed(0.25)))
    assert [e.request_id for e in p.expired] == ["gone", "at_now"]
    batched = [m.request_id for b in p.batches for m in b.members]
    assert "gone" not in batched and "at_now" not in batched
    assert [(ids(b), b.reason) for b in p.batches] == [(["a", "b"], FULL)]
    assert p.wake_at == 6.0 - 0.25  # 'c' waits: its latest dispatch instant


def test_all_expired_gives_no_batches_and_no_wake():
    policy = ModelPolicy(BatchingRule(4), max_queue_delay=10.0)
    p = plan(2.0, [req("a", deadline=1.0), req("b", deadline=2.0)], policy, free_at=IDLE * 1,
             cost=FunctionCost(fixed(0.25)))
    assert [e.request_id for e in p.expired] == ["a", "b"]
    assert p.batches == []
    assert p.wake_at is None


# --- free slots -------------------------------------------------------------


def test_no_free_slots_no_batches_but_wake_at_earliest_deadline():
    policy = ModelPolicy(BatchingRule(2), max_queue_delay=0.5)
    queue = [req("a", deadline=3.0), req("b", deadline=2.0), req("c", deadline=4.0)]
    p = plan(1.0, queue, policy, free_at=[], cost=FunctionCost(fixed(0.25)))
    assert p.batches == []
    assert p.expired == []
    assert p.wake_at == 2.0


def test_free_slots_limit_the_number_of_batches():
    policy = ModelPolicy(BatchingRule(2), max_queue_delay=10.0)
    queue = [req(f"r{i}", deadline=10.0 + i) for i in range(7)]
    p = plan(0.0, queue, policy, free_at=IDLE * 2, cost=FunctionCost(fixed(0.25)))
    assert [ids(b) for b in p.batches] == [["r0", "r1"], ["r2", "r3"]]
    assert all(b.reason == FULL for b in p.batches)
    assert p.wake_at == 0.25  # both executors predicted free again


# --- no batch dimension ----------------------------------------------------


def test_max_batch_size_zero_means_one_request_per_batch():
    policy = ModelPolicy(BatchingRule(0), max_queue_delay=10.0)
    queue = [req("a"), req("b"), req("c")]
    p = plan(0.0, queue, policy, free_at=IDLE * 2, cost=FunctionCost(fixed(0.25)))
    assert [ids(b) for b in p.batches] == [["a"], ["b"]]
    assert all(b.rows == 1 for b in p.batches)
    assert p.wake_at == 0.25  # 'c' waits for an executor to free up


# --- slack ------------------------------------------------------------------


def test_slack_is_earliest_deadline_minus_now_minus_predicted_cost():
    policy = ModelPolicy(BatchingRule(4), max_queue_delay=10.0)
    predict = RecordingPredict(per_row=0.0625)
    queue = [req("a", deadline=3.0), req("b", deadline=2.0), req("c", deadline=4.0), req("d", deadline=5.0)]
    p = plan(0.5, queue, policy, free_at=IDLE * 1, cost=FunctionCost(predict, overhead_s=0.125))
    assert len(p.batches) == 1
    # earliest 2.0 - now 0.5 - (4 * 0.0625 + 0.125)
    assert p.batches[0].slack == 2.0 - 0.5 - 0.375
    assert p.batches[0].slack == 1.125


# --- order ------------------------------------------------------------------


def test_members_taken_in_given_queue_order():
    policy = ModelPolicy(BatchingRule(3), max_queue_delay=10.0)
    # Deliberately not sorted by id, enqueue time, or deadline: the caller's order wins.
    queue = [
        req("z", priority=1, deadline=9.0, enqueued=0.5),
        req("m", priority=1, deadline=3.0, enqueued=0.25),
        req("a", priority=2, deadline=2.0, enqueued=0.0),
        req("q", priority=2, deadline=1.5, enqueued=0.0),
    ]
    p = plan(0.75, queue, policy, free_at=IDLE * 1, cost=FunctionCost(fixed(0.25)))
    assert len(p.batches) == 1
    assert p.batches[0].members == tuple(queue[:3])
    assert p.wake_at == 1.0  # 'q' left behind: look again when the executor is predicted free


# --- LatencyProfile ---------------------------------------------------------


def test_profile_default_before_samples():
    prof = LatencyProfile(default=0.007)
    assert len(prof) == 0
    assert prof.predict(1) == 0.007
    assert prof.predict(64) == 0.007


def test_profile_learns_linear_cost_from_noiseless_samples():
    a, b = 0.001, 0.002
    prof = LatencyProfile(default=0.5)
    for n in (1, 2, 4, 8) * 3:
        prof.observe(n, a * n + b)
    assert len(prof) == 12
    for n in (1, 3, 8, 16, 32):
        assert prof.predict(n) == pytest.approx(a * n + b, abs=1e-9)


def test_profile_learns_from_exactly_two_batch_sizes():
    prof = LatencyProfile()
    prof.observe(2, 0.010)
    prof.observe(6, 0.030)
    assert prof.predict(4) == pytest.approx(0.020, abs=1e-9)
    assert prof.predict(10) == pytest.approx(0.050, abs=1e-9)


def test_profile_margin_grows_with_noise():
    a, b, noise = 0.001, 0.002, 0.001
    clean, noisy = LatencyProfile(), LatencyProfile()
    for n in (1, 2, 4, 8):
        for sign in (+1, -1):  # symmetric noise: same mean, same fit, residuals ±noise
            clean.observe(n, a * n + b)
            noisy.observe(n, a * n + b + sign * noise)
    for n in (1, 8, 16):
        assert noisy.predict(n) > clean.predict(n)
        # margin = a high quantile of the residuals (±noise, half each) = noise
        assert noisy.predict(n) - clean.predict(n) == pytest.approx(noise, rel=1e-6)
        assert noisy.expected(n) == pytest.approx(a * n + b, rel=1e-6)  # the central estimate has no margin
        # and the noisy prediction errs late: above the true cost
        assert noisy.predict(n) > a * n + b


def test_profile_margin_is_per_size_class():
    # 1 ms per unit. Small batches (1-3 units) jitter by 1 ms, large ones (64-127) by 40 ms.
    prof = LatencyProfile()
    for k in range(40):
        sign = 1 if k % 2 else -1
        prof.observe(2, 0.002 + sign * 0.001)
        prof.observe(96, 0.096 + sign * 0.040)
    a, b, overall = prof.coefficients()
    assert (a, b) == pytest.approx((0.001, 0.0), abs=1e-9)
    assert overall == pytest.approx(0.040, rel=1e-6)  # over every size: the large batches' jitter
    assert prof.margin(2) == pytest.approx(0.001, rel=1e-6)
    assert prof.margin(3) == pytest.approx(0.001, rel=1e-6)  # class 1, with class 0 and 2 either side
    assert prof.margin(100) == pytest.approx(0.040, rel=1e-6)
    assert prof.margin(1000) == pytest.approx(0.040, rel=1e-6)  # past the largest class seen: its margin
    assert prof.predict(2) == pytest.approx(0.003, rel=1e-6)
    # A class with no samples near it borrows the nearest measured one's margin, scaled by the
    # classes' typical costs: class 4 (16-31 units, 24 ms at its middle) from class 5 (32-63 units,
    # 48 ms), whose margin comes from the samples of class 6 next to it: 40 ms x 24 / 48.
    assert prof.margin(20) == pytest.approx(0.040 * 24 / 48, rel=1e-6)


def test_profile_keeps_one_margin_for_every_size_while_no_class_has_enough_samples():
    prof = LatencyProfile()
    for sign in (1, -1):
        prof.observe(2, 0.002 + sign * 0.001)
        prof.observe(96, 0.096 + sign * 0.040)
    assert prof.margins() == ()
    assert prof.margin(2) == prof.margin(96) == pytest.approx(prof.coefficients()[2])


def test_profile_single_batch_size_is_proportional():
    prof = LatencyProfile()
    for _ in range(3):
        prof.observe(4, 0.008)
    assert prof.predict(4) == pytest.approx(0.008)
    assert prof.predict(8) == pytest.approx(0.016)
    assert prof.predict(2) == pytest.approx(0.004)


def test_profile_refits_after_new_observations():
    prof = LatencyProfile(window=4)
    for _ in range(4):
        prof.observe(4, 0.008)
    assert prof.predict(4) == pytest.approx(0.008)
    for _ in range(4):  # the window forgets the old samples
        prof.observe(4, 0.016)
    assert len(prof) == 4
    assert prof.predict(4) == pytest.approx(0.016)


def test_profile_ignores_a_few_slow_outliers():
    a, b = 0.001, 0.002
    prof = LatencyProfile()
    for n in (1, 2, 4, 8, 16):
        for k in range(10):
            # one run in ten hit a 20x stall (a noisy neighbour)
            prof.observe(n, (a * n + b) * (20 if k == 0 else 1))
    for n in (1, 8, 16):
        assert prof.expected(n) == pytest.approx(a * n + b, rel=1e-6)


def test_warm_up_samples_steer_the_profile_only_until_a_real_batch_reports():
    prof = LatencyProfile(default=1.0)
    # Warm-up on made-up short inputs: 1 ms per row.
    for n in (1, 2, 4, 8, 16, 32):
        prof.observe(n, 0.001 * n, warm_up=True)
    assert prof.expected(16) == pytest.approx(0.016)
    # Real traffic costs 5 ms per row: the first real report retires the warm-up runs at once.
    prof.observe(2, 0.010)
    assert prof.expected(16) == pytest.approx(0.080)
    prof.observe(4, 0.020)
    assert prof.coefficients()[:2] == pytest.approx((0.005, 0.0), abs=1e-9)
    # A later warm-up (an executor restarting) changes nothing either.
    prof.observe(32, 0.001, warm_up=True)
    assert prof.expected(32) == pytest.approx(0.160)
    assert len(prof.warm_up_samples()) == 7 and len(prof.samples()) == 2


def test_real_batches_of_one_size_keep_the_warm_ups_shape():
    # A model whose cost is nearly all fixed: 0.5 ms a batch and 10 us a row at warm-up.
    prof = LatencyProfile()
    for n in (1, 2, 4, 8, 16, 32, 64):
        prof.observe(n, 0.0005 + 0.00001 * n, warm_up=True)
    # Real traffic, one row at a time, runs a fifth slower than the made-up inputs.
    for _ in range(5):
        prof.observe(1, 1.2 * 0.00051)
    assert prof.expected(1) == pytest.approx(1.2 * 0.00051)
    # 64 rows: the warm-up's shape at real traffic's scale, not 64 one-row runs.
    assert prof.expected(64) == pytest.approx(1.2 * (0.0005 + 0.00064), rel=1e-6)
    # Once real batches of two sizes report (and the profile refits), their own line takes over.
    for _ in range(16):
        prof.observe(8, 0.004)
    a, b, _ = prof.coefficients()
    assert a * 8 + b == pytest.approx(0.004, rel=1e-6)


def test_profile_round_trips_its_samples():
    prof = LatencyProfile()
    for n in (1, 4, 8):
        prof.observe(n, 0.001 * n)
    again = LatencyProfile()
    for rows, seconds in prof.samples():
        again.observe(rows, seconds)
    assert again.coefficients() == prof.coefficients()


# --- lengths: a batch costs its rows x its longest member's length ---------------


def test_a_batch_is_predicted_at_its_rows_times_its_longest_member():
    policy = ModelPolicy(BatchingRule(8), max_queue_delay=0.0)
    per_unit = RecordingPredict(per_row=0.001)
    p = plan(0.0, [req("short", length=16), req("long", length=128)], policy, IDLE, FunctionCost(per_unit))
    [b] = p.batches
    assert ids(b) == ["short", "long"] and b.rows == 2
    # Each member alone (is it hopeless?) at its own length; the batch padded to the long one:
    # not 2 rows, not 16 + 128 tokens.
    assert set(per_unit.calls) == {16, 128, 2 * 128}
    assert b.finish == pytest.approx(0.256)


def test_a_short_request_is_not_shed_for_what_a_long_one_costs():
    # 1 ms per unit, 50 ms to go: 16 units make it, 128 cannot even alone.
    policy = ModelPolicy(BatchingRule(8), max_queue_delay=0.0)
    queue = [req("long", length=128, deadline=0.05), req("short", length=16, deadline=0.05)]
    p = plan(0.0, queue, policy, IDLE, FunctionCost(RecordingPredict(per_row=0.001)))
    assert [m.request_id for m in p.expired] == ["long"]
    [b] = p.batches
    assert ids(b) == ["short"] and b.finish == pytest.approx(0.016)


def test_a_long_request_that_would_make_the_head_late_waits_for_the_next_batch():
    policy = ModelPolicy(BatchingRule(8), max_queue_delay=0.0)
    queue = [req("head", length=16, deadline=0.05), req("long", length=128)]
    p = plan(0.0, queue, policy, [0.0, 0.0], FunctionCost(RecordingPredict(per_row=0.001)))
    assert [ids(b) for b in p.batches] == [["head"], ["long"]]
    assert p.batches[0].reason == DEADLINE and p.expired == []


def test_tail_counts_the_length_of_its_batches():
    per_unit = lambda units: 0.001 * units  # noqa: E731
    queue = [req("a", length=16), req("b", length=16), req("c", length=128), req("d", length=16)]
    t = play(queue, IDLE, BatchingRule(2), FunctionCost(per_unit))
    # (a, b) at 2 x 16, then (c, d) padded to 128: 0.032 + 0.256
    last = t.batches[-1]
    assert (last.rows, max(m.length for m in last.members), last.start) == (2, 128, pytest.approx(0.032))
    assert t.free == pytest.approx((0.032 + 0.256,))


def test_profile_fits_one_line_through_batches_of_different_lengths():
    a, b = 0.0002, 0.002  # per unit (row x token), per batch
    prof = LatencyProfile()
    for rows in (1, 2, 4, 8, 16, 32):  # short sequences only
        prof.observe(rows * 16, a * rows * 16 + b)
    # ... predict long ones: 8 rows of 128 tokens are 8x the work of 8 rows of 16
    assert prof.expected(8 * 128) == pytest.approx(a * 1024 + b, rel=1e-6)
    for rows in (2, 8):
        prof.observe(rows * 128, a * rows * 128 + b)
    assert prof.expected(8 * 16) == pytest.approx(a * 128 + b, rel=1e-6)


# --- executors: predicted finish time -----------------------------------------


def test_batch_goes_to_the_executor_predicted_free_first():
    policy = ModelPolicy(BatchingRule(2), max_queue_delay=10.0)
    queue = [req("a"), req("b")]
    p = plan(1.0, queue, policy, free_at=[1.5, 0.5, 1.25], cost=FunctionCost(fixed(0.25)))
    assert [(ids(b), b.executor, b.finish) for b in p.batches] == [(["a", "b"], 1, 1.25)]


def test_no_executor_ready_lets_the_queue_grow_until_one_is_about_to_be_free():
    policy = ModelPolicy(BatchingRule(4), max_queue_delay=0.0)
    queue = [req("a"), req("b")]
    # Busy until 2.0: nothing goes out now, even with the delay due; look again `lead` before.
    p = plan(1.0, queue, policy, free_at=[2.0], cost=FunctionCost(fixed(0.25)), lead=0.125)
    assert p.batches == [] and p.expired == []
    assert p.wake_at == 1.875
    # Within `lead` of free: dispatched, to start when the executor frees up.
    p = plan(1.875, queue, policy, free_at=[2.0], cost=FunctionCost(fixed(0.25)), lead=0.125)
    assert [(ids(b), b.reason, b.finish) for b in p.batches] == [(["a", "b"], DELAY, 2.25)]


def test_one_executor_takes_batches_back_to_back_and_the_next_waits():
    policy = ModelPolicy(BatchingRule(2), max_queue_delay=10.0)
    queue = [req(f"r{i}") for i in range(6)]
    p = plan(0.0, queue, policy, free_at=[0.0, 0.0], cost=FunctionCost(fixed(0.5)))
    # Two idle executors take one full batch each; the third batch waits for the first to free up.
    assert [(ids(b), b.executor) for b in p.batches] == [(["r0", "r1"], 0), (["r2", "r3"], 1)]
    assert p.wake_at == 0.5


def test_evened_over_two_idle_lanes_the_queue_goes_out_as_two_batches_at_once():
    policy = ModelPolicy(BatchingRule(32, even_lanes=True), max_queue_delay=0.0)
    queue = [req(f"r{i}") for i in range(10)]
    p = plan(1.0, queue, policy, free_at=[0.0, 0.5], cost=FunctionCost(lambda units: units / 16))
    # Each goes as a batch of all that is queued would: here its delay is up.
    assert [(ids(b), b.executor, b.reason, b.finish) for b in p.batches] == [
        ([f"r{i}" for i in range(5)], 0, DELAY, 1.3125), ([f"r{i}" for i in range(5, 10)], 1, DELAY, 1.3125)]


def test_evened_a_lane_leaves_a_lane_about_to_free_up_its_share_queued():
    policy = ModelPolicy(BatchingRule(32, even_lanes=True), max_queue_delay=0.0)
    queue = [req(f"r{i}") for i in range(12)]
    # The other lane frees up in 0.25 s (4 rows' run): 8 go now, 4 wait for it and finish as soon.
    p = plan(1.0, queue, policy, free_at=[1.0, 1.25], cost=FunctionCost(lambda units: units / 16), lead=0.125)
    assert [(len(b.members), b.executor, b.finish) for b in p.batches] == [(8, 0, 1.5)]
    assert p.blocked and p.wake_at == 1.125


def test_a_batch_cut_to_its_even_share_waits_for_company_as_the_whole_would():
    policy = ModelPolicy(BatchingRule(32, even_lanes=True), max_queue_delay=0.5)
    queue = [req(f"r{i}") for i in range(10)]
    cost = FunctionCost(lambda units: units / 16)
    # Company expected (4 arrivals a second, one within the delay): nothing goes yet, as with
    # one lane, where the ten would wait as one batch.
    p = plan(0.0, queue, policy, free_at=[0.0, 0.0], cost=cost, company=4.0)
    assert p.batches == [] and p.wake_at == 0.25
    one_lane = plan(0.0, queue, ModelPolicy(BatchingRule(32), max_queue_delay=0.5), free_at=[0.0], cost=cost,
                    company=4.0)
    assert one_lane.batches == [] and one_lane.wake_at == 0.25
    # None expected: both halves go at once.
    p = plan(0.0, queue, policy, free_at=[0.0, 0.0], cost=cost, company=0.0)
    assert [(len(b.members), b.executor, b.reason) for b in p.batches] == [(5, 0, NO_COMPANY), (5, 1, NO_COMPANY)]


def test_slack_counts_the_wait_for_a_busy_executor():
    policy = ModelPolicy(BatchingRule(1), max_queue_delay=10.0)
    p = plan(1.0, [req("a", deadline=2.0)], policy, free_at=[1.25], cost=FunctionCost(fixed(0.25)), lead=0.5)
    assert p.batches[0].finish == 1.5
    assert p.batches[0].slack == 0.5


# --- deadline-aware trimming and shedding ---------------------------------------


def test_a_batch_is_trimmed_when_that_gets_more_members_done_in_time():
    policy = ModelPolicy(BatchingRule(8), max_queue_delay=10.0)
    per_row = RecordingPredict(per_row=0.125)
    queue = [req("u1", deadline=0.3), req("u2", deadline=0.3), req("b", deadline=5.0)]
    # All three take 0.375 s: only 'b' in time. Two take 0.25 s: both urgent ones in time.
    p = plan(0.0, queue, policy, free_at=[0.0, 1.0], cost=FunctionCost(per_row))
    assert [(ids(b), b.reason) for b in p.batches] == [(["u1", "u2"], DEADLINE)]
    assert p.expired == []
    assert p.batches[0].slack == 0.3 - 0.25


def test_one_urgent_member_does_not_shrink_a_batch_it_would_cost_more_than_it_saves():
    policy = ModelPolicy(BatchingRule(8), max_queue_delay=10.0)
    per_row = RecordingPredict(per_row=0.125)
    queue = [req("urgent", deadline=0.4375), req("b", deadline=5.0), req("c", deadline=5.0), req("d", deadline=5.0),
             req("e", deadline=5.0)]
    # Three rows (0.375 s) would save 'urgent' and two others; five rows (0.625 s) get four done in time.
    p = plan(0.0, queue, policy, free_at=IDLE, cost=FunctionCost(per_row))
    assert [(ids(b), b.reason) for b in p.batches] == [(["b", "c", "d", "e"], DEADLINE)]
    assert [e.request_id for e in p.expired] == ["urgent"]  # late even in the batch that serves most


def test_a_request_that_can_be_in_time_is_not_shed_for_requests_of_a_lower_priority():
    # A priority-1 request due in 10 ms ahead of 25 priority-2 ones due in 100 ms; 5 ms + 1 ms a row.
    # The batch that serves the most at once (all 26: 31 ms) would shed it; a batch that keeps it in
    # time goes first, and the rest, lower priority, after it, all in time.
    policy = ModelPolicy(BatchingRule(32), max_queue_delay=0.0)
    queue = [req("vip", deadline=0.010)] + [req(f"r{i}", deadline=0.100, priority=2) for i in range(25)]
    p = plan(0.0, queue, policy, free_at=IDLE, cost=FunctionCost(lambda rows: 0.005 + 0.001 * rows))
    assert not p.expired
    assert ids(p.batches[0])[0] == "vip" and len(p.batches[0].members) == 5  # 10 ms: vip and four more
    # Within one priority the batch that gets the most done still wins (the next test's case).


def test_hopeless_request_is_shed_by_the_central_estimate_not_the_margin():
    policy = ModelPolicy(BatchingRule(1), max_queue_delay=10.0)
    queue = [req("tight", deadline=1.25), req("hopeless", deadline=1.0625)]
    # predict (with margin) says 0.5, expected (central) says 0.125
    p = plan(1.0, queue, policy, free_at=[0.0, 0.0], cost=FunctionCost(fixed(0.5), fixed(0.125)))
    assert [e.request_id for e in p.expired] == ["hopeless"]
    assert [(ids(b), b.reason) for b in p.batches] == [(["tight"], FULL)]


def test_requests_behind_a_busy_executor_are_shed_when_they_cannot_make_it():
    policy = ModelPolicy(BatchingRule(4), max_queue_delay=10.0)
    queue = [req("a", deadline=1.5), req("b", deadline=3.0)]
    # The only executor is busy until 2.0: 'a' cannot finish by 1.5, 'b' can.
    p = plan(1.0, queue, policy, free_at=[2.0], cost=FunctionCost(fixed(0.25)))
    assert [e.request_id for e in p.expired] == ["a"]
    assert p.batches == []


# --- FIFO (max-delay) baseline ----------------------------------------------------


def test_fifo_orders_by_arrival_within_priority_and_ignores_deadlines():
    policy = ModelPolicy(BatchingRule(8, deadline_aware=False), max_queue_delay=0.5)
    queue = [req("late_arrival", deadline=0.75, enqueued=0.25), req("early_arrival", deadline=5.0, enqueued=0.0),
             req("low", deadline=0.6, enqueued=0.0, priority=2)]
    # A deadline-aware plan would go now for 'late_arrival'; FIFO waits for the delay.
    p = plan(0.25, queue, policy, free_at=IDLE, cost=FunctionCost(fixed(0.25)))
    assert p.batches == [] and p.expired == []
    assert p.wake_at == 0.5
    p = plan(0.5, queue, policy, free_at=IDLE, cost=FunctionCost(fixed(0.25)))
    assert [(ids(b), b.reason) for b in p.batches] == [(["early_arrival", "late_arrival", "low"], DELAY)]


def test_fifo_sheds_only_what_is_past_its_deadline():
    policy = ModelPolicy(BatchingRule(1, deadline_aware=False), max_queue_delay=0.0)
    queue = [req("gone", deadline=1.0), req("doomed", deadline=1.125)]
    p = plan(1.0, queue, policy, free_at=IDLE, cost=FunctionCost(fixed(0.5)))
    assert [e.request_id for e in p.expired] == ["gone"]
    assert [ids(b) for b in p.batches] == [["doomed"]]  # runs although it will miss


def test_plan_says_when_requests_wait_for_an_executor_rather_than_for_company():
    policy = ModelPolicy(BatchingRule(4), max_queue_delay=1.0)
    # Waiting for company (the executor is idle): a new arrival may fill the batch, look again.
    assert not plan(0.0, [req("a")], policy, free_at=IDLE, cost=FunctionCost(fixed(0.25))).blocked
    # Waiting for the busy executor: nothing changes before it frees up.
    assert plan(0.0, [req("a")], policy, free_at=[0.5], cost=FunctionCost(fixed(0.25))).blocked
    # Every executor holds its maximum.
    assert plan(0.0, [req("a")], policy, free_at=[], cost=FunctionCost(fixed(0.25))).blocked
    # Nothing waits and an executor is idle: an arrival may go out at once, look at it.
    assert not plan(0.0, [], policy, free_at=[0.5, 0.0], cost=FunctionCost(fixed(0.25))).blocked
    # Nothing left waiting, every executor busy: an arrival waits for the first to free up.
    p = plan(0.0, [req(f"r{i}") for i in range(4)], policy, free_at=IDLE, cost=FunctionCost(fixed(0.25)), lead=0.05)
    assert p.blocked and p.wake_at == 0.2
    p = plan(0.0, [], policy, free_at=[0.5, 0.75], cost=FunctionCost(fixed(0.25)))
    assert p.blocked and p.wake_at == 0.5
    # ... unless it is ready within the dispatch lead.
    assert not plan(0.0, [], policy, free_at=[0.04], cost=FunctionCost(fixed(0.25)), lead=0.05).blocked
    # No executor can take more before a report.
    assert plan(0.0, [], policy, free_at=[], cost=FunctionCost(fixed(0.25))).blocked


# --- the play of the queue, for admission control -------------------------------


def linear(n: int) -> float:
    return 0.1 + 0.01 * n


def played(queue, max_batch_size, free=IDLE, cost=linear, typical=None, preferred=()):
    return play(queue, free, BatchingRule(max_batch_size, preferred), FunctionCost(cost, typical))


def test_view_of_an_empty_queue_is_when_each_executor_is_free():
    t = queue_tail(1, [], [1.0, 1.5], BatchingRule(4), FunctionCost(linear))
    assert list(t.free_s) == [1.0, 1.5] and not t.items


def test_tail_plays_the_queue_in_full_batches():
    queue = [req(f"r{i}") for i in range(10)]  # far deadlines
    t = played(queue, 4)
    # batches of 4, 4, 2: the last starts after two full ones and could take 2 more rows
    last = t.batches[-1]
    assert (last.rows, last.executor) == (2, 0)
    assert last.start == pytest.approx(2 * linear(4))
    assert t.free == pytest.approx((2 * linear(4) + linear(2),))
    assert played(queue + [req("x"), req("y")], 4).batches[-1].rows == 4
    # Only the last batch's head reached the end of the queue: a view resumes there.
    assert (t.resume_queue, t.resume_free) == (tuple(queue[8:]), pytest.approx((2 * linear(4),)))


def test_tail_batches_are_cut_to_meet_their_earliest_deadline():
    # The head must finish by 0.125: a batch of 2 (0.12) makes it, 3 (0.13) would not; 4 (0.14)
    # gets more done in time (b, c, d), so the plan sheds a and sends those, and so does the play.
    queue = [req("a", deadline=0.125), req("b"), req("c"), req("d")]
    t = played(queue, 4)
    first = plan(0.0, queue, ModelPolicy(BatchingRule(4), max_queue_delay=10.0), IDLE, FunctionCost(linear))
    assert [ids(b) for b in first.batches] == [["b", "c", "d"]]
    assert ids(PlannedBatch(tuple(first.expired), 0, "", 0)) == ["a"]
    assert [[m.request_id for m in b.members] for b in t.batches] == [["b", "c", "d"]]
    assert [p.request_id for p in t.shed] == ["a"]
    # Two as tight: a batch of 4 gets no more done in time than the batch of 2, which goes first.
    queue = [req("a", deadline=0.125), req("b", deadline=0.125), req("c"), req("d")]
    t = played(queue, 4)
    assert t.batches[-1].rows == 2 and t.batches[-1].start == pytest.approx(linear(2))  # c, d after a, b
    # The last batch's own earliest deadline bounds its room.
    queue = [req("a", deadline=0.115), req("b", deadline=linear(1) + linear(3) + 0.001)]
    t = played(queue, 8)
    assert (t.batches[-1].rows, t.batches[-1].start) == (1, linear(1))  # a alone, then b with room for 2 more
    assert played(queue + [req("c"), req("d")], 8).batches[-1].rows == 3
    assert played(queue + [req("c", deadline=0.3), req("d", deadline=0.3)], 8).batches[-1].rows == 3


def test_tail_skips_what_would_be_shed():
    queue = [req("late", deadline=0.05), req("a")]
    t = played(queue, 4)
    assert (t.batches[-1].rows, t.batches[-1].start) == (1, 0.0)  # the hopeless head takes no executor time
    assert [p.request_id for p in t.shed] == ["late"]


def test_tail_keeps_a_head_that_is_late_only_by_the_margin():
    # With a 0.2 s margin the head (deadline 0.15) misses on cost, but a typical run (0.11) makes it:
    # plan sends it rather than shed it, so the play counts its executor time.
    margin = lambda n: linear(n) + 0.2  # noqa: E731
    queue = [req("tight", deadline=0.15), req("a")]
    decision = plan(0.0, queue, ModelPolicy(BatchingRule(4), max_queue_delay=10.0), IDLE, FunctionCost(margin, linear))
    assert not decision.expired and decision.batches[0].members[0].request_id == "tight"
    t = played(queue, 4, cost=margin, typical=linear)
    assert [p.request_id for b in t.batches for p in b.members] == ["tight", "a"]
    assert not t.shed
    assert played(queue, 4, cost=margin).batches[0].start == 0.0  # judged by the margin, it was skipped
    assert [p.request_id for p in played(queue, 4, cost=margin).shed] == ["tight"]


def test_tail_spreads_batches_over_executors():
    queue = [req(f"r{i}") for i in range(8)]
    t = played(queue, 4, free=[0.0, 0.05])
    assert (t.batches[-1].rows, t.batches[-1].executor, t.batches[-1].start) == (4, 1, 0.05)
    assert t.free == pytest.approx((linear(4), 0.05 + linear(4)))


def test_tail_of_a_model_without_batch_dim_is_one_request_per_batch():
    queue = [req("a", rows=1), req("b", rows=1)]
    t = played(queue, 0)
    assert [(b.rows, b.start) for b in t.batches] == [(1, 0.0), (1, linear(1))]


def test_tail_agrees_with_the_plans_first_batch():
    queue = [req(f"r{i}", deadline=0.2 + 0.01 * i) for i in range(12)]
    policy = ModelPolicy(BatchingRule(8), max_queue_delay=0.0)
    first = plan(0.0, queue, policy, IDLE, FunctionCost(linear)).batches[0]
    t = played(queue, 8)
    assert t.batches[0].members == first.members and t.batches[0].finish == pytest.approx(first.finish)


def test_more_than_a_preferred_size_queued_sends_the_largest_preferred_size():
    # Triton's rule: 31 queued, preferred 16 and 32, max 32: a batch of 16 now, 15 wait for company.
    policy = ModelPolicy(BatchingRule(32, (16, 32)), max_queue_delay=0.0)
    queue = [req(f"r{i}") for i in range(31)]
    p = plan(0.0, queue, policy, free_at=IDLE, cost=FunctionCost(fixed(0.25)))
    assert [(b.rows, b.reason) for b in p.batches] == [(16, PREFERRED)]
    assert ids(p.batches[0]) == [f"r{i}" for i in range(16)]
    # With a second executor free, the 15 left go too once their delay is due (0 here).
    p = plan(0.0, queue, policy, free_at=IDLE * 2, cost=FunctionCost(fixed(0.25)))
    assert [(b.rows, b.reason) for b in p.batches] == [(16, PREFERRED), (15, DELAY)]
    # Whole requests only: no prefix of these makes 16 rows exactly, so all 20 rows go (delay due).
    p = plan(0.0, [req("a", rows=10), req("b", rows=10)], policy, free_at=IDLE, cost=FunctionCost(fixed(0.25)))
    assert [(b.rows, b.reason) for b in p.batches] == [(20, DELAY)]
    # A full batch is full, preferred or not.
    p = plan(0.0, [req(f"r{i}") for i in range(40)], policy, free_at=IDLE, cost=FunctionCost(fixed(0.25)))
    assert [(b.rows, b.reason) for b in p.batches] == [(32, FULL)]


def test_an_executor_is_free_when_its_batches_are_predicted_done():
    # Running since 1.0 for 0.5, then one planned at 1.4 for 0.25: after both, at 1.75.
    assert free_after(1.2, [(1.4, 0.25), (1.0, 0.5)]) == 1.75
    # A batch past its predicted end without a report is late, not starting over: free now.
    assert free_after(2.0, [(1.0, 0.5)]) == 2.0
    # ... and one queued behind it starts now.
    assert free_after(2.0, [(1.0, 0.5), (1.5, 0.25)]) == 2.25
    assert free_after(3.0, []) == 3.0


def test_a_batch_fetched_behind_an_overrun_starts_when_that_run_ended():
    # Planned to start at 1.0 (the batch ahead's predicted end) for 0.5 s; the batch ahead
    # reported its run ended at 1.3: this one started then, and frees the executor at 1.8.
    assert free_after(1.1, [(1.0, 0.5)], not_before=1.3) == 1.8
    # ... and pushes what is queued behind it too.
    assert free_after(1.1, [(1.0, 0.5), (1.5, 0.25)], not_before=1.3) == 2.05
    # A run that ended before the planned start changes nothing.
    assert free_after(1.1, [(1.0, 0.5)], not_before=0.9) == 1.5


def test_tail_cuts_batches_to_preferred_sizes_like_the_plan():
    queue = [req(f"r{i}") for i in range(20)]
    # max 32, preferred 8 and 16: 20 queued go as 16, then 4.
    t = played(queue, 32, preferred=(8, 16))
    assert [(b.rows, b.start) for b in t.batches] == [(16, 0.0), (4, linear(16))]
    policy = ModelPolicy(BatchingRule(32, (8, 16)), max_queue_delay=10.0)
    assert [b.rows for b in plan(0.0, queue, policy, IDLE, FunctionCost(linear)).batches] == [16]
    # The first batch's head reached the end of the queue: arrivals can change it.
    assert t.resume_queue == tuple(queue)


def test_a_models_policy_is_its_batching_rule_and_its_queue_delay():
    info = pb.ModelInfo(name="m", version="1", max_batch_size=8, preferred_batch_sizes=[4], max_queue_delay_ms=5.0,
                        padded_inputs=["ids"])
    policy = ModelPolicy.of_model(info, length_aware=True)
    assert policy.rule == BatchingRule(8, (4,), length_aware=True) and policy.max_queue_delay == 0.005
    # FIFO, the Triton baseline: no deadline cuts a batch, and batches are the head's prefix.
    assert ModelPolicy.of_model(info, FIFO, length_aware=True).rule == BatchingRule(8, (4,), deadline_aware=False)


# --- over-share work while requests within their shares are about ------------------


def _over(n: int) -> list[Pending]:
    return [req(f"a{i}", priority=1 + OVER_SHARE) for i in range(n)]


# 10 ms a row: with 0.1 s the shortest in-share budget, an over-share batch may take 25 ms, 2 rows.
PER_ROW = FunctionCost(lambda units: 0.01 * units)
IN_SHARE_BUDGET = 0.1


def test_an_over_share_head_is_capped_and_goes_only_to_an_executor_with_nothing_to_run():
    policy = ModelPolicy(BatchingRule(8), max_queue_delay=0.0)
    p = plan(0.0, _over(4), policy, [0.0, 0.0], PER_ROW, in_share_budget=IN_SHARE_BUDGET, busy=[True, False])
    assert p.rule == BatchingRule(8, over_share_rows=2)
    # One capped batch, on the idle executor (its index in free_at); the rest waits for it.
    assert [(ids(b), b.executor) for b in p.batches] == [(["a0", "a1"], 1)]
    assert p.blocked and p.wake_at == pytest.approx(0.02)


def test_over_share_work_waits_while_every_executor_has_something_to_run():
    policy = ModelPolicy(BatchingRule(8), max_queue_delay=0.0)
    p = plan(0.0, _over(4), policy, [0.0, 0.0], PER_ROW, in_share_budget=IN_SHARE_BUDGET, busy=[True, True])
    assert p.batches == [] and p.blocked and p.wake_at == FAR


def test_without_requests_within_their_shares_over_share_work_goes_as_any():
    policy = ModelPolicy(BatchingRule(8), max_queue_delay=0.0)
    p = plan(0.0, _over(4), policy, [0.0, 0.0], PER_ROW, in_share_budget=None, busy=[True, False])
    assert p.rule is policy.rule
    assert [(ids(b), b.executor) for b in p.batches] == [(["a0", "a1", "a2", "a3"], 0)]


def test_a_head_within_its_share_takes_any_executor_and_a_full_batch():
    policy = ModelPolicy(BatchingRule(8), max_queue_delay=0.0)
    queue = [req("b"), *_over(4)]
    p = plan(0.0, queue, policy, [0.0, 0.0], PER_ROW, in_share_budget=IN_SHARE_BUDGET, busy=[True, False])
    # The cap is the rule's all the same: a batch an over-share request heads would take 2 rows.
    assert p.rule.over_share_rows == 2
    assert [(ids(b), b.executor) for b in p.batches] == [(["b", "a0", "a1", "a2", "a3"], 0)]


def test_the_cap_leaves_an_over_share_batch_a_slice_of_the_in_share_budget():
    # Its longest over-share request counts: 4 units a row, 40 ms a row, more than the 25 ms slice.
    assert over_share_rows(PER_ROW, IN_SHARE_BUDGET, 4, 8) == 1
    assert over_share_rows(PER_ROW, IN_SHARE_BUDGET, 1, 8) == 2
    assert over_share_rows(PER_ROW, 10.0, 1, 8) == 0  # the whole batch fits: no cap
    assert over_share_rows(PER_ROW, None, 1, 8) == 0


def test_a_size_class_borrowing_a_margin_never_gets_more_than_the_slowest_run_seen():
    import numpy as np

    # Text-like costs growing faster than linearly: the fit's line has a negative intercept and sits
    # near zero at the smallest measured class, which every class without samples of its own borrows from.
    profile = LatencyProfile(default=0.005, margin_quantile=0.99)
    rng = np.random.default_rng(1)
    for units, seconds, count in ((32, 0.0008, 20), (512, 0.015, 10), (4096, 0.41, 10)):
        for _ in range(count):
            profile.observe(units, seconds * (1 + 0.1 * rng.random()))
    slowest = max(s for _, s in profile.samples())
    margins = profile.cost().margin_by_size_s
    assert margins and max(margins) <= slowest  # scaled from the class near zero: 7,287 s at 4096 units


def test_a_model_on_two_kinds_of_executor_is_planned_by_a_cost_no_less_than_either():
    from batchline.planning import BatchCost

    gpu = BatchCost(per_unit_s=0.00001, fixed_s=0.005)  # a high fixed cost, a low slope
    cpu = BatchCost(per_unit_s=0.001, fixed_s=0.001, margin_by_size_s=(0.0, 0.002, 0.004))
    both = BatchCost.upper([gpu, cpu])
    for units in (1, 2, 8, 64, 4096):
        assert both.predict(units) >= max(gpu.predict(units), cpu.predict(units))
    # By one unit alone the GPU's would be taken: 64 units planned at 5.6 ms where the CPU takes 65.
    assert gpu.predict(1) > cpu.predict(1) and gpu.predict(64) < cpu.predict(64)


# --- batches an executor may hold ----------------------------------------------


def test_a_model_faster_than_the_lead_gets_no_more_batches_than_the_executor_has_room_for():
    """Each batch finishes within the dispatch lead, so the executor looks ready again at once: the
    plan would send it the whole queue in batches of 4; with room for 2 it sends 2 and waits."""
    policy = ModelPolicy(BatchingRule(4), max_queue_delay=0.0)
    queue = [req(f"r{i}") for i in range(16)]
    cost = FunctionCost(fixed(0.001))
    unbounded = plan(0.0, queue, policy, free_at=IDLE, cost=cost, lead=0.01)
    assert len(unbounded.batches) == 4
    bounded = plan(0.0, queue, policy, free_at=IDLE, cost=cost, lead=0.01, room=[2])
    assert [ids(b) for b in bounded.batches] == [["r0", "r1", "r2", "r3"], ["r4", "r5", "r6", "r7"]]
    assert bounded.blocked and not bounded.expired
    # Another executor with room takes the rest.
    two = plan(0.0, queue, policy, free_at=[0.0, 0.0], cost=cost, lead=0.01, room=[1, 3])
    assert sorted(b.executor for b in two.batches) == [0, 1, 1, 1]
