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
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

# Why a batch went out; also the label of the dispatch-reason metric.
FULL = "full"            # no more rows fit (max_batch_size reached)
PREFERRED = "preferred"  # a preferred size: all that is queued, or the largest the queue's head makes
DEADLINE = "deadline"    # waiting longer would make the earliest deadline miss
DELAY = "delay"          # the oldest member waited max_queue_delay
NO_COMPANY = "no_company"  # nothing more is expected to arrive before the delay is up

DEADLINE_AWARE = "deadline"
FIFO = "fifo"
POLICIES = (DEADLINE_AWARE, FIFO)


@dataclass(frozen=True)
class Pending:
    request_id: str
    rows: int
    priority: int
    deadline: float      # seconds, same clock as `now`
    enqueued: float      # seconds, same clock as `now`
    member: bytes = b""  # opaque to the policy: the queue member to move
    length: int = 1      # elements per row at the model's variable dims (batchline.sizing)

    @property
    def units(self) -> int:
        return self.rows * self.length


def units(members: Iterable[Pending]) -> int:
    """A batch's size for the profile: its rows, padded to its longest member."""
    rows = longest = 0
    for m in members:
        rows += m.rows
        longest = max(longest, m.length)
    return rows * longest


@dataclass(frozen=True)
class ModelPolicy:
    max_batch_size: int              # rows per batch; 0 = the model has no batch dim (one request per batch)
    max_queue_delay: float           # seconds the oldest request may wait for company
    preferred_batch_sizes: tuple[int, ...] = ()
    # Time a batch spends outside the model (Redis round trips, decode,
    # encode), added to the predicted execution when judging slack.
    overhead: float = 0.002
    kind: str = DEADLINE_AWARE


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
    predict: Callable[[int], float],
    expected: Callable[[int], float] | None = None,
    lead: float = 0.0,
    company: float | None = None,
) -> Plan:
    """Decide what to do with one model's queue at time `now`.

    `free_at[i]` is when executor i can start another batch (<= now: idle).
    `predict(units)` errs late (it carries a margin) and times dispatch;
    `expected(units)` is the central estimate used to decide that a request is
    hopeless (default: `predict`). `company` is the arrivals per second seen
    while as many requests as `queue` holds waited (scheduler.company); a batch
    that could wait for more waits only while at least one is expected before
    its wait is up. None: not known, it waits the whole max_queue_delay, as
    Triton does (the FIFO policy always does).
    """
    expected = expected or predict
    aware = policy.kind != FIFO
    out = Plan()
    free = list(free_at)
    first_start = max(now, min(free)) if free else None
    live: list[Pending] = []
    for p in queue:
        if p.deadline <= now:
            out.expired.append(p)
        elif aware and first_start is not None and first_start + expected(p.units) + policy.overhead > p.deadline:
            # It cannot finish in time even alone on the first free executor.
            out.expired.append(p)
        else:
            live.append(p)
    if not aware:
        live.sort(key=lambda p: (p.priority, p.enqueued))

    cap = policy.max_batch_size if policy.max_batch_size > 0 else None
    while live and free:
        i = min(range(len(free)), key=free.__getitem__)
        start = max(now, free[i])
        if start > now + lead:
            out._wake(start - lead)  # no executor is ready: let the queue grow
            out.blocked = True
            break
        members, rows = _take(live, cap)
        preferred = False
        if policy.preferred_batch_sizes and rows not in policy.preferred_batch_sizes and (cap is None or rows < cap):
            # Triton's rule: more is queued than a preferred size but not a full batch, so send the
            # largest preferred size the queue's head makes exactly; the rest waits for company.
            cut = _preferred_prefix(members, policy.preferred_batch_sizes)
            if cut:
                members, rows, preferred = members[:cut], sum(m.rows for m in members[:cut]), True
        shrunk = False
        if aware and start + predict(units(members)) + policy.overhead > min(m.deadline for m in members):
            # Someone would finish late. Send the batch size that gets the most
            # members done in time; a member late even on a typical run of it
            # cannot make any later batch either, so it is shed now.
            taken = len(members)
            members, late = _most_on_time(members, start, policy.overhead, predict, expected)
            for m in late:
                out.expired.append(m)
                live.remove(m)
            if not members:
                continue
            rows = sum(m.rows for m in members)
            shrunk = len(members) < taken
        cost = predict(units(members)) + policy.overhead
        earliest = min(m.deadline for m in members)
        oldest = min(m.enqueued for m in members)
        send_by = earliest - cost - (start - now)  # latest dispatch that still meets the earliest deadline
        delay_due = oldest + policy.max_queue_delay
        everything_taken = len(members) == len(live)

        if shrunk:
            reason = DEADLINE
        elif preferred:
            reason = PREFERRED
        elif cap is None or rows >= cap or not everything_taken:
            reason = FULL
        elif rows in policy.preferred_batch_sizes:
            reason = PREFERRED
        elif aware and now >= send_by:
            reason = DEADLINE
        elif now >= delay_due:
            reason = DELAY
        elif now >= (worth := _worth_waiting_until(min(send_by, delay_due), company) if aware else delay_due):
            reason = NO_COMPANY
        else:
            out._wake(worth)
            break
        finish = start + cost
        out.batches.append(PlannedBatch(tuple(members), rows, reason, earliest - finish, i, start, finish))
        free[i] = finish
        del live[: len(members)]

    # Whatever waits (for a free executor, or for company) must still be shed
    # the moment its deadline passes.
    if live:
        out._wake(min(p.deadline for p in live))
        out.blocked = out.blocked or not free
    else:
        out.blocked, ready_at = busy_until(now, free, lead)
        if ready_at is not None:
            out._wake(ready_at)
    return out


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


def _preferred_prefix(members: Sequence[Pending], preferred: Sequence[int]) -> int:
    """How many of `members` make up the largest preferred size exactly (0: none does)."""
    sizes = {}
    rows = 0
    for n, m in enumerate(members, 1):
        rows += m.rows
        sizes[rows] = n
    return max(((p, sizes[p]) for p in preferred if p in sizes), default=(0, 0))[1]


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


def _most_on_time(
    members: list[Pending], start: float, overhead: float,
    predict: Callable[[int], float], expected: Callable[[int], float],
) -> tuple[list[Pending], list[Pending]]:
    """The head of `members` that finishes the most of them by their deadlines (the shortest such),
    split into those to send and those already hopeless in it."""
    best_n, best_on_time, rows, longest = 1, -1, 0, 0
    for n, m in enumerate(members, 1):
        rows += m.rows
        longest = max(longest, m.length)
        finish = start + predict(rows * longest) + overhead
        on_time = sum(1 for x in members[:n] if x.deadline >= finish)
        if on_time > best_on_time:
            best_n, best_on_time = n, on_time
    chosen = members[:best_n]
    finish = start + expected(units(chosen)) + overhead
    return [m for m in chosen if m.deadline >= finish], [m for m in chosen if m.deadline < finish]


@dataclass(frozen=True)
class Tail:
    """Where the plan for a queue ends: its last batch, and when each executor is free after it."""
    rows: int = 0            # rows in the last batch (0: nothing queued)
    limit: int = 0           # rows that batch could hold and still meet its earliest deadline
    start: float = 0.0       # when it starts
    executor: int = 0        # index into `free`
    free: tuple[float, ...] = ()
    length: int = 1          # its longest member's length


def queue_tail(
    now: float, queue: Sequence[Pending], max_batch_size: int, free_at: Sequence[float], cost: Callable[[int], float],
    preferred_batch_sizes: Sequence[int] = (), typical: Callable[[int], float] | None = None,
) -> Tail:
    """Play the queue forward as `plan` would serve it, batch after batch, and say where it ends.

    `queue` is in service order, `free_at[i]` when executor i can start
    (finite: work already dispatched included), `cost(units)` a batch's
    predicted service time including overheads (called once per member or
    two: keep it cheap). Each batch takes the head of
    what is left, up to `max_batch_size` rows, cut to the longest prefix that
    meets its earliest deadline and, like `plan`, to the largest preferred
    size the head makes when it is short of full; a head that cannot make it
    even alone on a typical run (`typical(units)`, without the margin; default
    `cost`), as `plan` judges it, would be shed and takes no executor time. Admission control
    adds a new request's rows to the end of this plan (gateway/admission.py).
    """
    cap = max_batch_size if max_batch_size > 0 else None
    typical = typical or cost
    free = [max(now, f) for f in free_at] or [now]
    last: tuple[int, float, int, float, int] | None = None  # rows, start, executor, earliest deadline, length
    i = 0
    while i < len(queue):
        e = min(range(len(free)), key=free.__getitem__)
        start = free[e]
        earliest = float("inf")
        j = rows = longest = 0
        for j in range(i, len(queue)):
            m = queue[j]
            if j > i and (cap is None or rows + m.rows > cap):
                break
            d = min(earliest, m.deadline)
            wider = max(longest, m.length)
            if start + cost((rows + m.rows) * wider) > d and (j > i or start + typical(m.rows * m.length) > d):
                break
            earliest, rows, longest = d, rows + m.rows, wider
        else:
            j = len(queue)
        if not rows:
            i += 1  # hopeless even alone: shed, not served
            continue
        if preferred_batch_sizes and rows not in preferred_batch_sizes and (cap is None or rows < cap):
            cut = _preferred_prefix(queue[i:j], preferred_batch_sizes)
            if cut:
                j = i + cut
                rows = sum(m.rows for m in queue[i:j])
                longest = max(m.length for m in queue[i:j])
        free[e] = start + cost(rows * longest)
        last = (rows, start, e, earliest, longest)
        i = j
    if last is None:
        return Tail(free=tuple(free))
    rows, start, e, earliest, longest = last
    limit = rows
    while cap is not None and limit < cap and start + cost((limit + 1) * longest) <= earliest:
        limit += 1
    return Tail(rows=rows, limit=limit, start=start, executor=e, free=tuple(free), length=longest)
