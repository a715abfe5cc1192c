"""The decoder's slot cache: slots handed out lowest first, and rows bound in place where they lie."""
from __future__ import annotations

import numpy as np
import pytest

from executor.generation_cache import CacheBudgetError, SlotCache
from executor.generation_model import CacheTensor

TENSORS = [CacheTensor("past.0.key", "present.0.key", 2, 4, np.dtype(np.float32)),
           CacheTensor("past.0.value", "present.0.value", 2, 4, np.dtype(np.float16))]
CONTEXT = 8
SLOT = 2 * 4 * CONTEXT * (4 + 2)  # bytes of one sequence's key (float32) and value (float16)


def test_slots_are_handed_out_lowest_first_so_the_running_hold_the_first_rows():
    cache = SlotCache(TENSORS, CONTEXT, 4 * SLOT)
    assert cache.slot_bytes == SLOT and cache.slots == 4
    assert [cache.allocate() for _ in range(3)] == [0, 1, 2]
    cache.release(1)
    cache.release(0)
    assert cache.allocate() == 0 and cache.allocate() == 1 and cache.allocate() == 3
    assert cache.allocate() is None and cache.free == 0
    with pytest.raises(ValueError, match="slot 9 is not held"):
        cache.release(9)


def test_rows_are_the_slot_arrays_own_memory():
    cache = SlotCache(TENSORS, CONTEXT, 3 * SLOT)
    (key_at, key_shape, key_type), (value_at, value_shape, value_type) = cache.rows(1, 2)
    assert key_shape == value_shape == (2, 2, CONTEXT, 4)
    assert (key_type, value_type) == (np.dtype(np.float32), np.dtype(np.float16))
    # Row 1 of each array, where ONNX Runtime reads and writes it: nothing is copied.
    assert key_at == cache.arrays[0][1].ctypes.data and value_at == cache.arrays[1][1].ctypes.data
    with pytest.raises(ValueError, match="rows 2..3 are not within the 3 slots"):
        cache.rows(2, 2)


def test_a_budget_below_one_slot_names_both_sizes():
    with pytest.raises(CacheBudgetError, match=f"a cache budget of {SLOT - 1} bytes holds no sequence: one at "
                                               f"max_context {CONTEXT} takes {SLOT} bytes"):
        SlotCache(TENSORS, CONTEXT, SLOT - 1)
