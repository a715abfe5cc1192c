"""Admission control: refuse at once what the mesh cannot answer within its budget.

Pure: the scheduler publishes, per model and priority level, where its plan
for the queue ends (the last batch, its room, when each executor is free
after it: `scheduler.policy.queue_tail`). The gateway adds to the end of that
plan the rows it admitted since the view was taken and then the new request,
the way the scheduler will serve them: into the last batch while it has room,
then in batches of up to max_batch_size on whichever executor is free first.
If that finishes past the budget, the request is refused now. Refusing on
arrival costs the client microseconds and keeps the queue short enough that
every admitted request still makes its deadline; letting it in would only
have it shed later, after it delayed others.
"""
from __future__ import annotations

import math

from batchline.errors import BatchlineError, DeadlineExceeded, ResourceExhausted
from batchline.protocol import internal_pb2 as pb


def batch_cost_s(load: pb.ModelLoad, rows: int) -> float:
    """Predicted service time of one batch of `rows`, as the scheduler plans it."""
    return load.cost_per_row_s * rows + load.cost_fixed_s + load.cost_margin_s + load.overhead_s


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
                       now_s: float, admitted_since: int = 0) -> float:
    """Seconds from `now_s` until a new request of `rows` at `priority` is predicted answered.

    Behind the plan's rows at its priority or higher come the `admitted_since`
    rows this gateway let in after the view was taken, then the request. They
    join the plan's last batch only while it has not left yet.
    """
    tail = _tail(load, priority, now_s)
    cap = max_batch_size if max_batch_size > 0 else 0
    free = [max(now_s, f) for f in tail.free_s] or [now_s]
    left = admitted_since + rows
    finish = now_s
    if tail.rows and cap and tail.executor < len(free) and tail.start_s - now_s >= JOIN_LEAD_S:
        join = min(left, max(0, tail.limit_rows - tail.rows))
        if join:
            finish = max(now_s, tail.start_s) + batch_cost_s(load, tail.rows + join)
            free[tail.executor] = max(free[tail.executor], finish)
            left -= join
    while left > 0:
        n = min(left, cap) if cap else 1  # without a batch dim, every request is a batch of its own
        e = min(range(len(free)), key=free.__getitem__)
        if left - n < rows < left and free[e] - now_s < JOIN_LEAD_S:
            # A batch leaving about now takes the requests admitted before this one, which are
            # queued already; this one is not yet, and goes in the next batch.
            n = left - rows
        free[e] += batch_cost_s(load, n)
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
) -> BatchlineError | None:
    """None to admit; else the error to answer with (carrying a retry-after hint)."""
    alone = batch_cost_s(load, rows)
    if alone > budget_s:
        return DeadlineExceeded(
            f"the {budget_s * 1e3:.1f} ms budget is shorter than model '{model.name}' takes to run this request "
            f"alone (about {alone * 1e3:.1f} ms): raise the timeout"
        )
    finish = predicted_finish_s(load, model.max_batch_size, priority, rows, now_s, admitted_since)
    if finish <= budget_s * headroom:
        return None
    queued = sum(load.queued_rows[: max(1, priority)]) + admitted_since
    wait = finish - budget_s * headroom
    return ResourceExhausted(
        f"model '{model.name}' is overloaded: with {queued} rows queued ahead at priority <= {priority}, "
        f"this request would finish in about {finish * 1e3:.0f} ms, past its {budget_s * 1e3:.0f} ms budget; "
        f"retry in {math.ceil(wait * 1e3)} ms, with a larger timeout, or at a higher priority",
        retry_after_s=wait,
    )
