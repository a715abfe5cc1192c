"""The load view: where the scheduler's play of a queue can still change, as it travels to the gateways.

Per model and priority level the scheduler plays what is queued at that level
or higher (batchline.planning.simulation.play) and publishes the play from its
resume point: when each executor is free there, and the requests from there
on. A gateway resumes the same play with the requests it admitted since the
view was taken and the new one: what it predicts is what the scheduler's rule
will do with them, not an approximation of it.
"""
from __future__ import annotations

from typing import Sequence

from batchline.planning.cost import Cost
from batchline.planning.rule import BatchingRule
from batchline.planning.simulation import Pending, Played, play
from batchline.protocol import internal_pb2 as pb

# A queued request, as a view carries it: it is queued already, so any batch may take it.
_QUEUED = float("-inf")


def queue_tail(level: int, queue: Sequence[Pending], free: Sequence[float], rule: BatchingRule,
               cost: Cost) -> pb.QueueTail:
    """The view of priority `level`: `queue` holds what is queued at that level or higher, in
    service order; `free` when each executor holding the model is free (none: the view says so)."""
    if not free:
        return pb.QueueTail(level=level)
    played = play(queue, free, rule, cost)
    return pb.QueueTail(
        level=level, free_s=played.resume_free,
        items=[pb.QueueTail.Item(rows=p.rows, length=p.length, deadline_s=p.deadline, priority=p.priority)
               for p in played.resume_queue],
    )


def queue_tails(queue: Sequence[Pending], free: Sequence[float], rule: BatchingRule,
                cost: Cost) -> list[pb.QueueTail]:
    """A model's views: level 1 and each lower level with requests queued (a level without any has
    the play of the level above). `queue` in service order, priority-major."""
    levels = sorted({1, *(p.priority for p in queue)})
    return [queue_tail(level, [p for p in queue if p.priority <= level], free, rule, cost) for level in levels]


def resume(tail: pb.QueueTail, since: Sequence[Pending], arrival: Pending, rule: BatchingRule,
           cost: Cost) -> Played:
    """The play of `tail` with `since` queued behind what it holds and then `arrival` (`queued`
    False), which arrives at its `enqueued` and joins no batch leaving less than the rule's
    `join_lead` later.

    `since` are queued already but not in the view: the scheduler has not planned them, and
    starts no batch they lead before the arrival.
    """
    queue = _queued(tail)
    return play([*queue, *since, arrival], tail.free_s, rule, cost, unplanned_from=len(queue), now=arrival.enqueued)


# The requests of the views last resumed, by the view: a gateway resumes one view for every
# request until it reads the next, and converting its requests each time would cost more than
# playing them.
_converted: dict[int, tuple[pb.QueueTail, list[Pending]]] = {}
_CONVERTED_KEEP = 64


def _queued(tail: pb.QueueTail) -> list[Pending]:
    held = _converted.get(id(tail))
    if held is not None and held[0] is tail:
        return held[1]
    if len(_converted) >= _CONVERTED_KEEP:
        _converted.clear()
    queue = [Pending("", i.rows, i.priority, i.deadline_s, _QUEUED, length=i.length or 1) for i in tail.items]
    _converted[id(tail)] = (tail, queue)
    return queue
