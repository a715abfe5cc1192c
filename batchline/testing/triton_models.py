"""The models Triton's client examples call (tritonclient's src/python/examples), built in code
as small ONNX graphs with the examples' names and tensors, so that the examples run unmodified
against a mesh (tests/e2e/test_triton_*.py) and benchmarks/shm.py has a model to send 1 MB to.

- simple, simple_int8, simple_int16, simple_fp32: INPUT0, INPUT1 [batch, 16] -> OUTPUT0 = sum,
  OUTPUT1 = difference (INT32, INT8, INT16, FP32).
- simple_string: the same on BYTES holding decimal integers.
- simple_identity: BYTES INPUT0 -> OUTPUT0, unchanged.
- densenet_onnx: an image classifier's interface (FP32 data_0 [batch, 3, 224, 224], FORMAT_NCHW)
  -> fc6_1 [batch, 10] scores, with a label file: the mean of each channel weighed per class.
- passthrough: FP32 INPUT0 [batch, N] -> OUTPUT0 (N free), unchanged: payloads of any size.
"""
from __future__ import annotations

import pathlib
from functools import partial
from typing import Callable, Iterable

import numpy as np
import onnx
import onnx.helper as oh
from onnx import TensorProto, numpy_helper

ADD_SUB = {"simple": TensorProto.INT32, "simple_int8": TensorProto.INT8, "simple_int16": TensorProto.INT16,
           "simple_fp32": TensorProto.FLOAT}
IMAGE_MODEL = "densenet_onnx"
IMAGE_LABELS = [f"CLASS_{i}" for i in range(10)]
# Every model of the repository that build_repository writes (simple_grpc_model_control.py counts them).
NAMES = (*ADD_SUB, "simple_string", "simple_identity", IMAGE_MODEL, "passthrough")
MAX_BATCH_SIZE = 8


def _save(repo: pathlib.Path, name: str, nodes, inputs, outputs, config: str = "", initializers=()) -> None:
    graph = oh.make_graph(nodes, name, inputs, outputs, initializer=list(initializers))
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    (repo / name / "1").mkdir(parents=True, exist_ok=True)
    onnx.save(model, repo / name / "1" / "model.onnx")
    (repo / name / "config.toml").write_text(f"max_batch_size = {MAX_BATCH_SIZE}\nmax_queue_delay_ms = 1.0\n{config}")


def _tensor(name: str, elem: int, dims=("batch", 16)):
    return oh.make_tensor_value_info(name, elem, list(dims))


def _add_sub(repo: pathlib.Path, name: str, elem: int) -> None:
    _save(repo, name, [oh.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
                       oh.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"])],
          [_tensor("INPUT0", elem), _tensor("INPUT1", elem)], [_tensor("OUTPUT0", elem), _tensor("OUTPUT1", elem)])


def _string_add_sub(repo: pathlib.Path) -> None:
    s, i = TensorProto.STRING, TensorProto.INT32
    _save(repo, "simple_string", [
        oh.make_node("Cast", ["INPUT0"], ["a"], to=i),
        oh.make_node("Cast", ["INPUT1"], ["b"], to=i),
        oh.make_node("Add", ["a", "b"], ["sum"]),
        oh.make_node("Sub", ["a", "b"], ["diff"]),
        oh.make_node("Cast", ["sum"], ["OUTPUT0"], to=s),
        oh.make_node("Cast", ["diff"], ["OUTPUT1"], to=s),
    ], [_tensor("INPUT0", s), _tensor("INPUT1", s)], [_tensor("OUTPUT0", s), _tensor("OUTPUT1", s)])


def _image_classifier(repo: pathlib.Path) -> None:
    weights = np.arange(30, dtype=np.float32).reshape(3, 10) / 30.0
    _save(repo, IMAGE_MODEL, [
        oh.make_node("ReduceMean", ["data_0"], ["means"], axes=[2, 3], keepdims=0),
        oh.make_node("MatMul", ["means", "weights"], ["fc6_1"]),
    ], [_tensor("data_0", TensorProto.FLOAT, ("batch", 3, 224, 224))],
        [_tensor("fc6_1", TensorProto.FLOAT, ("batch", 10))],
        '[input_format]\ndata_0 = "FORMAT_NCHW"\n[label_filename]\nfc6_1 = "labels.txt"\n',
        [numpy_helper.from_array(weights, "weights")])
    (repo / IMAGE_MODEL / "labels.txt").write_text("\n".join(IMAGE_LABELS) + "\n")


def build_repository(repo: pathlib.Path, names: Iterable[str] = NAMES) -> pathlib.Path:
    """Write the models `names` (all of NAMES by default) under `repo`, version 1 each; returns `repo`."""
    builders: dict[str, Callable[[], None]] = {
        **{name: partial(_add_sub, repo, name, elem) for name, elem in ADD_SUB.items()},
        "simple_string": partial(_string_add_sub, repo),
        "simple_identity": partial(_save, repo, "simple_identity", [oh.make_node("Identity", ["INPUT0"], ["OUTPUT0"])],
                                   [_tensor("INPUT0", TensorProto.STRING)], [_tensor("OUTPUT0", TensorProto.STRING)]),
        IMAGE_MODEL: partial(_image_classifier, repo),
        "passthrough": partial(_save, repo, "passthrough", [oh.make_node("Identity", ["INPUT0"], ["OUTPUT0"])],
                               [_tensor("INPUT0", TensorProto.FLOAT, ("batch", "n"))],
                               [_tensor("OUTPUT0", TensorProto.FLOAT, ("batch", "n"))]),
    }
    for name in names:
        builders[name]()
    return repo
