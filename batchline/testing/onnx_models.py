"""Small ONNX models built in code for tests that need something the demo models are not."""
from __future__ import annotations

import pathlib

import onnx
import onnx.helper as oh


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
