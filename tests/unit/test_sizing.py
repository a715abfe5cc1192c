"""A request's length for the latency profile (batchline/sizing.py): the product of its sizes at
the dims its model declares variable, the largest over its inputs."""
from __future__ import annotations

from batchline.protocol import internal_pb2 as pb
from batchline.sizing import row_length


def spec(name: str, *shape: int) -> pb.TensorSpec:
    return pb.TensorSpec(name=name, datatype="INT64", shape=list(shape))


def test_a_text_models_length_is_its_sequence_length():
    model = pb.ModelInfo(max_batch_size=32, inputs=[spec("input_ids", -1, -1), spec("attention_mask", -1, -1)])
    assert row_length(model, {"input_ids": [4, 128], "attention_mask": [4, 128]}) == 128
    assert row_length(model, {"input_ids": [1, 7], "attention_mask": [1, 7]}) == 7


def test_fixed_dims_and_the_batch_dim_do_not_count():
    model = pb.ModelInfo(max_batch_size=8, inputs=[spec("features", -1, 32)])
    assert row_length(model, {"features": [5, 32]}) == 1


def test_the_longest_input_counts_and_variable_dims_multiply():
    model = pb.ModelInfo(max_batch_size=8, inputs=[spec("image", -1, 3, -1, -1), spec("ids", -1, -1)])
    assert row_length(model, {"image": [2, 3, 4, 5], "ids": [2, 7]}) == 20
    assert row_length(model, {"image": [2, 3, 2, 2], "ids": [2, 7]}) == 7


def test_without_a_batch_dim_every_variable_dim_counts():
    model = pb.ModelInfo(max_batch_size=0, inputs=[spec("x", -1, 4)])
    assert row_length(model, {"x": [6, 4]}) == 6
