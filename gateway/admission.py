"""Admission control: refuse at once what the mesh cannot answer within its budget.

Pure: given the scheduler's published load view of a model (its learned
batch cost, executors, queued rows per priority level, work already
dispatched) and what this gateway admitted since that view was taken,
predict when a new request would finish and compare with its budget. Rejecting on arrival
costs the client microseconds and keeps the queue short enough that every
admitted request still makes its deadline; letting it in would only have it
shed later, after it delayed others.
"""
from __future__ import annotations

import math

from batchline.errors import BatchlineError, DeadlineExceeded, ResourceExhausted
from batchline.protocol import internal_pb2 as pb


def batch_cost_s(load: pb.ModelLoad, rows: int) -> float:
    """Predicted service time of one batch of `rows`, as the scheduler plans it."""
    return load.cost_per_row_s * rows + load.cost_fixed_s + load.cost_margin_s + load.overhead_s


def drain_s(load: pb.ModelLoad, max_batch_size: int, rows: int) -> float:
    """Time to serve `rows` queued rows: batches spread over the executors.

    Batches are as large as the scheduler has recently been sending (under
    tight deadlines it sends smaller ones than max_batch_size), or full.
    """
    per_batch = max(1, max_batch_size)
    if load.batch_rows >= 1:
        per_batch = max(1, min(per_batch, int(load.batch_rows)))
    executors = max(1, load.executors)
    return batch_cost_s(load, min(rows, per_batch)) * max(1.0, rows / (per_batch * executors))


def predicted_finish_s(load: pb.ModelLoad, max_batch_size: int, priority: int, rows: int,
                       admitted_since: int = 0, elapsed_s: float = 0.0) -> float:
    """Seconds from now until a new request of `rows` at `priority` is predicted answered.

    The scheduler's view is `elapsed_s` old: its executors have worked that
    long on their backlog since, and this gateway has admitted
    `admitted_since` rows (at this priority or higher) that it does not show
    yet. Ahead of the request: that backlog, then the queued rows at its
    priority or higher, served in full batches spread over the executors.
    """
    queued = sum(load.queued_rows[: max(1, priority)]) + admitted_since
    backlog = max(0.0, load.backlog_s / max(1, load.executors) - elapsed_s)
    return backlog + drain_s(load, max_batch_size, queued + rows)


def admit(
    load: pb.ModelLoad,
    model: pb.ModelInfo,
    priority: int,
    rows: int,
    budget_s: float,
    admitted_since: int = 0,
    elapsed_s: float = 0.0,
    headroom: float = 1.0,
) -> BatchlineError | None:
    """None to admit; else the error to answer with (carrying a retry-after hint)."""
    alone = batch_cost_s(load, rows)
    if alone > budget_s:
        return DeadlineExceeded(
            f"the {budget_s * 1e3:.1f} ms budget is shorter than model '{model.name}' takes to run this request "
            f"alone (about {alone * 1e3:.1f} ms): raise the timeout"
        )
    finish = predicted_finish_s(load, model.max_batch_size, priority, rows, admitted_since, elapsed_s)
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
