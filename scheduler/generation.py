"""Where a generative model's queued requests go: each alone, to the executor with the most free cache.

A generative model's requests are sequences that join an executor's running batch at its next
step (docs/design/generation.md#through-the-mesh), so nothing is gained by waiting for company
or by predicting when an executor is free: a request goes as soon as an executor has a free
cache slot, which is its generation slots less the sequences sent to it and not yet answered
(its in-flight batches of the model). Best priority and earliest deadline go first, as the
queue is ordered.
"""
from __future__ import annotations

from batchline.planning import Pending


def place(queue: list[Pending], free: dict[str, int]) -> list[tuple[str, Pending]]:
    """(executor id, request) for each request of `queue` (in order) that an executor has a slot for."""
    free = {e: n for e, n in free.items() if n > 0}
    placed = []
    for p in queue:
        if not free:
            break
        # The most free slots first; ties by id, so that placement is repeatable.
        executor = min(free, key=lambda e: (-free[e], e))
        placed.append((executor, p))
        free[executor] -= 1
        if not free[executor]:
            del free[executor]
    return placed


def slots(models: list, key: tuple[str, str]) -> int:
    """An executor's generation slots for the model `key` (its ModelInfo among `models`; 0: none)."""
    return next((m.generation_slots for m in models if (m.name, m.version) == key), 0)
