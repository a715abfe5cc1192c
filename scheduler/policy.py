"""The batching decision: pure, synchronous, with time passed in.

Given a model's queue (already in priority-major, earliest-deadline-first
order), how many executor slots are free, and a prediction of execution time
per batch size, `plan()` says which batches to send now and why, which
requests are already past their deadline, and when to look again. It does no
I/O and reads no clock, so every rule is tested with an explicit clock.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

# Why a batch went out; also the label of the dispatch-reason metric.
FULL = "full"            # no more rows fit (max_batch_size reached)
PREFERRED = "preferred"  # everything queued was taken and it is a preferred size
DEADLINE = "deadline"    # waiting longer would make the earliest deadline miss
DELAY = "delay"          # the oldest member waited max_queue_delay


@dataclass(frozen=True)
class Pending:
    request_id: str
    rows: int
    priority: int
    deadline: float      # seconds, same clock as `now`
    enqueued: float      # seconds, same clock as `now`
    member: bytes = b""  # opaque to the policy: the queue member to move


@dataclass(frozen=True)
class ModelPolicy:
    max_batch_size: int              # rows per batch; 0 = the model has no batch dim (one request per batch)
    max_queue_delay: float           # seconds the oldest request may wait for company
    preferred_batch_sizes: tuple[int, ...] = ()
    # Time a batch spends outside the model (Redis round trips, decode,
    # encode), added to the predicted execution when judging slack.
    overhead: float = 0.002


@dataclass(frozen=True)
class PlannedBatch:
    members: tuple[Pending, ...]
    rows: int
    reason: str
    # Least slack among members at dispatch: deadline - now - predicted run.
    slack: float


@dataclass
class Plan:
    batches: list[PlannedBatch] = field(default_factory=list)
    expired: list[Pending] = field(default_factory=list)
    wake_at: float | None = None  # None: nothing to do until something new happens

    def _wake(self, t: float) -> None:
        if self.wake_at is None or t < self.wake_at:
            self.wake_at = t


def plan(
    now: float,
    queue: Sequence[Pending],
    policy: ModelPolicy,
    free_slots: int,
    predict: Callable[[int], float],
) -> Plan:
    """Decide what to do with one model's queue at time `now`."""
    out = Plan()
    live: list[Pending] = []
    for p in queue:
        if p.deadline <= now:
            out.expired.append(p)
        else:
            live.append(p)

    cap = policy.max_batch_size if policy.max_batch_size > 0 else None
    while live and free_slots > 0:
        members, rows = _take(live, cap)
        cost = predict(rows) + policy.overhead
        earliest = min(m.deadline for m in members)
        oldest = min(m.enqueued for m in members)
        send_by = earliest - cost           # latest dispatch that still meets the earliest deadline
        delay_due = oldest + policy.max_queue_delay
        everything_taken = len(members) == len(live)

        if cap is None or rows >= cap or not everything_taken:
            reason = FULL
        elif rows in policy.preferred_batch_sizes:
            reason = PREFERRED
        elif now >= send_by:
            reason = DEADLINE
        elif now >= delay_due:
            reason = DELAY
        else:
            out._wake(min(send_by, delay_due))
            break
        out.batches.append(PlannedBatch(tuple(members), rows, reason, earliest - now - cost))
        del live[: len(members)]
        free_slots -= 1

    # Whatever waits (for a free executor, or for company) must still be shed
    # the moment its deadline passes.
    if live:
        out._wake(min(p.deadline for p in live))
    return out


def _take(live: Sequence[Pending], cap: int | None) -> tuple[list[Pending], int]:
    """The head of the queue, in order, up to `cap` rows (one request when no batch dim)."""
    if cap is None:
        return [live[0]], live[0].rows
    members: list[Pending] = []
    rows = 0
    for p in live:
        if members and rows + p.rows > cap:
            break
        members.append(p)
        rows += p.rows
    return members, rows
