"""Admission control: refuse at once what the mesh cannot answer within its budget.

Pure: the scheduler publishes, per model and priority level, its play of the
queue from the point where arrivals can still change it (batchline.planning.view).
The gateway plays on from there with the requests it admitted since the view
was taken and then the new one, by the scheduler's own batching rule and cost
model (batchline.planning): the batch each joins, padded to its longest
member (a 16-token request is not judged by what 128-token ones cost), and
when it runs. If the request finishes past its budget, or the rule would shed
it, it is refused now. Refusing on arrival costs the client microseconds and
keeps the queue short enough that every admitted request still makes its
deadline; letting it in would only have it shed later, after it delayed others.

How much of the budget a prediction may fill (the headroom) is a setting, or
learned: on a shared host batches overrun the profile when other processes
take the CPU, and by how much depends on the host and the load.
`Calibration` watches whether the requests a gateway admitted were answered
in time and moves the headroom until the target share of them (e.g. 99%) is.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from batchline.errors import BatchlineError, DeadlineExceeded, ResourceExhausted, duration_text
from batchline.planning import BatchCost, BatchingRule, Pending, resume
from batchline.protocol import internal_pb2 as pb

# A batch that leaves sooner than this after a request arrives (or should have left already: the
# view is a few ms old) is on its way to an executor: the request is not queued in time to join it.
JOIN_LEAD_S = 0.005


@dataclass(frozen=True, slots=True)
class Candidate:
    """A request asking to be admitted."""
    rows: int
    priority: int
    budget_s: float                       # the time it has to be run in
    length: int = 1                       # elements per row at the model's variable dims
    stated_budget_s: float | None = None  # the client's whole budget (with the answer's way back), for messages


def _tail(load: pb.ModelLoad, priority: int, now_s: float) -> pb.QueueTail:
    # The play of the lowest published level at or above this priority (1 is the highest).
    chosen = None
    for i, tail in enumerate(load.tails):
        if (tail.level or i + 1) <= max(1, priority):
            chosen = tail
    if chosen is not None and chosen.free_s:
        return chosen
    # A view without a play: executors free once the dispatched work is done.
    executors = max(1, load.executors)
    return pb.QueueTail(free_s=[now_s + load.backlog_s / executors] * executors)


def judged_by(load: pb.ModelLoad, model: pb.ModelInfo) -> tuple[BatchCost, BatchingRule]:
    """The cost and the batching rule the scheduler played by in the view `load` of `model`, built
    once per view: every request admitted until the next read is judged by them."""
    held = _judged.get(id(load))
    if held is not None and held[0] is load and held[1] is model:
        return held[2], held[3]
    if len(_judged) >= _JUDGED_KEEP:
        _judged.clear()
    cost, rule = BatchCost.of_load(load), BatchingRule.of_load(model, load, JOIN_LEAD_S)
    _judged[id(load)] = (load, model, cost, rule)
    return cost, rule


# The views last judged by, with what was built of them (judged_by); a few per model, so the
# entries of views replaced since are dropped before they add up.
_judged: dict[int, tuple[pb.ModelLoad, pb.ModelInfo, BatchCost, BatchingRule]] = {}
_JUDGED_KEEP = 64


def predicted_finish_s(load: pb.ModelLoad, model: pb.ModelInfo, request: Candidate, now_s: float,
                       since: Sequence[Pending] = ()) -> float:
    """Seconds from `now_s` until `request`, arriving now, is predicted answered.

    The scheduler's play of the queue at the request's priority or higher, resumed from the view
    with the requests this gateway admitted since the view was taken (`since`, queued already)
    and then the request behind them: the scheduler's own batching rule (batchline.planning)
    decides which batch each joins and when it runs. The request's own deadline cuts nothing
    here: the rule could only put a request that is late in its batch into a later one, and
    either way it is refused.
    """
    tail = _tail(load, request.priority, now_s)
    arrival = Pending("", request.rows, request.priority, float("inf"), now_s, length=max(1, request.length),
                      queued=False)
    cost, rule = judged_by(load, model)
    played = resume(tail, since, arrival, rule, cost)
    return played.finish_of(arrival) - now_s


def admit(load: pb.ModelLoad, model: pb.ModelInfo, request: Candidate, now_s: float, since: Sequence[Pending] = (),
          headroom: float = 1.0, retries_at_s: float = 0.0) -> BatchlineError | None:
    """None to admit; else the error to answer with (carrying a retry-after hint).

    `since` are the requests this gateway admitted that the view does not count yet; `headroom`
    the share of the budget a prediction may fill. The hint is when the request would fit if
    nothing else arrived, but no earlier than `retries_at_s`, where the requests refused before
    it are expected back (see `retry_spacing_s`): clients that all came back on the first would
    mostly be refused again, and each refusal is a whole gRPC call's CPU taken from the model on
    a shared host. It is at most one budget later than the request's own: refused requests that
    never come back (an open-loop client's) would otherwise push it ever later while the
    overload lasts.
    """
    verdict = assess(load, model, request, now_s, since, headroom)
    if isinstance(verdict, Overloaded):
        return verdict.refusal(model, request, now_s, retries_at_s)
    return verdict


def assess(load: pb.ModelLoad, model: pb.ModelInfo, request: Candidate, now_s: float, since: Sequence[Pending] = (),
           headroom: float = 1.0) -> DeadlineExceeded | Overloaded | None:
    """`admit`'s judgement before the answer is worded: None to admit; DeadlineExceeded when the
    budget is shorter than the request takes alone; else the Overloaded verdict."""
    cost, _ = judged_by(load, model)
    budget_s = request.budget_s
    units = request.rows * max(1, request.length)
    alone = cost.predict(units)
    # Judged without the margin, as the scheduler judges a request hopeless: the margin is a
    # high quantile of past overruns, and a spell of slow runs can push it past every client's
    # budget. Refusing on it would then refuse everything, so nothing would run and report, and
    # the margin would never come down again.
    if cost.typical(units) > budget_s:
        return DeadlineExceeded(
            f"the {_stated(request)} is shorter than model '{model.name}' takes to run this request "
            f"alone (about {cost.typical(units) * 1e3:.1f} ms): raise the timeout"
        )
    finish = predicted_finish_s(load, model, request, now_s, since)
    if finish <= budget_s * headroom or finish <= alone + 1e-6:  # (1 µs: float error of now + cost - now)
        # No later than alone means it starts at once on an idle executor: there is no queue to
        # mispredict. Refusing it would also leave a learned headroom that fell too low with no
        # answer to learn from, ever again.
        return None
    priority = request.priority
    queued = sum(load.queued_rows[: max(1, priority)]) + sum(p.rows for p in since if p.priority <= priority)
    # It holds while the request would neither fit its budget nor start at once on an idle executor.
    return Overloaded(now_s + finish, now_s + finish - budget_s * headroom, queued,
                      min(now_s + finish - budget_s * headroom, now_s + finish - alone), cost.typical(units))


@dataclass(frozen=True, slots=True)
class Overloaded:
    """Why a request was refused as overload, in absolute time: it would have finished at
    `finish_at_s`, and would fit from `fits_at_s` if nothing else changed (`queued` rows ahead).

    The verdict holds for a later request of the same model, priority and size that has no more time
    (but not too little to be worth running), until `holds_until_s`, as long as what it was judged on is unchanged
    (the view, the requests admitted since, the headroom): such a request is refused by it without
    playing the queue again (gateway/ledger.py). Under overload most requests are refusals, and
    each one's CPU comes from the model's on a shared host."""
    finish_at_s: float
    fits_at_s: float
    queued: int
    holds_until_s: float
    shortest_budget_s: float  # a request of the same size with less is refused as hopeless instead

    def refusal(self, model: pb.ModelInfo, request: Candidate, now_s: float, retries_at_s: float) -> ResourceExhausted:
        """The refusal at `now_s`, with the retry-after hint `admit` gives (see there)."""
        own = self.fits_at_s - now_s
        wait = max(own, min(retries_at_s - now_s, own + request.budget_s))
        return ResourceExhausted(
            f"model '{model.name}' is overloaded: with {self.queued} rows queued ahead at priority <= "
            f"{request.priority}, this request would finish in about {(self.finish_at_s - now_s) * 1e3:.0f} ms, past "
            f"its {_stated(request)}; retry in {math.ceil(wait * 1e3)} ms, with a larger timeout, "
            "or at a higher priority",
            retry_after_s=wait,
        )


def _stated(request: Candidate) -> str:
    """The request's budget as a refusal names it (built for refusals only: admitted requests,
    the many, skip the formatting)."""
    stated = f"{duration_text(request.stated_budget_s or request.budget_s)} budget"
    if request.stated_budget_s is not None and request.stated_budget_s > request.budget_s:
        stated += f" ({duration_text(request.budget_s)} to run in, once the answer's way back is kept)"
    return stated


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
