"""Turning a batch's requests into model inputs and the outputs back into answers.

Pure functions over numpy arrays. Requests are concatenated along dim 0.
Requests whose non-batch dims differ cannot share a tensor: by default they
run as separate groups (always correct); inputs the model's config lists
under [padding] are instead padded to the longest member with the given
value, which is exact for models that mask the padding (e.g. attention_mask).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np


@dataclass
class Group:
    members: list[int]                 # indices into the batch's requests
    inputs: dict[str, np.ndarray]
    rows: list[int]                    # batch-dim size of each member, in order


def _group_key(inputs: Mapping[str, np.ndarray], padding: Mapping[str, Any]) -> tuple:
    return tuple(
        (name, arr.dtype.str, arr.ndim if name in padding else arr.shape[1:])
        for name, arr in sorted(inputs.items())
    )


def _pad_to(arr: np.ndarray, shape: Sequence[int], value: Any) -> np.ndarray:
    if arr.shape[1:] == tuple(shape):
        return arr
    widths = [(0, 0)] + [(0, target - have) for have, target in zip(arr.shape[1:], shape)]
    return np.pad(arr, widths, mode="constant", constant_values=value)


def assemble(
    requests: Sequence[Mapping[str, np.ndarray]], padding: Mapping[str, Any], batched: bool
) -> list[Group]:
    """Group requests that can share one model run and build each group's inputs."""
    if not batched:
        return [Group([i], dict(r), [1]) for i, r in enumerate(requests)]
    by_key: dict[tuple, list[int]] = {}
    for i, r in enumerate(requests):
        by_key.setdefault(_group_key(r, padding), []).append(i)
    groups = []
    for members in by_key.values():
        names = requests[members[0]].keys()
        inputs = {}
        for name in names:
            arrays = [requests[i][name] for i in members]
            if name in padding and len(members) > 1:
                target = np.max([a.shape[1:] for a in arrays], axis=0)
                arrays = [_pad_to(a, target, padding[name]) for a in arrays]
            inputs[name] = arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=0)
        groups.append(Group(members, inputs, [requests[i][next(iter(names))].shape[0] for i in members]))
    return groups


class RowMismatch(ValueError):
    """An output whose first dimension is not the run's rows: it cannot be split among its members."""


def check_rows(outputs: Mapping[str, np.ndarray], rows: int) -> None:
    """RowMismatch unless every output has `rows` rows (a batched model's outputs are per row)."""
    for name, arr in outputs.items():
        got = arr.shape[0] if arr.ndim else None
        if got != rows:
            raise RowMismatch(f"output '{name}' has {got} rows for a run of {rows}: a batched model answers a row "
                              "for each row it is given (max_batch_size 0 serves one that does not)")


def split(outputs: Mapping[str, np.ndarray], rows: Sequence[int], batched: bool) -> list[dict[str, np.ndarray]]:
    """Per-member outputs: consecutive row ranges of every output (RowMismatch when an output's rows
    are not the members' together)."""
    if not batched:
        return [dict(outputs)]
    check_rows(outputs, sum(rows))
    result: list[dict[str, np.ndarray]] = [{} for _ in rows]
    for name, arr in outputs.items():
        start = 0
        for k, n in enumerate(rows):
            result[k][name] = arr[start : start + n]
            start += n
    return result
