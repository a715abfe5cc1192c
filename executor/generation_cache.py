"""The key/value cache of the sequences an executor generates: preallocated slots within a memory budget.

Each cache tensor of the graph (a past input and its present output) is one array
[slots, heads, max_context, head_dim], allocated once: a sequence holds one slot, whose positions
0..n-1 hold its first n tokens' keys or values. A run's past is gathered from the slots of the
sequences in it, up to the longest one's length (the attention mask hides the rest), and the new
positions of its present are written back; nothing is allocated per step or per sequence.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from executor.generation_model import CacheTensor, slot_bytes


class CacheBudgetError(ValueError):
    """The budget holds not even one sequence's cache."""


class SlotCache:
    """`slots` sequences' caches at `max_context` positions each, as many as `budget_bytes` holds."""

    def __init__(self, tensors: list[CacheTensor], max_context: int, budget_bytes: int) -> None:
        self.slot_bytes = slot_bytes(tensors, max_context)
        self.slots = budget_bytes // self.slot_bytes
        if self.slots < 1:
            raise CacheBudgetError(
                f"a cache budget of {budget_bytes} bytes holds no sequence: one at max_context {max_context} "
                f"takes {self.slot_bytes} bytes")
        self.max_context = max_context
        self.arrays = [np.zeros((self.slots, t.heads, max_context, t.head_dim), t.dtype) for t in tensors]
        self._free = list(range(self.slots - 1, -1, -1))
        # Where a run's past is gathered, kept from run to run: a fresh array of megabytes per
        # tensor per step costs more in page faults than the copy itself (4x, measured at 32
        # sequences). It holds one run's inputs, which a fresh array would hold as long.
        self._gathered = [np.empty(0, t.dtype) for t in tensors]

    @property
    def nbytes(self) -> int:
        """Bytes of the slots (the budget's; the gathered past of one run comes on top)."""
        return sum(a.nbytes for a in self.arrays)

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.slots - len(self._free)

    def allocate(self) -> int | None:
        """A free slot, or None when every one is held."""
        return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is not held")
        self._free.append(slot)

    def gather(self, slots: Sequence[int], length: int) -> list[np.ndarray]:
        """The first `length` positions of `slots`, one [len(slots), heads, length, head_dim] array per tensor."""
        out = []
        for i, array in enumerate(self.arrays):
            shape = (len(slots), array.shape[1], length, array.shape[3])
            size = int(np.prod(shape))
            if self._gathered[i].size < size:
                self._gathered[i] = np.empty(size, array.dtype)
            past = self._gathered[i][:size].reshape(shape)
            for row, slot in enumerate(slots):
                past[row] = array[slot, :, :length]
            out.append(past)
        return out

    def write(self, slots: Sequence[int], starts: Sequence[int], presents: Sequence[np.ndarray], count: int) -> None:
        """Store the last `count` positions of each present ([batch, heads, positions, head_dim], row b for
        slots[b]) at positions starts[b] onwards of its slot."""
        if count == 1 and len(slots) > 1:
            index, at = np.asarray(slots), np.asarray(starts)
            for array, present in zip(self.arrays, presents):
                array[index, :, at] = present[:, :, -1]
            return
        for b, (slot, start) in enumerate(zip(slots, starts)):
            for array, present in zip(self.arrays, presents):
                array[slot, :, start:start + count] = present[b, :, present.shape[2] - count:]
