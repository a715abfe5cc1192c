"""Admission control: refuse at once what the mesh cannot answer within its budget.

Pure: the scheduler publishes, per model and priority level, where its plan
for the queue ends (the last batch, its room, when each executor is free
after it: `scheduler.policy.queue_tail`). The gateway adds to the end of that
plan the rows it admitted since the view was taken and then the new request,
the way the scheduler will serve them: into the last batch while it has room,
then in batches of up to max_batch_size on whichever executor is free first.
A batch costs what the profile predicts for its rows times its longest
member's length (batchline.sizing): a 16-token request is not judged by what
128-token ones cost.
If that finishes past the budget, the request is refused now. Refusing on
arrival costs the client microseconds and keeps the queue short enough that
every admitted request still makes its deadline; letting it in would only
have it shed later, after it delayed others.

How much of the budget a prediction may fill (the headroom) is a setting, or
learned: on a shared host batches overrun the profile when other processes
take the CPU, and by how much depends on the host and the load.
`Calibration` watches whether the requests a gateway admitted were answered
in time and moves the headroom until the target share of them (e.g. 99%) is.
"""
from __future__ import annotations

import math

from batchline.errors import BatchlineError, DeadlineExceeded, ResourceExhausted, duration_text
from batchline.protocol import internal_pb2 as pb
from batchline.sizing import margin_for


def margin_s(load: pb.ModelLoad, units: int) -> float:
    """The profile's margin for a batch of `units`: larger batches overrun by more."""
    return margin_for(load.margin_by_size_s, units, load.cost_margin_s)


def batch_cost_s(load: pb.ModelLoad, units: int) -> float:
    """Predicted service time of one batch of `units` (rows x length), as the scheduler plans it."""
    return max(0.0, load.cost_per_unit_s * units + load.cost_fixed_s) + margin_s(load, units) + load.overhead_s


# A plan's last batch that starts sooner than this (or should have started
# already: the view is a few ms old) is on its way to an executor: too late to join.
JOIN_LEAD_S = 0.005


def _tail(load: pb.ModelLoad, priority: int, now_s: float) -> pb.QueueTail:
    # The plan of the lowest published level at or above this priority (1 is the highest).
    chosen = None
    for i, tail in enumerate(load.tails):
        if (tail.level or i + 1) <= max(1, priority):
            chosen = tail
    if chosen is not None:
        return chosen
    # A view without a plan: executors free once the dispatched work is done.
    executors = max(1, load.executors)
    return pb.QueueTail(free_s=[now_s + load.backlog_s / executors] * executors)


def predicted_finish_s(load: pb.ModelLoad, max_batch_size: int, priority: int, rows: int,
                       now_s: float, admitted_since: int = 0, length: int = 1, since_length: int = 1) -> float:
    """Seconds from `now_s` until a new request of `rows` x `length` at `priority` is predicted answered.

    Behind the plan's rows at its priority or higher come the `admitted_since`
    rows this gateway let in after the view was taken (the longest of them
    `since_length`), then the request. They join the plan's last batch only
    while it has not left yet; the batches they fill are as long as the
    longest of them.
    """
    tail = _tail(load, priority, now_s)
    cap = max_batch_size if max_batch_size > 0 else 0
    free = [max(now_s, f) for f in tail.free_s] or [now_s]
    left = admitted_since + rows
    longest = max(1, length, since_length)
    finish = now_s
    if tail.rows and cap and tail.executor < len(free) and tail.start_s - now_s >= JOIN_LEAD_S:
        join = min(left, max(0, tail.limit_rows - tail.rows))
        if join:
            finish = max(now_s, tail.start_s) + batch_cost_s(load, (tail.rows + join) * max(longest, tail.length))
            free[tail.executor] = max(free[tail.executor], finish)
            left -= join
    while left > 0:
        n = min(left, cap) if cap else 1  # without a batch dim, every request is a batch of its own
        e = min(range(len(free)), key=free.__getitem__)
        if left - n < rows < left and free[e] - now_s < JOIN_LEAD_S:
            # A batch leaving about now takes the requests admitted before this one, which are
            # queued already; this one is not yet, and goes in the next batch.
            n = left - rows
        free[e] += batch_cost_s(load, n * longest)
        finish = free[e]
        left -= n
    return finish - now_s


def admit(
    load: pb.ModelLoad,
    model: pb.ModelInfo,
    priority: int,
    rows: int,
    budget_s: float,
    now_s: float,
    admitted_since: int = 0,
    headroom: float = 1.0,
    length: int = 1,
    since_length: int = 1,
    retries_at_s: float = 0.0,
    stated_budget_s: float | None = None,
) -> BatchlineError | None:
    """None to admit; else the error to answer with (carrying a retry-after hint).

    `budget_s` is the time the request has to be run in; `stated_budget_s`, the client's whole
    budget (it includes the gateway's answer margin), is what the messages quote.

    The hint is when the request would fit if nothing else arrived, but no earlier than
    `retries_at_s`, where the requests refused before it are expected back (see `retry_spacing_s`):
    clients that all came back on the first would mostly be refused again, and each refusal is a
    whole gRPC call's CPU taken from the model on a shared host. It is at most one budget later
    than the request's own: refused requests that never come back (an open-loop client's) would
    otherwise push it ever later while the overload lasts.
    """
    units = rows * max(1, length)
    alone = batch_cost_s(load, units)
    # Judged without the margin, as the scheduler judges a request hopeless: the margin is a
    # high quantile of past overruns, and a spell of slow runs can push it past every client's
    # budget. Refusing on it would then refuse everything, so nothing would run and report, and
    # the margin would never come down again.
    typical = alone - margin_s(load, units)
    stated = f"{duration_text(stated_budget_s or budget_s)} budget"
    if stated_budget_s is not None and stated_budget_s > budget_s:
        stated += f" ({duration_text(budget_s)} to run in, once the answer's way back is kept)"
    if typical > budget_s:
        return DeadlineExceeded(
            f"the {stated} is shorter than model '{model.name}' takes to run this request "
            f"alone (about {typical * 1e3:.1f} ms): raise the timeout"
        )
    finish = predicted_finish_s(load, model.max_batch_size, priority, rows, now_s, admitted_since, length, since_length)
    if finish <= budget_s * headroom or finish <= alone + 1e-6:  # (1 µs: float error of now + cost - now)
        # No later than alone means it starts at once on an idle executor: there is no queue to
        # mispredict. Refusing it would also leave a learned headroom that fell too low with no
        # answer to learn from, ever again.
        return None
    queued = sum(load.queued_rows[: max(1, priority)]) + admitted_since
    own = finish - budget_s * headroom
    wait = max(own, min(retries_at_s - now_s, own + budget_s))
    return ResourceExhausted(
        f"model '{model.name}' is overloaded: with {queued} rows queued ahead at priority <= {priority}, "
        f"this request would finish in about {finish * 1e3:.0f} ms, past its {stated}; "
        f"retry in {math.ceil(wait * 1e3)} ms, with a larger timeout, or at a higher priority",
        retry_after_s=wait,
    )


def retry_spacing_s(load: pb.ModelLoad, units: int, gateways: int = 1) -> float:
    """How much later than the request refused before it a refused request of `units` is told to
    come back: its share of a full batch on one of the executors, so that refused clients return
    at about the rate the model serves them. Each of `gateways` live gateways spaces only the
    refusals it gives itself (about 1/`gateways` of them), so it spaces them that many times as far."""
    return load.cost_per_unit_s * units * max(1, gateways) / max(1, load.executors)


class Calibration:
    """The headroom admission leaves for prediction error, learned from one model's answers.

    Stochastic approximation of the headroom at which a `target` share of
    admitted requests is answered within budget: each answer raises it by
    `step`·(1 − target) when it came in time and lowers it by `step`·target
    when it did not, so it settles where 1 − target of the answers are late.
    It stays within [`floor`, 1]: never admitting what the plan itself says
    will be late, and never refusing everything on a run of bad luck.
    """

    def __init__(self, target: float, initial: float, floor: float = 0.25, step: float = 0.01) -> None:
        self.target = target
        self.floor = floor
        self.step = step
        self.headroom = initial

    def observe(self, in_time: bool) -> None:
        change = self.step * ((1.0 - self.target) if in_time else -self.target)
        self.headroom = min(1.0, max(self.floor, self.headroom + change))
