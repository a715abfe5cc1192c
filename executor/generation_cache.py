"""The key/value cache of the sequences an executor generates: preallocated slots within a memory budget.

Each cache tensor of the graph (a past input and its present output) is one array
[slots, heads, max_context, head_dim], allocated once: a sequence holds one slot, whose positions
0..n-1 hold its first n tokens' keys or values; nothing is allocated per step or per sequence.
Two ways to run on it:
- a graph whose past is exactly the cached positions: a run's past is gathered from the slots of
  the sequences in it, up to the longest one's length (the attention mask hides the rest), and the
  new positions of its present are written back (`gather`, `write`);
- a graph that updates its cache in place (`cache_in_place`): a run binds rows first..first+n-1 of
  every array, where they lie, as both its past and its present (`rows`), and copies nothing. The
  arrays then live where the session runs: host memory, or the GPU's under the CUDA provider.
Slots are handed out lowest first, so the sequences running hold the first rows and a decode run
over rows 0..n-1 covers them with few idle rows between.
"""
from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np

from executor.generation_model import CacheTensor, slot_bytes


class CacheBudgetError(ValueError):
    """The budget holds not even one sequence's cache."""


class SlotCache:
    """`slots` sequences' caches at `max_context` positions each, as many as `budget_bytes` holds."""

    def __init__(self, tensors: list[CacheTensor], max_context: int, budget_bytes: int,
                 device: tuple[str, int] = ("cpu", 0)) -> None:
        self.slot_bytes = slot_bytes(tensors, max_context)
        self.slots = budget_bytes // self.slot_bytes
        if self.slots < 1:
            raise CacheBudgetError(
                f"a cache budget of {budget_bytes} bytes holds no sequence: one at max_context {max_context} "
                f"takes {self.slot_bytes} bytes")
        self.max_context = max_context
        self.device = device
        shapes = [(self.slots, t.heads, max_context, t.head_dim) for t in tensors]
        if device[0] == "cpu":
            self.arrays: list = [np.zeros(shape, t.dtype) for shape, t in zip(shapes, tensors)]
            pointers = [a.ctypes.data for a in self.arrays]
        else:  # device memory, only ever bound to runs in place (never gathered to the host)
            import onnxruntime as ort

            self.arrays = [ort.OrtValue.ortvalue_from_shape_and_type(shape, t.dtype, device[0], device[1])
                           for shape, t in zip(shapes, tensors)]
            pointers = [v.data_ptr() for v in self.arrays]
        # Per array: where row 0 lies, one row's bytes, its shape and type (what `rows` binds).
        self._layout = [(pointer, int(np.prod(shape[1:])) * t.dtype.itemsize, shape[1:], t.dtype)
                        for pointer, shape, t in zip(pointers, shapes, tensors)]
        self._free = list(range(self.slots))  # a heap: the lowest free slot first
        # Where a run's past is gathered, kept from run to run: a fresh array of megabytes per
        # tensor per step costs more in page faults than the copy itself (4x, measured at 32
        # sequences). It holds one run's inputs, which a fresh array would hold as long.
        self._gathered = [np.empty(0, t.dtype) for t in tensors]

    @property
    def nbytes(self) -> int:
        """Bytes of the slots (the budget's; the gathered past of one run comes on top)."""
        return self.slots * sum(row_bytes for _, row_bytes, _, _ in self._layout)  # GPU OrtValues have no nbytes

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.slots - len(self._free)

    def allocate(self) -> int | None:
        """The lowest free slot, or None when every one is held."""
        return heapq.heappop(self._free) if self._free else None

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is not held")
        heapq.heappush(self._free, slot)

    def rows(self, first: int, count: int) -> list[tuple[int, tuple[int, ...], np.dtype]]:
        """Where rows first..first+count-1 of each array lie: (address, shape, dtype), to bind in place."""
        if not (0 <= first and count >= 1 and first + count <= self.slots):
            raise ValueError(f"rows {first}..{first + count - 1} are not within the {self.slots} slots")
        return [(pointer + first * row, (count, *shape), dtype) for pointer, row, shape, dtype in self._layout]

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
