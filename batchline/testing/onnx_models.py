"""Small ONNX models built in code for tests that need something the demo models are not."""
from __future__ import annotations

import pathlib

import onnx
import onnx.helper as oh

from batchline.testing import triton_models


def save_echo_model(repo: pathlib.Path) -> None:
    """`echo`: BYTES (ONNX string) `text` [batch, 2] -> `echo`, unchanged; version 1 under `repo`."""
    graph = oh.make_graph(
        [oh.make_node("Identity", ["text"], ["echo"])],
        "echo",
        [oh.make_tensor_value_info("text", onnx.TensorProto.STRING, ["batch", 2])],
        [oh.make_tensor_value_info("echo", onnx.TensorProto.STRING, ["batch", 2])],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    (repo / "echo" / "1").mkdir(parents=True)
    onnx.save(model, repo / "echo" / "1" / "model.onnx")


# KServe datatype -> ONNX element type, for every datatype batchline serves.
ONNX_TYPES = {
    "BOOL": onnx.TensorProto.BOOL, "UINT8": onnx.TensorProto.UINT8, "UINT16": onnx.TensorProto.UINT16,
    "UINT32": onnx.TensorProto.UINT32, "UINT64": onnx.TensorProto.UINT64, "INT8": onnx.TensorProto.INT8,
    "INT16": onnx.TensorProto.INT16, "INT32": onnx.TensorProto.INT32, "INT64": onnx.TensorProto.INT64,
    "FP16": onnx.TensorProto.FLOAT16, "FP32": onnx.TensorProto.FLOAT, "FP64": onnx.TensorProto.DOUBLE,
    "BYTES": onnx.TensorProto.STRING,
}


def _save(repo: pathlib.Path, name: str, nodes, inputs, outputs, config: str) -> None:
    graph = oh.make_graph(nodes, name, inputs, outputs)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    (repo / name / "1").mkdir(parents=True)
    onnx.save(model, repo / name / "1" / "model.onnx")
    (repo / name / "config.toml").write_text(config)


def save_identity_model(repo: pathlib.Path) -> None:
    """`identity`: for every datatype DT an input `in_DT` [batch, 3] answered unchanged as `out_DT`."""
    _save(repo, "identity", [oh.make_node("Identity", [f"in_{dt}"], [f"out_{dt}"]) for dt in ONNX_TYPES],
          [oh.make_tensor_value_info(f"in_{dt}", t, ["batch", 3]) for dt, t in ONNX_TYPES.items()],
          [oh.make_tensor_value_info(f"out_{dt}", t, ["batch", 3]) for dt, t in ONNX_TYPES.items()],
          "max_batch_size = 8\nmax_queue_delay_ms = 1.0\n")


def save_triton_example_models(repo: pathlib.Path) -> None:
    """The models Triton's example clients call (batchline/testing/triton_models.py): `simple`
    (INT32 INPUT0 + INPUT1 -> OUTPUT0, INPUT0 - INPUT1 -> OUTPUT1, [batch, 16]), `simple_string`
    (the same on BYTES holding decimal integers) and `simple_identity` (BYTES, unchanged)."""
    triton_models.build_repository(repo, ("simple", "simple_string", "simple_identity"))
