"""Sequence and decoupled ONNX models built in code, with the names and tensors of Triton's
examples (tests/triton_examples/), and an accumulator whose state batchline keeps in Redis."""
from __future__ import annotations

import pathlib

import onnx
import onnx.helper as oh

INT32, UINT32, INT64 = onnx.TensorProto.INT32, onnx.TensorProto.UINT32, onnx.TensorProto.INT64


def _save(repo: pathlib.Path, name: str, graph: onnx.GraphProto, config: str) -> None:
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    (repo / name / "1").mkdir(parents=True, exist_ok=True)
    onnx.save(model, repo / name / "1" / "model.onnx")
    (repo / name / "config.toml").write_text(config)


def _io(name: str, kind: int, shape: list) -> onnx.ValueInfoProto:
    return oh.make_tensor_value_info(name, kind, shape)


def save_simple_sequence(repo: pathlib.Path) -> None:
    """Triton's `simple_sequence` (docs/examples/model_repository): OUTPUT = (INPUT + START) * READY,
    with START and READY control inputs; no state."""
    graph = oh.make_graph(
        [oh.make_node("Add", ["INPUT", "START"], ["sum"]), oh.make_node("Mul", ["sum", "READY"], ["OUTPUT"])],
        "simple_sequence",
        [_io("INPUT", INT32, ["batch", 1]), _io("START", INT32, ["batch", 1]), _io("READY", INT32, ["batch", 1])],
        [_io("OUTPUT", INT32, ["batch", 1])],
    )
    _save(repo, "simple_sequence", graph, """max_batch_size = 8

[sequence_batching]
control = { START = "start", READY = "ready" }
""")


def save_accumulator(repo: pathlib.Path, name: str = "accumulator", idle_us: int = 60_000_000,
                     corrid_type: int = INT64) -> None:
    """`accumulator`: OUTPUT = the sum of the sequence's INPUTs so far, kept in the implicit state
    ACC_IN -> ACC_OUT; END and CORRID (of `corrid_type`) controls come back as ENDED and CORRID_OUT."""
    graph = oh.make_graph(
        [oh.make_node("Add", ["ACC_IN", "INPUT"], ["OUTPUT"]),
         oh.make_node("Identity", ["OUTPUT"], ["ACC_OUT"]),
         oh.make_node("Identity", ["END"], ["ENDED"]),
         oh.make_node("Identity", ["CORRID"], ["CORRID_OUT"])],
        name,
        [_io("INPUT", INT32, ["batch", 1]), _io("ACC_IN", INT32, ["batch", 1]), _io("END", INT32, ["batch", 1]),
         _io("CORRID", corrid_type, ["batch", 1]), _io("READY", INT32, ["batch", 1])],
        [_io("OUTPUT", INT32, ["batch", 1]), _io("ACC_OUT", INT32, ["batch", 1]), _io("ENDED", INT32, ["batch", 1]),
         _io("CORRID_OUT", corrid_type, ["batch", 1])],
    )
    _save(repo, name, graph, f"""max_batch_size = 8
max_queue_delay_ms = 1.0

[sequence_batching]
max_sequence_idle_microseconds = {idle_us}
control = {{ END = "end", CORRID = "corrid", READY = "ready" }}
state = {{ ACC_IN = "ACC_OUT" }}
""")


def save_repeat_int32(repo: pathlib.Path) -> None:
    """Triton's `repeat_int32` (its repeat backend) as an ONNX model: one response per element of IN,
    OUT = IN[i] and IDX = i; DELAY and WAIT are taken and not used (a graph cannot wait)."""
    graph = oh.make_graph(
        [oh.make_node("Unsqueeze", ["IN", "axes"], ["OUT"]),
         oh.make_node("Shape", ["IN"], ["n"]),
         oh.make_node("Squeeze", ["n"], ["n0"]),
         oh.make_node("Range", ["zero", "n0", "one"], ["range"]),
         oh.make_node("Cast", ["range"], ["range32"], to=UINT32),
         oh.make_node("Unsqueeze", ["range32", "axes"], ["IDX"])],
        "repeat_int32",
        [_io("IN", INT32, ["n"]), _io("DELAY", UINT32, ["n"]), _io("WAIT", UINT32, [1])],
        [_io("OUT", INT32, ["n", 1]), _io("IDX", UINT32, ["n", 1])],
        initializer=[oh.make_tensor("axes", INT64, [1], [1]), oh.make_tensor("zero", INT64, [], [0]),
                     oh.make_tensor("one", INT64, [], [1])],
    )
    _save(repo, "repeat_int32", graph, """max_batch_size = 0
decoupled = true
""")
