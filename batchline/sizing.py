"""How much work a request is, in the units the latency profile counts.

A model's run time grows with its rows and, when the model has variable
non-batch dims (the sequence length of a text model), with those too: eight
sequences of 128 tokens take about eight times as long as eight of 16. A
profile fitted on rows alone would predict one length's cost for the other
as soon as the traffic changes. The profile therefore counts units = rows x
length, where a request's length is the product of its sizes at the dims
its model declares variable (-1), the largest over its inputs. A model with
fixed shapes has length 1, so its units are its rows.

A batch costs its rows x its longest member's length: padded inputs are
padded to the longest, and requests whose unpadded shapes differ run as
separate groups, for which that product errs on the high side.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from batchline.protocol import internal_pb2 as pb


def row_length(model: pb.ModelInfo, shapes: Mapping[str, Sequence[int]]) -> int:
    """A request's (or a model run's) length: elements per row at `model`'s variable dims."""
    batched = model.max_batch_size > 0
    length = 1
    for spec in model.inputs:
        shape = shapes.get(spec.name)
        if shape is None:
            continue
        n = 1
        for i, d in enumerate(spec.shape):
            if d == -1 and not (batched and i == 0) and i < len(shape):
                n *= int(shape[i])
        length = max(length, n)
    return length


def size_class(units: int) -> int:
    """The latency profile's size class of a batch: units in [2^k, 2^(k+1)) are class k."""
    return max(0, int(units).bit_length() - 1)


def margin_for(margins: Sequence[float], units: int, default: float) -> float:
    """The profile's margin for a batch of `units`, from its per-class table (scheduler/profile.py):
    past the table's end, the last class's; an empty table, `default` for every size."""
    if not margins:
        return default
    return margins[min(size_class(units), len(margins) - 1)]
