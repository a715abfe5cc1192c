"""Unit tests for executor/batching.py: assembling a batch's requests into model
inputs and splitting outputs back into per-request answers."""
from __future__ import annotations

import numpy as np

from executor.batching import assemble, split


def feats(rows: int, width: int = 3, start: float = 0.0, dtype=np.float32) -> np.ndarray:
    return (np.arange(rows * width, dtype=np.float64).reshape(rows, width) + start).astype(dtype)


def test_same_shape_requests_concatenate_in_order():
    reqs = [
        {"x": feats(1, start=0), "y": np.array([[1]], dtype=np.int64)},
        {"x": feats(2, start=100), "y": np.array([[2], [3]], dtype=np.int64)},
        {"x": feats(1, start=200), "y": np.array([[4]], dtype=np.int64)},
    ]
    groups = assemble(reqs, padding={}, batched=True)
    assert len(groups) == 1
    g = groups[0]
    assert g.members == [0, 1, 2]
    assert g.rows == [1, 2, 1]
    assert set(g.inputs) == {"x", "y"}
    np.testing.assert_array_equal(g.inputs["x"], np.concatenate([r["x"] for r in reqs]))
    np.testing.assert_array_equal(g.inputs["y"], np.array([[1], [2], [3], [4]], dtype=np.int64))
    assert g.inputs["x"].dtype == np.float32
    assert g.inputs["x"].shape == (4, 3)


def test_split_returns_exactly_the_original_row_ranges():
    reqs = [{"x": feats(1, start=0)}, {"x": feats(3, start=10)}, {"x": feats(2, start=50)}]
    (g,) = assemble(reqs, padding={}, batched=True)
    # A "model": two outputs, row-wise functions of the input.
    outputs = {"double": g.inputs["x"] * 2, "total": g.inputs["x"].sum(axis=1, keepdims=True)}
    answers = split(outputs, g.rows, batched=True)
    assert len(answers) == 3
    for req, ans in zip(reqs, answers):
        assert set(ans) == {"double", "total"}
        np.testing.assert_array_equal(ans["double"], req["x"] * 2)
        np.testing.assert_array_equal(ans["total"], req["x"].sum(axis=1, keepdims=True))
        assert ans["double"].shape[0] == req["x"].shape[0]


def test_different_non_batch_shapes_without_padding_form_separate_groups():
    reqs = [{"x": feats(1, width=3)}, {"x": feats(1, width=5)}, {"x": feats(2, width=3, start=7)}]
    groups = assemble(reqs, padding={}, batched=True)
    assert [g.members for g in groups] == [[0, 2], [1]]
    assert [g.rows for g in groups] == [[1, 2], [1]]
    assert groups[0].inputs["x"].shape == (3, 3)
    np.testing.assert_array_equal(groups[0].inputs["x"], np.concatenate([reqs[0]["x"], reqs[2]["x"]]))
    np.testing.assert_array_equal(groups[1].inputs["x"], reqs[1]["x"])


def test_padding_pads_shorter_requests_with_configured_value_into_one_group():
    ids_a = np.array([[11, 12, 13]], dtype=np.int64)
    ids_b = np.array([[21, 22, 23, 24, 25], [31, 32, 33, 34, 35]], dtype=np.int64)
    mask_a = np.ones((1, 3), dtype=np.int64)
    mask_b = np.ones((2, 5), dtype=np.int64)
    reqs = [{"input_ids": ids_a, "attention_mask": mask_a}, {"input_ids": ids_b, "attention_mask": mask_b}]
    groups = assemble(reqs, padding={"input_ids": -7, "attention_mask": 0}, batched=True)
    assert len(groups) == 1
    g = groups[0]
    assert g.members == [0, 1]
    assert g.rows == [1, 2]
    np.testing.assert_array_equal(
        g.inputs["input_ids"],
        np.array([[11, 12, 13, -7, -7], [21, 22, 23, 24, 25], [31, 32, 33, 34, 35]], dtype=np.int64),
    )
    np.testing.assert_array_equal(
        g.inputs["attention_mask"],
        np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=np.int64),
    )
    assert g.inputs["input_ids"].dtype == np.int64
    # the caller's arrays are not modified
    assert ids_a.shape == (1, 3)


def test_padding_only_applies_to_configured_inputs():
    # 'input_ids' may be padded but 'other' may not: differing 'other' shapes split the group.
    reqs = [
        {"input_ids": np.zeros((1, 3), np.int64), "other": np.zeros((1, 2), np.float32)},
        {"input_ids": np.zeros((1, 5), np.int64), "other": np.zeros((1, 4), np.float32)},
    ]
    groups = assemble(reqs, padding={"input_ids": 0}, batched=True)
    assert [g.members for g in groups] == [[0], [1]]
    # single-member groups are not padded
    assert groups[0].inputs["input_ids"].shape == (1, 3)
    assert groups[1].inputs["input_ids"].shape == (1, 5)


def test_non_batched_model_gives_one_group_per_request():
    reqs = [{"x": feats(3)}, {"x": feats(3)}]  # identical shapes, still not merged
    groups = assemble(reqs, padding={}, batched=False)
    assert [g.members for g in groups] == [[0], [1]]
    assert [g.rows for g in groups] == [[1], [1]]
    for req, g in zip(reqs, groups):
        np.testing.assert_array_equal(g.inputs["x"], req["x"])
        assert g.inputs["x"].shape == (3, 3)  # dim 0 is not a batch dim: untouched
    out = {"y": np.arange(6).reshape(2, 3)}
    answers = split(out, groups[0].rows, batched=False)
    assert len(answers) == 1
    np.testing.assert_array_equal(answers[0]["y"], out["y"])


def test_dtype_differences_do_not_mix():
    reqs = [{"x": feats(1, dtype=np.float32)}, {"x": feats(1, dtype=np.float64)}, {"x": feats(2, dtype=np.float32)}]
    groups = assemble(reqs, padding={}, batched=True)
    assert [g.members for g in groups] == [[0, 2], [1]]
    assert groups[0].inputs["x"].dtype == np.float32
    assert groups[1].inputs["x"].dtype == np.float64


def test_dtype_differences_do_not_mix_even_when_padded():
    reqs = [{"ids": np.zeros((1, 3), np.int64)}, {"ids": np.zeros((1, 5), np.int32)}]
    groups = assemble(reqs, padding={"ids": 0}, batched=True)
    assert [g.members for g in groups] == [[0], [1]]
    assert groups[0].inputs["ids"].dtype == np.int64
    assert groups[1].inputs["ids"].dtype == np.int32


def test_outputs_whose_rows_are_not_the_members_are_not_split():
    import pytest

    from executor.batching import RowMismatch

    # A graph that answers one row whatever it is given: split, the second member would get nothing,
    # and with six rows for two of three each, rows of the wrong member.
    with pytest.raises(RowMismatch, match="output 'y' has 1 rows for a run of 2"):
        split({"y": np.zeros((1, 4))}, [1, 1], batched=True)
    with pytest.raises(RowMismatch, match="has 6 rows for a run of 4"):
        split({"y": np.zeros((6, 2))}, [2, 2], batched=True)
    with pytest.raises(RowMismatch, match="output 'y' has None rows"):
        split({"y": np.float32(1.0)}, [1], batched=True)
    assert [p["y"].shape for p in split({"y": np.zeros((3, 2))}, [1, 2], batched=True)] == [(1, 2), (2, 2)]
