"""How a model's queue is served, batch after batch: one rule, and one simulation of it.

The rule (`form_batch`): a batch that starts at a given moment takes
1. the head of the queue, in order, up to max_batch_size rows (one request
   when the model has no batch dim); length-aware (requests of different
   lengths, padded to the longest), the head and the requests behind it whose
   lengths are close to one another (`_by_length`), so that little of the
   batch is padding;
2. when that is short of full and of every preferred size, the largest
   preferred size its head makes exactly (Triton's rule): the rest waits;
3. when one of its members would finish past its deadline, the prefix that
   gets the most of them done in time (the shortest such); a member late even
   on a typical run of it is shed, since no later batch can make it either.

With `even_lanes`, step 1 takes no more rows than its even share
(`_even_share`): the fewest such that the model's other lanes, each starting
when it is free, can take the rest of what is queued and finish no later than
this batch does. A lane that frees up does not take everything queued while
another is about to free up too: the rows are spread over the lanes, so the
requests in one batch do not wait for a run of twice its neighbour's.

`play` serves a whole queue by that rule, each batch on the executor free
first. It has three callers, so that they cannot drift apart:
- the scheduler's plan (scheduler.policy.plan) forms every batch it sends now
  with `form_batch`;
- the scheduler's load view plays what is left queued and publishes the play
  from its resume point: the first batch whose head reached the end of the
  queue, the first that a later arrival could change (batchline.planning.view);
- a gateway's admission control resumes the play there with the requests it
  admitted since and the new one (gateway/admission.py), and so predicts
  what the scheduler will do with them.

Pure: time is passed in, nothing is read from a clock.
"""
from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass
from typing import Iterable, Sequence

from batchline.contract.keys import OVER_SHARE
from batchline.planning.cost import Cost
from batchline.planning.rule import BatchingRule

# The scheduling policies (SchedulerSettings.policy), as load views name them.
DEADLINE_AWARE = "deadline"  # batches cut and requests shed by deadline; admission control on
FIFO = "fifo"                # Triton-style max-delay batching, kept as the baseline
POLICIES = (DEADLINE_AWARE, FIFO)


@dataclass(frozen=True)
class Pending:
    """A queued request, as planning sees it."""
    request_id: str
    rows: int
    priority: int
    deadline: float      # seconds, same clock as the plan's
    enqueued: float      # seconds, same clock; a batch cannot take a request before it is queued
    member: bytes = b""  # opaque to planning: the queue member to move
    length: int = 1      # elements per row at the model's variable dims (batchline.sizing)
    # False: arriving, not in Redis yet. It cannot join a batch that leaves less than the rule's
    # join_lead (BatchingRule) after it arrives (at `enqueued`), unless it would be alone in it.
    queued: bool = True

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


@dataclass(slots=True)
class Formed:
    """The batch `form_batch` makes of a queue's head."""
    send: list[Pending]   # to run
    late: list[Pending]   # to shed: late even on a typical run of this batch
    window: int           # requests of the head it looked at: a batch that looked at the queue's end
                          # changes when more arrive
    preferred: bool       # cut to a preferred size
    shrunk: bool          # cut so that its members make their deadlines
    units: int            # what those sent cost, in the profile's units (batchline.sizing)
    evened: bool = False  # cut to its even share: the rest of what is queued is the other lanes'

    @property
    def taken(self) -> int:
        """Requests of the head it uses up, run or shed: the next batch starts after them."""
        return len(self.send) + len(self.late)


def form_batch(queue: Sequence[Pending], start: float, rule: BatchingRule, cost: Cost, at: int = 0,
               others: Sequence[float] = ()) -> Formed:
    """The batch that starts at `start` with `queue[at]` (the rule in the module's docstring), by
    the model's settings in `rule`.

    max_batch_size 0: the model has no batch dim, a batch is one request. A batch takes no request
    queued after it starts, nor one still arriving (`queued` False) less than the rule's
    `join_lead` before. Without `deadline_aware` (the FIFO policy) deadlines cut nothing.
    `over_share_rows` (0: none) caps a batch whose head is queued at an over-share level
    (batchline.contract.OVER_SHARE). With `length_aware`, the members need not be the head's
    prefix (`_by_length`). With `even_lanes`, `others` (when each of the model's other lanes is
    free) caps it at its even share (`_even_share`).
    """
    cap = rule.max_batch_size if rule.max_batch_size > 0 else None
    if cap is not None and rule.over_share_rows and queue[at].priority > OVER_SHARE:
        cap = min(cap, rule.over_share_rows)
    looked, to_share = 0, False
    if rule.even_lanes and others and cap is not None and cap > 1:
        share, looked = _even_share(queue, at, cap, start, rule.join_lead, others, cost)
        to_share, cap = share < cap, min(cap, share)
    if rule.length_aware and cap is not None:
        window, members = _by_length(queue, at, cap, start, rule.join_lead, cost)
        rows, longest, earliest = _measure(members)
    else:
        window, rows, longest, earliest = _take(queue, at, cap, start, rule.join_lead)
        members = window
    preferred = False
    preferred_sizes = rule.preferred_batch_sizes
    if preferred_sizes and rows not in preferred_sizes and (cap is None or rows < cap):
        cut = _preferred_prefix(members, preferred_sizes)
        if cut:
            members, preferred = members[:cut], True
            rows, longest, earliest = _measure(members)
    looked = max(looked, len(window))
    evened = to_share and cap is not None and rows >= cap
    if rule.deadline_aware and start + cost.predict(rows * longest) > earliest:
        send, late = _most_on_time(members, start, cost)
        return Formed(send, late, looked, preferred, len(send) < len(members), units(send), evened)
    return Formed(members, [], looked, preferred, False, rows * longest, evened)


def _even_share(queue: Sequence[Pending], at: int, cap: int, start: float, join_lead: float,
                others: Sequence[float], cost: Cost) -> tuple[int, int]:
    """(the most rows the batch starting at `start` takes, the requests it looked at): the fewest
    rows k such that the other lanes, each starting when it is free (`others`, at `start` at the
    earliest) and taking at most `cap` rows, can take the rest of the rows queued by `start` and
    finish by the time this batch of k does; `cap` when they cannot take any.

    That split finishes all of them soonest: a lane running k + 1 rows finishes them later, one
    running k - 1 leaves the others rows they finish later still. It looks at the queue's head up
    to a full batch for every lane; rows past that wait for a later batch whatever the split.
    Batch sizes are counted padded to the longest request looked at, and the cost taken as rising
    with rows."""
    lanes = 1 + len(others)
    rows = longest = looked = 0
    for k in range(at, len(queue)):
        p = queue[k]
        if looked and p.enqueued + (0.0 if p.queued else join_lead) > start:
            break
        rows += p.rows
        longest = max(longest, p.length)
        looked += 1
        if rows >= lanes * cap:
            break
    most = min(cap, rows)
    if most <= 1:
        return cap, looked
    starts = [max(start, f) for f in others]
    runs: dict[int, float] = {}  # rows -> predicted run: the searches below ask for a few sizes, often again

    def run(r: int) -> float:
        t = runs.get(r)
        if t is None:
            t = runs[r] = cost.predict(r * longest)
        return t

    alone = start + run(most)
    if all(s >= alone for s in starts):
        return cap, looked  # none of the others frees up before this batch of everything is done

    def taken_by_others(k: int) -> int:
        """Rows the other lanes can run finishing by a batch of k here: the most each can, up to k
        (the others start no sooner than this one, at the same cost)."""
        by = start + run(k)
        total = 0
        for s in starts:
            low, high = 0, k  # s + run(low) <= by holds for low 0 (no run); find the largest
            while low < high:
                mid = (low + high + 1) // 2
                if s + run(mid) <= by:
                    low = mid
                else:
                    high = mid - 1
            total += low
        return total

    # The fewest k whose finish leaves the others time for rows - k: `most` always does, and none
    # below an equal split can (the others take at most k each).
    low, high = min(most, -(-rows // lanes)), most
    while low < high:
        mid = (low + high) // 2
        if taken_by_others(mid) >= rows - mid:
            high = mid
        else:
            low = mid + 1
    return (cap if low == most else low), looked


def _take(queue: Sequence[Pending], at: int, cap: int | None, start: float,
          join_lead: float) -> tuple[list[Pending], int, int, float]:
    """The head of the queue from `at`, in order, up to `cap` rows (one request when no batch dim),
    with its rows, longest length and earliest deadline."""
    if cap is None:
        p = queue[at]
        return [p], p.rows, p.length, p.deadline
    members: list[Pending] = []
    rows = longest = 0
    earliest = float("inf")
    for k in range(at, len(queue)):
        p = queue[k]
        if members and (rows + p.rows > cap or p.enqueued + (0.0 if p.queued else join_lead) > start):
            break
        members.append(p)
        rows += p.rows
        if p.length > longest:
            longest = p.length
        if p.deadline < earliest:
            earliest = p.deadline
    return members, rows, longest, earliest


# A length-aware batch takes requests at least 1/LENGTH_BAND of its padded length: none of them
# runs padded to more than that many times its own length.
LENGTH_BAND = 2.0
# It looks this many full batches past its head for members of similar length.
LOOKAHEAD_BATCHES = 4
# At most this many padded lengths are weighed for one batch (evenly spread over those possible).
_LENGTHS_TRIED = 8


def _by_length(queue: Sequence[Pending], at: int, cap: int, start: float,
               join_lead: float, cost: Cost) -> tuple[list[Pending], list[Pending]]:
    """(the requests looked at, the batch's members in queue order): the head, and of the requests
    behind it those of lengths within the band of the padded length that runs the most tokens a
    second, up to `cap` rows. A request left out that could not wait for one more batch of its
    own length after this one goes in anyway: deadlines come first. The plain prefix is weighed
    too, so a batch is never predicted slower per token than the prefix's."""
    window: list[Pending] = []
    rows = 0
    for k in range(at, len(queue)):
        p = queue[k]
        if window and p.enqueued + (0.0 if p.queued else join_lead) > start:
            break
        window.append(p)
        rows += p.rows
        if rows >= LOOKAHEAD_BATCHES * cap:
            break
    head = window[0]
    prefix = _prefix(window, cap)
    if all(p.length == head.length for p in window):
        # All it looked at counts: a request of another length arriving within its reach would change it.
        return window, prefix
    lengths = sorted({p.length for p in window if head.length <= p.length <= head.length * LENGTH_BAND})
    if len(lengths) > _LENGTHS_TRIED:
        lengths = [lengths[round(i * (len(lengths) - 1) / (_LENGTHS_TRIED - 1))] for i in range(_LENGTHS_TRIED)]
    best, best_rate = prefix, _tokens_per_s(prefix, cost)
    full = {n: cost.predict(cap * n) for n in {p.length for p in window}}  # a full batch of each length
    for padded in lengths:
        # A request out of the band goes in anyway if it could not wait for this batch (taken as
        # full at this length) and then one of its own length.
        after = start + full[padded]
        low = padded / LENGTH_BAND
        members, r = [head], head.rows
        for p in window[1:]:
            if r + p.rows <= cap and (low <= p.length <= padded or p.deadline < after + full[p.length]):
                members.append(p)
                r += p.rows
                if r == cap:
                    break
        rate = _tokens_per_s(members, cost)
        if rate > best_rate:
            best, best_rate = members, rate
    return window, best


def _prefix(window: Sequence[Pending], cap: int) -> list[Pending]:
    members: list[Pending] = []
    rows = 0
    for p in window:
        if members and rows + p.rows > cap:
            break
        members.append(p)
        rows += p.rows
    return members


def _tokens_per_s(members: Sequence[Pending], cost: Cost) -> float:
    return sum(m.units for m in members) / max(cost.predict(units(members)), 1e-12)


def _measure(members: Sequence[Pending]) -> tuple[int, int, float]:
    return sum(m.rows for m in members), max(m.length for m in members), min(m.deadline for m in members)


def _preferred_prefix(members: Sequence[Pending], preferred: Sequence[int]) -> int:
    """How many of `members` make up the largest preferred size exactly (0: none does)."""
    sizes = {}
    rows = 0
    for n, m in enumerate(members, 1):
        rows += m.rows
        sizes[rows] = n
    return max(((p, sizes[p]) for p in preferred if p in sizes), default=(0, 0))[1]


def _most_on_time(members: list[Pending], start: float, cost: Cost) -> tuple[list[Pending], list[Pending]]:
    """The head of `members` that finishes the most of them by their deadlines (the shortest such),
    split into those to send and those already hopeless in it; but never one that makes a request
    late that could be in time, for requests of a lower priority: those wait for the next batch.
    (A member is judged savable in the shortest batch that holds it, it and those ahead of it.)"""
    best_n, best_on_time, rows, longest = 1, -1, 0, 0
    deadlines: list[float] = []
    savable: dict[int, float] = {}  # per priority level, the earliest deadline of its savable members
    for n, m in enumerate(members, 1):
        rows += m.rows
        longest = max(longest, m.length)
        finish = start + cost.predict(rows * longest)
        if any(level < m.priority and deadline < finish for level, deadline in savable.items()):
            break  # a request of a better priority, in time without this one, would be late with it
        if m.deadline >= finish:
            savable[m.priority] = min(savable.get(m.priority, m.deadline), m.deadline)
        insort(deadlines, m.deadline)
        on_time = n - bisect_left(deadlines, finish)
        if on_time > best_on_time:
            best_n, best_on_time = n, on_time
    chosen = members[:best_n]
    finish = start + cost.typical(units(chosen))
    return [m for m in chosen if m.deadline >= finish], [m for m in chosen if m.deadline < finish]


@dataclass(slots=True)
class SimulatedBatch:
    members: tuple[Pending, ...]
    executor: int   # index into the `free` given to play()
    start: float
    finish: float

    @property
    def rows(self) -> int:
        return sum(m.rows for m in self.members)


@dataclass(slots=True)
class Played:
    """A queue served to its end."""
    batches: list[SimulatedBatch]
    shed: list[Pending]
    free: tuple[float, ...]         # when each executor is free after it all
    # The resume point: the first batch that looked at the end of the queue. Requests that
    # arrive later can change it and what follows it, nothing before it.
    resume_queue: tuple[Pending, ...]  # what is left queued there, in service order (empty: nothing)
    resume_free: tuple[float, ...]     # when each executor is free there

    def finish_of(self, request: Pending) -> float | None:
        """When `request` is predicted answered (None: shed)."""
        for b in reversed(self.batches):
            if any(m is request for m in b.members):
                return b.finish
        return None


def play(
    queue: Sequence[Pending], free: Sequence[float], rule: BatchingRule, cost: Cost,
    unplanned_from: int | None = None, now: float = float("-inf"),
) -> Played:
    """Serve `queue` (in service order) by `form_batch` with `rule`, each batch on the executor free first.

    `free[i]`: when executor i can start its next batch (at least one executor). A batch starts
    then, or once its first request is queued if that is later. Requests from index
    `unplanned_from` on are ones the scheduler has not planned yet: no batch they lead starts
    before `now`.
    """
    free = list(free)
    batches: list[SimulatedBatch] = []
    shed: list[Pending] = []
    resume: tuple[tuple[Pending, ...], tuple[float, ...]] | None = None
    unplanned = {id(p) for p in queue[unplanned_from:]} if unplanned_from is not None else set()
    rest, i = list(queue), 0
    while i < len(rest):
        e = 0 if len(free) == 1 else min(range(len(free)), key=free.__getitem__)
        start = max(free[e], rest[i].enqueued)
        if id(rest[i]) in unplanned and start < now:
            start = now
        formed = form_batch(rest, start, rule, cost, i, free[:e] + free[e + 1:] if rule.even_lanes else ())
        if resume is None and i + formed.window >= len(rest):
            resume = (tuple(rest[i:]), tuple(free))
        shed.extend(formed.late)
        if formed.send:
            finish = start + cost.predict(formed.units)
            batches.append(SimulatedBatch(tuple(formed.send), e, start, finish))
            free[e] = finish
        if not rule.length_aware or _is_prefix(rest, i, formed):
            i += formed.taken
        else:
            gone = {id(p) for p in formed.send} | {id(p) for p in formed.late}
            rest, i = [p for p in rest[i:] if id(p) not in gone], 0
    resume_queue, resume_free = resume or ((), tuple(free))
    return Played(batches, shed, tuple(free), resume_queue, resume_free)


def _is_prefix(rest: Sequence[Pending], at: int, formed: Formed) -> bool:
    """Whether the batch (with what it shed) is the requests of `rest` from `at` on, in order: then
    the play moves past them without rebuilding what is left."""
    n = len(formed.send) + len(formed.late)
    return n <= len(rest) - at and {id(p) for p in rest[at:at + n]} == {id(p) for p in formed.send + formed.late}
