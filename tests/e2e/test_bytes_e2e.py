"""Models unlike the demo ones, end to end: BYTES (ONNX string) tensors, and no batch dimension."""
from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import pytest
import tritonclient.grpc as tc
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

from batchline.testing.onnx_models import save_echo_model


@pytest.fixture(scope="module")
def string_repository(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    save_echo_model(repo)
    (repo / "echo" / "config.toml").write_text("max_batch_size = 8\nmax_queue_delay_ms = 1.0\n")
    # A model without a batch dimension: every request runs on its own.
    graph = oh.make_graph(
        [oh.make_node("Add", ["a", "b"], ["sum"])],
        "add",
        [oh.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [3]) for n in ("a", "b")],
        [oh.make_tensor_value_info("sum", onnx.TensorProto.FLOAT, [3])],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    (repo / "add" / "1").mkdir(parents=True)
    onnx.save(model, repo / "add" / "1" / "model.onnx")
    (repo / "add" / "config.toml").write_text("max_batch_size = 0\n")
    return repo


@pytest.fixture(scope="module")
def other_mesh(string_repository):
    from batchline.testing.in_process import InProcessMesh

    with InProcessMesh(None, str(string_repository)) as m:
        yield m


def test_bytes_round_trip_through_a_string_model(other_mesh):
    client = tc.InferenceServerClient(other_mesh.address)
    meta = client.get_model_metadata("echo")
    assert meta.inputs[0].datatype == "BYTES" and meta.outputs[0].datatype == "BYTES"
    config = client.get_model_config("echo").config  # Triton calls BYTES tensors TYPE_STRING
    assert [i.data_type for i in config.input] == [mc.TYPE_STRING]
    assert [o.data_type for o in config.output] == [mc.TYPE_STRING]
    text = np.array([["héllo", ""], ["batch", "line"]], dtype=object)
    inp = tc.InferInput("text", [2, 2], "BYTES")
    inp.set_data_from_numpy(text)
    out = client.infer("echo", [inp]).as_numpy("echo")
    assert [[v.decode() for v in row] for row in out] == [["héllo", ""], ["batch", "line"]]

    bad = tc.InferInput("text", [1, 2], "BYTES")
    bad.set_data_from_numpy(np.array([[b"\xff\xfe", b"ok"]], dtype=object))
    with pytest.raises(InferenceServerException) as info:
        client.infer("echo", [bad])
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "UTF-8" in info.value.message() and "'text'" in info.value.message()
    client.close()


def test_model_without_batch_dimension(other_mesh):
    client = tc.InferenceServerClient(other_mesh.address)
    meta = client.get_model_metadata("add")
    assert [list(i.shape) for i in meta.inputs] == [[3], [3]]
    config = client.get_model_config("add").config  # no batch dim: dims as they are, no dynamic batching
    assert config.max_batch_size == 0 and [list(i.dims) for i in config.input] == [[3], [3]]
    assert not config.HasField("dynamic_batching")
    # Each request runs alone: statistics show one execution per inference.
    for k in range(3):
        a = np.full(3, k, dtype=np.float32)
        inputs = [tc.InferInput("a", [3], "FP32"), tc.InferInput("b", [3], "FP32")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(a)
        np.testing.assert_array_equal(client.infer("add", inputs).as_numpy("sum"), a * 2)
    wrong = tc.InferInput("a", [1, 3], "FP32")
    wrong.set_data_from_numpy(np.zeros((1, 3), dtype=np.float32))
    with pytest.raises(InferenceServerException) as info:
        client.infer("add", [wrong, tc.InferInput("b", [3], "FP32").set_data_from_numpy(np.zeros(3, np.float32))])
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT" and "'a'" in info.value.message()
    stats = client.get_inference_statistics("add").model_stats[0]
    assert stats.execution_count == stats.inference_count
    client.close()
