"""The scheduler and the gateways plan with one model (batchline.planning): randomized checks that
they agree on the same queue.

- The load view the scheduler publishes, resumed by a gateway's admission control with the
  requests it admitted since and a new one, predicts the same finish for the new one as the
  scheduler's play of the whole queue with them behind it.
- The batches the scheduler's plan sends now are the first batches of that play.

Pure: explicit times and a linear cost, no I/O.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchline.contract import OVER_SHARE
from batchline.planning import BatchCost, BatchingRule, FunctionCost, Pending, play, queue_tails
from batchline.protocol import internal_pb2 as pb
from gateway.admission import JOIN_LEAD_S, Candidate, admit, predicted_finish_s
from scheduler.policy import ModelPolicy, plan

NOW = 100.0
INF = float("inf")

# Priority levels, within their tenants' shares and over them (batchline.contract.OVER_SHARE).
levels = st.sampled_from([1, 2, 3, 1 + OVER_SHARE, 2 + OVER_SHARE])
times = st.floats(min_value=0.0, max_value=0.3, allow_nan=False).map(lambda t: round(t, 4))


@st.composite
def scenarios(draw):
    max_batch_size = draw(st.sampled_from([0, 1, 4, 8]))
    preferred = draw(st.sampled_from([(), (2,), (4,), (2, 4)])) if max_batch_size > 1 else ()
    cost = BatchCost(
        per_unit_s=draw(st.sampled_from([0.0, 0.001, 0.01])), fixed_s=draw(st.sampled_from([0.002, 0.02])),
        margin_s=draw(st.sampled_from([0.0, 0.005])), overhead_s=0.001,
    )
    free = [NOW + draw(times) for _ in range(draw(st.integers(1, 3)))]
    queue = []
    for i in range(draw(st.integers(0, 14))):
        rows = draw(st.integers(1, max(1, max_batch_size // 2))) if max_batch_size else 1
        # Queued a while ago (they are in Redis), deadlines from already hopeless to loose.
        queue.append(Pending(f"q{i}", rows, draw(levels), NOW + draw(times), NOW - 1.0,
                             length=draw(st.sampled_from([1, 1, 4, 7, 16]))))
    queue.sort(key=lambda p: (p.priority, p.deadline))  # the queue's order: priority-major, earliest deadline first
    # Batches headed by an over-share tenant's request capped (gateway/fairness.py), or not.
    over_rows = draw(st.sampled_from([0, 0, 1, 2]))
    aware = draw(st.booleans())  # length-aware batches, or the head's prefix
    even = draw(st.booleans())  # batches evened over the lanes, or each taking what it can
    return BatchingRule(max_batch_size, preferred, over_rows, aware, even_lanes=even), cost, free, queue


@settings(max_examples=400, deadline=None)
@given(scenarios(), levels, st.integers(0, 4), st.integers(1, 2), st.sampled_from([1, 4]))
def test_admission_resumes_the_schedulers_play_and_predicts_what_it_will_do(scenario, priority, since_n, rows, length):
    rule, cost, free, queue = scenario
    model = pb.ModelInfo(name="m", version="1", max_batch_size=rule.max_batch_size,
                         preferred_batch_sizes=rule.preferred_batch_sizes)
    rows = min(rows, rule.max_batch_size) if rule.max_batch_size else 1
    view = pb.ModelLoad(**cost.load_fields(), **rule.load_fields(), executors=len(free), policy="deadline",
                        tails=queue_tails(queue, free, rule, cost))
    assert BatchingRule.of_load(model, view) == rule
    # Admitted since the view by this gateway: queued, and planned from now on.
    since = [Pending(f"s{i}", 1, priority, NOW + 0.5, NOW, length=length) for i in range(since_n)]

    predicted = predicted_finish_s(view, model, Candidate(rows, priority, INF, length), NOW, since)

    # The scheduler's play of everything at this priority or higher, then what this gateway admitted
    # since, then the new request (not in Redis until it arrives: a batch leaving about now is gone).
    arrival = Pending("new", rows, priority, INF, NOW, length=length, queued=False)
    ahead = [p for p in queue if p.priority <= priority]
    truth = play([*ahead, *since, arrival], free, replace(rule, join_lead=JOIN_LEAD_S), cost)
    assert predicted == pytest.approx(truth.finish_of(arrival) - NOW, abs=1e-9)

    # ... and admission admits exactly when that finish is within the budget.
    budget = truth.finish_of(arrival) - NOW + 0.001
    assert admit(view, model, Candidate(rows, priority, budget, length), NOW, since) is None
    if predicted > 2 * cost.predict(rows * length):  # (not alone on an idle executor: that is always admitted)
        assert admit(view, model, Candidate(rows, priority, predicted / 2, length), NOW, since) is not None


@settings(max_examples=400, deadline=None)
@given(scenarios())
def test_the_batches_the_plan_sends_now_are_the_first_of_the_play(scenario):
    rule, cost, free, queue = scenario
    decision = plan(NOW, queue, ModelPolicy(rule, max_queue_delay=0.0), free, cost, lead=1.0)
    # The plan first sheds what is hopeless even alone on the first free executor; the play of the
    # rest forms the same batches, on the same executors, at the same times.
    first_start = max(NOW, min(free))
    live = [p for p in queue if p.deadline > NOW and first_start + cost.typical(p.units) <= p.deadline]
    played = play(live, free, rule, cost)
    assert len(decision.batches) <= len(played.batches)
    for sent, simulated in zip(decision.batches, played.batches):
        assert (sent.members, sent.executor, sent.start, sent.finish) == (
            simulated.members, simulated.executor, simulated.start, simulated.finish)


def test_a_request_between_two_batches_joins_the_one_the_plan_would_put_it_in():
    # Known case: one executor busy for 50 ms, 6 rows queued, max 4, preferred 4. The play sends 4
    # then 2; a new row joins the second batch (the first's head did not reach the queue's end).
    cost = FunctionCost(lambda units: 0.01 * units)
    queue = [Pending(f"q{i}", 1, 1, NOW + 1.0, NOW - 1.0) for i in range(6)]
    played = play(queue, [NOW + 0.05], BatchingRule(4, (4,)), cost)
    assert [b.rows for b in played.batches] == [4, 2] and played.resume_queue == tuple(queue[4:])
    arrival = Pending("new", 1, 1, INF, NOW, queued=False)
    again = play([*queue, arrival], [NOW + 0.05], BatchingRule(4, (4,), join_lead=JOIN_LEAD_S), cost)
    assert [b.rows for b in again.batches] == [4, 3]
    assert again.finish_of(arrival) == pytest.approx(NOW + 0.05 + 0.04 + 0.03)


def test_an_over_share_head_makes_a_capped_batch_and_a_request_within_its_share_a_full_one():
    cost = FunctionCost(lambda units: 0.01 * units)
    over = [Pending(f"a{i}", 1, 1 + OVER_SHARE, NOW + 1.0, NOW - 1.0) for i in range(6)]
    assert [b.rows for b in play(over, [NOW], BatchingRule(4, over_share_rows=2), cost).batches] == [2, 2, 2]
    within = [Pending("b", 1, 1, NOW + 1.0, NOW - 1.0), *over]
    assert [b.rows for b in play(within, [NOW], BatchingRule(4, over_share_rows=2), cost).batches] == [4, 2, 1]
    assert [b.rows for b in play(over, [NOW], BatchingRule(4), cost).batches] == [4, 2]


# -- length-aware batches (deterministic) -----------------------------------------------------

def _lengths(lengths, deadline=NOW + 10.0, gap=0.0):
    return [Pending(f"r{i}", 1, 1, deadline + i * gap, NOW - 1.0, length=n) for i, n in enumerate(lengths)]


PER_TOKEN = FunctionCost(lambda units: 0.001 + 0.0001 * units)
LENGTH_AWARE = BatchingRule(4, length_aware=True)


def test_length_aware_batches_put_similar_lengths_together():
    queue = _lengths([10, 100] * 4)
    aware = play(queue, [NOW], LENGTH_AWARE, PER_TOKEN)
    assert [[m.length for m in b.members] for b in aware.batches] == [[10, 10, 10, 10], [100, 100, 100, 100]]
    plain = play(queue, [NOW], BatchingRule(4), PER_TOKEN)
    assert [[m.length for m in b.members] for b in plain.batches] == [[10, 100, 10, 100], [10, 100, 10, 100]]
    assert aware.free[0] < plain.free[0]  # the same requests, sooner: less padding run


def test_the_head_always_goes_first_so_a_long_request_is_never_starved():
    # A long request at the head takes its batch, whatever is behind it.
    queue = _lengths([200] + [10] * 12)
    first = play(queue, [NOW], LENGTH_AWARE, PER_TOKEN).batches[0]
    assert first.members[0] is queue[0]
    # Second in line behind shorts, it leads the next batch once the head's batch is gone.
    queue = _lengths([10, 200] + [10] * 12, gap=0.001)
    batches = play(queue, [NOW], LENGTH_AWARE, PER_TOKEN).batches
    assert queue[1] in batches[1].members and [m.length for m in batches[0].members] == [10] * 4


def test_a_request_that_cannot_wait_for_another_batch_goes_in_this_one():
    # The long one's deadline leaves no room for a batch after this one: it joins, padding or not.
    cost = FunctionCost(lambda units: 0.01 * units)
    # A full batch of 10s takes 0.4 s, one of 60s 2.4 s: after the first, 2.8 s, past its 2.5 s.
    urgent = Pending("urgent", 1, 1, NOW + 2.5, NOW - 1.0, length=60)
    queue = [Pending("head", 1, 1, NOW + 2.45, NOW - 1.0, length=10), urgent,
             *[Pending(f"s{i}", 1, 1, NOW + 5.0, NOW - 1.0, length=10) for i in range(6)]]
    first = play(queue, [NOW], LENGTH_AWARE, cost).batches[0]
    assert urgent in first.members
    # With time to spare it waits for a batch of its own length instead.
    relaxed = [queue[0], Pending("later", 1, 1, NOW + 50.0, NOW - 1.0, length=60), *queue[2:]]
    first = play(relaxed, [NOW], LENGTH_AWARE, cost).batches[0]
    assert [m.length for m in first.members] == [10, 10, 10, 10]


def test_the_plan_sends_the_length_aware_batch_and_leaves_the_rest_queued():
    queue = _lengths([10, 100] * 4)
    policy = ModelPolicy(LENGTH_AWARE, max_queue_delay=0.0)
    decision = plan(NOW, queue, policy, [NOW], PER_TOKEN, lead=0.0)
    assert [m.length for m in decision.batches[0].members] == [10, 10, 10, 10]


# -- batches evened over the lanes (deterministic) ---------------------------------------------

PER_ROW = FunctionCost(lambda units: units / 64)  # binary-exact times: "finishes as soon" is exact
EVEN = BatchingRule(32, even_lanes=True)


def _rows(n, deadline=NOW + 10.0):
    return [Pending(f"r{i}", 1, 1, deadline, NOW - 1.0) for i in range(n)]


def test_two_idle_lanes_split_the_queue_between_them():
    played = play(_rows(10), [NOW, NOW], EVEN, PER_ROW)
    assert [(b.executor, b.rows, b.start) for b in played.batches] == [(0, 5, NOW), (1, 5, NOW)]
    assert played.free == (NOW + 5 / 64, NOW + 5 / 64)
    # Each lane taking everything it can: one lane runs all ten, the other idles.
    whole = play(_rows(10), [NOW, NOW], BatchingRule(32), PER_ROW)
    assert [(b.executor, b.rows) for b in whole.batches] == [(0, 10)]


def test_a_lane_leaves_a_lane_about_to_free_up_the_rows_it_can_finish_as_soon():
    # The other lane frees up 4 rows' run later: 8 rows here and 4 there finish together.
    played = play(_rows(12), [NOW, NOW + 4 / 64], EVEN, PER_ROW)
    assert [(b.executor, b.rows) for b in played.batches] == [(0, 8), (1, 4)]
    assert [b.finish for b in played.batches] == [NOW + 8 / 64, NOW + 8 / 64]


def test_a_lane_takes_everything_when_the_others_stay_busy_longer_than_its_run():
    played = play(_rows(12), [NOW, NOW + 13 / 64], EVEN, PER_ROW)
    assert [(b.executor, b.rows) for b in played.batches] == [(0, 12)]


def test_with_more_queued_than_the_lanes_hold_every_batch_is_full():
    # Saturated: evening changes nothing, each lane runs max_batch_size rows.
    queue = _rows(24)
    even = play(queue, [NOW, NOW], BatchingRule(4, even_lanes=True), PER_ROW)
    whole = play(queue, [NOW, NOW], BatchingRule(4), PER_ROW)
    assert [b.rows for b in even.batches] == [b.rows for b in whole.batches] == [4] * 6
    # Past that, the last rows are split: 2 and 2 finish sooner than 4 and none.
    assert [b.rows for b in play(_rows(20), [NOW, NOW], BatchingRule(4, even_lanes=True), PER_ROW).batches] \
        == [4, 4, 4, 4, 2, 2]


def test_lanes_that_drifted_apart_even_out():
    # Closed loop on two lanes: each batch's requests come back a row's run after it ends. Started
    # from one lane running 28 rows and the other 4, taking everything each time keeps them so
    # (the short lane cycles its 4); evened, they meet within a few batches.
    def last_sizes(rule):
        free, pending, last = [NOW + 28 / 64, NOW + 4 / 64], [], {0: 28, 1: 4}
        for _ in range(16):
            e = min(range(2), key=free.__getitem__)
            pending += _rows(last[e], deadline=NOW + 100.0)
            batch = play(pending, [free[e] + 1 / 64, free[1 - e]], rule, PER_ROW).batches[0]
            assert batch.executor == 0  # the lane free first takes the first batch
            pending = pending[batch.rows:]
            last[e], free[e] = batch.rows, batch.finish
        return last

    assert last_sizes(BatchingRule(32)) == {0: 28, 1: 4}
    evened = last_sizes(EVEN)
    assert abs(evened[0] - evened[1]) <= 2 and min(evened.values()) >= 12
