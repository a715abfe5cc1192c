"""The batching decision: pure, synchronous, with time passed in.

Given a model's queue (already in priority-major, earliest-deadline-first
order), when each executor holding the model can take its next batch, and a
prediction of execution time per batch size in units (rows x the batch's
longest length: batchline.sizing), `plan()` says which batches to
send now, to which executor and why, which requests are shed, and when to
look again. It does no I/O and reads no clock, so every rule is tested with
an explicit clock.

Two policies share the mechanics:

- deadline-aware (the default): a batch goes out when it is full, reaches a
  preferred size (the largest one, when more is queued), when waiting longer
  would make its earliest deadline miss, when max_queue_delay passes, or when
  no company is expected before then (`company`: the rate of arrivals seen
  while as many requests waited, scheduler.company; a lone client's request
  does not wait for company that cannot come); a request that cannot finish
  by its deadline even if started on the first free executor is shed before
  it wastes executor time.
- FIFO (Triton-style max-delay batching, kept as the baseline): arrival
  order within a priority level, no deadline rule, nothing shed until its
  deadline has passed.

Batches are handed to an executor only when it is about to be free (within
`lead` seconds): while every executor is busy, requests keep queueing and
form larger batches instead of waiting in an executor's private backlog.

While requests within their tenants' shares are about, over-share work is held
back: a batch headed by an over-share request is capped (`over_share_rows`)
and goes only to an executor with nothing else to run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Iterable, Sequence

from batchline.contract import OVER_SHARE
from batchline.planning import DEADLINE_AWARE, FIFO, BatchingRule, Cost, Formed, Pending, form_batch
from batchline.protocol import internal_pb2 as pb

# Why a batch went out; also the label of the dispatch-reason metric.
FULL = "full"            # no more rows fit (max_batch_size reached)
PREFERRED = "preferred"  # a preferred size: all that is queued, or the largest the queue's head makes
DEADLINE = "deadline"    # waiting longer would make the earliest deadline miss
DELAY = "delay"          # the oldest member waited max_queue_delay
NO_COMPANY = "no_company"  # nothing more is expected to arrive before the delay is up


@dataclass(frozen=True, slots=True)
class ModelPolicy:
    """What the plan reads of a model's settings: the batching rule, which the gateways' admission
    control plays by too, and how long a batch may wait for company, the scheduler's alone."""
    rule: BatchingRule
    max_queue_delay: float           # seconds the oldest request may wait for company

    @classmethod
    def of_model(cls, info: pb.ModelInfo, kind: str = DEADLINE_AWARE, length_aware: bool = False,
                 even_lanes: bool = False) -> ModelPolicy:
        """The policy `kind` (SchedulerSettings.policy) for a model of config `info`; `length_aware`
        asks for length-aware batching, `even_lanes` for batches evened over the lanes
        (BatchingRule.of_model says where they apply)."""
        rule = BatchingRule.of_model(info, deadline_aware=kind != FIFO, length_aware=length_aware,
                                     even_lanes=even_lanes)
        return cls(rule, info.max_queue_delay_ms / 1000)


# An over-share batch may take at most this share of the shortest budget of the requests within
# their shares: one of those, arriving as it starts, waits for it and then runs in what is left.
OVER_SHARE_SLICE = 0.25


def over_share_rows(cost: Cost, in_share_budget: float | None, length: int, max_batch_size: int) -> int:
    """The most rows a batch headed by an over-share request may hold (0: no cap): the largest that
    runs within OVER_SHARE_SLICE of the in-share requests' budget, and at least 1."""
    if in_share_budget is None or max_batch_size <= 1:
        return 0
    rows = 1
    while rows < max_batch_size and cost.predict((rows + 1) * length) <= OVER_SHARE_SLICE * in_share_budget:
        rows += 1
    return rows if rows < max_batch_size else 0


@dataclass(frozen=True)
class PlannedBatch:
    members: tuple[Pending, ...]
    rows: int
    reason: str
    # Least slack among members: deadline - predicted finish.
    slack: float
    executor: int = 0        # index into the `free_at` list given to plan()
    start: float = 0.0       # predicted start on that executor
    finish: float = 0.0      # predicted completion time


@dataclass
class Plan:
    # The rule the batches were formed by: the model's, with this plan's over-share cap. The load
    # view publishes it, so that admission plays the queue by the same rule.
    rule: BatchingRule
    batches: list[PlannedBatch] = field(default_factory=list)
    expired: list[Pending] = field(default_factory=list)
    wake_at: float | None = None  # None: nothing to do until something new happens
    # Nothing can go out before an executor frees up or wake_at (requests wait
    # for an executor, not for company, or none wait and every executor is
    # busy): a new arrival cannot change the plan before then.
    blocked: bool = False

    def _wake(self, t: float) -> None:
        if self.wake_at is None or t < self.wake_at:
            self.wake_at = t


def plan(
    now: float,
    queue: Sequence[Pending],
    policy: ModelPolicy,
    free_at: Sequence[float],
    cost: Cost,
    lead: float = 0.0,
    company: float | None = None,
    in_share_budget: float | None = None,
    busy: Sequence[bool] | None = None,
    room: Sequence[int] | None = None,
) -> Plan:
    """Decide what to do with one model's queue at time `now`.

    `free_at[i]` is when executor i can start another batch (<= now: idle).
    `cost` predicts a batch's time from dispatch to answer: its `predict` errs late (it
    carries a margin) and times dispatch, its `typical` decides that a request is hopeless.
    Each batch is formed by the one batching rule (batchline.planning.form_batch).
    `company` is the arrivals per second seen while as many requests as `queue` holds
    waited (scheduler.company); a batch that could wait for more waits only while at least
    one is expected before its wait is up. None: not known, it waits the whole
    max_queue_delay, as Triton does (the FIFO policy always does).
    `in_share_budget` is the shortest budget of the requests queued within their tenants' shares
    lately (None: none came), which over-share work leaves room for (`_over_share`); `busy[i]`
    whether executor i has batches to run (None: none has); `room[i]` how many more batches
    executor i may hold (its max_batches_per_executor less those it holds; None: no bound), so
    that a model fast enough to finish within the lead does not get more in one plan.
    """
    aware = policy.rule.deadline_aware
    rule, usable = _over_share(policy.rule, queue, cost, in_share_budget, busy)
    out = Plan(rule)
    free = list(free_at) if usable is None else [free_at[i] for i in usable]
    left = None if room is None else list(room) if usable is None else [room[i] for i in usable]
    live = _hopeful(now, queue, free, cost, aware, out.expired)
    while live and free:
        i = min(range(len(free)), key=free.__getitem__)
        start = max(now, free[i])
        if start == math.inf:  # every executor holds its maximum: only a report frees one
            out.blocked = True
            break
        if start > now + lead:
            out._wake(start - lead)  # no executor is ready: let the queue grow
            out.blocked = True
            break
        formed = form_batch(live, start, rule, cost, 0, free[:i] + free[i + 1:] if rule.even_lanes else ())
        for m in formed.late:
            out.expired.append(m)
            live.remove(m)
        if not formed.send:
            continue
        executor = i if usable is None else usable[i]
        batch, wait_until = _decide(now, start, executor, formed, len(live), policy, cost, company)
        if batch is None:
            out._wake(wait_until)
            break
        out.batches.append(batch)
        free[i] = batch.finish
        if left is not None:
            left[i] -= 1
            if left[i] <= 0:
                free[i] = math.inf
        if live[: len(formed.send)] == formed.send:
            del live[: len(formed.send)]
        else:  # length-aware: not the head's prefix
            sent = {id(m) for m in formed.send}
            live = [p for p in live if id(p) not in sent]

    # Whatever waits (for a free executor, or for company) must still be shed
    # the moment its deadline passes.
    if live:
        out._wake(min(p.deadline for p in live))
        out.blocked = out.blocked or not free
    else:
        out.blocked, ready_at = busy_until(now, [f for f in free if f != math.inf], lead)
        if ready_at is not None:
            out._wake(ready_at)
    return out


def _over_share(rule: BatchingRule, queue: Sequence[Pending], cost: Cost, in_share_budget: float | None,
                busy: Sequence[bool] | None) -> tuple[BatchingRule, list[int] | None]:
    """The rule to form this plan's batches by, and the executors it may use (None: all): with
    over-share requests queued while requests within their shares are about, the rule caps the
    batches they head, and when one heads the queue, only executors with nothing to run take work,
    so that a request within its tenant's share arriving meanwhile waits for one such batch at most."""
    if in_share_budget is None:
        return rule, None
    over = [p.length for p in queue if p.priority > OVER_SHARE]
    if not over:
        return rule, None
    rule = replace(rule, over_share_rows=over_share_rows(cost, in_share_budget, max(over), rule.max_batch_size))
    if queue[0].priority <= OVER_SHARE or busy is None:
        return rule, None
    return rule, [i for i, b in enumerate(busy) if not b]


def _hopeful(now: float, queue: Sequence[Pending], free: Sequence[float], cost: Cost, aware: bool,
             expired: list[Pending]) -> list[Pending]:
    """The requests that can still make their deadlines, in service order; the others go to `expired`."""
    first_start = max(now, min(free)) if free else None
    live: list[Pending] = []
    for p in queue:
        if p.deadline <= now:
            expired.append(p)
        elif aware and first_start is not None and first_start + cost.typical(p.units) > p.deadline:
            # It cannot finish in time even alone on the first free executor.
            expired.append(p)
        else:
            live.append(p)
    if not aware:
        live.sort(key=lambda p: (p.priority, p.enqueued))
    return live


def _decide(now: float, start: float, executor: int, formed: Formed, waiting: int, policy: ModelPolicy, cost: Cost,
            company: float | None) -> tuple[PlannedBatch | None, float]:
    """Whether the batch `formed` (of `waiting` requests left) goes now, and why: (the batch, 0), or
    (None, when to look again) when it waits for company."""
    rule = policy.rule
    aware = rule.deadline_aware
    cap = rule.max_batch_size if rule.max_batch_size > 0 else None
    members = formed.send
    rows = sum(m.rows for m in members)
    batch_cost = cost.predict(formed.units)
    earliest = min(m.deadline for m in members)
    send_by = earliest - batch_cost - (start - now)  # latest dispatch that still meets the earliest deadline
    delay_due = min(m.enqueued for m in members) + policy.max_queue_delay
    if formed.shrunk:
        reason = DEADLINE
    elif formed.preferred:
        reason = PREFERRED
    elif cap is None or rows >= cap or (len(members) < waiting and not formed.evened):
        # Cut to its even share, it is not full: the rest is the other lanes', and the whole would
        # wait for company as one batch would (the share only splits it).
        reason = FULL
    elif rows in rule.preferred_batch_sizes:
        reason = PREFERRED
    elif aware and now >= send_by:
        reason = DEADLINE
    elif now >= delay_due:
        reason = DELAY
    elif now >= (worth := _worth_waiting_until(min(send_by, delay_due), company) if aware else delay_due):
        reason = NO_COMPANY
    else:
        return None, worth
    finish = start + batch_cost
    return PlannedBatch(tuple(members), rows, reason, earliest - finish, executor, start, finish), 0.0


def _worth_waiting_until(wait_until: float, company: float | None) -> float:
    """The last moment at which waiting until `wait_until` still expects one more arrival, at
    `company` arrivals per second (-inf: none is expected at all; None: not known, wait)."""
    if company is None:
        return wait_until
    return wait_until - 1.0 / company if company > 0 else float("-inf")


def free_after(now: float, batches: Iterable[tuple[float, float]], not_before: float = float("-inf")) -> float:
    """When an executor runs out of the work sent to it: `batches` are (planned start, predicted
    cost), run one after another. The first is running; past its predicted end without a report
    it is late, not starting over: taken to end now, the others after it.

    `not_before` is when the executor's last reported run ended: a batch fetched while an
    earlier one overran waited for it, so the first cannot have started before then. Without
    it, the lag of one overrun batch would carry over, unseen, to every batch planned after.
    """
    t = not_before
    for i, (start, cost) in enumerate(sorted(batches)):
        t = max(t, start) + cost
        if i == 0:
            t = max(t, now)
    return max(now, t)


def rank_free(free: float, ran_until: float, busy: bool) -> float:
    """An executor's free time as the plan ranks executors (it takes the earliest): an idle one
    ranks by when its last run ended, so that work spreads over idle executors; by its free
    time alone, the first in order would take every batch that finds them all idle."""
    return free if busy else min(free, ran_until)


def busy_until(now: float, free_at: Sequence[float], lead: float = 0.0) -> tuple[bool, float | None]:
    """For an empty queue: (blocked, when to plan again).

    Blocked when no executor could start an arrival before `lead` ahead of its
    free time (or none can take more at all): the arrival cannot change anything
    before the plan is made again then.
    """
    if not free_at:
        return True, None  # every executor holds its maximum: only a report can change that
    first = min(free_at)
    if first > now + lead:
        return True, first - lead
    return False, None
