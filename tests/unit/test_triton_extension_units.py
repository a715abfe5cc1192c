"""The pure parts of the Triton extensions: classification's answer, the checks of a load's
overrides at the gateway, the translation of Triton's JSON config into config.toml keys, and
the refusals of shared-memory registration (real files under /dev/shm)."""
from __future__ import annotations

import os
import uuid

import numpy as np
import pytest

from batchline.codec import deserialize_bytes
from batchline.errors import Internal, InvalidArgument, ResourceExhausted
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import internal_pb2 as pb
from executor.load_override import config_keys
from executor.model_config import ConfigError, check_model_config
from gateway import classification
from gateway.load_override import override_maker
from gateway.shared_memory import SharedMemory


def _model(labels=()) -> pb.ModelInfo:
    return pb.ModelInfo(name="m", max_batch_size=8, outputs=[
        pb.TensorSpec(name="scores", datatype="FP32", shape=[-1, 4], labels=list(labels)),
        pb.TensorSpec(name="text", datatype="BYTES", shape=[-1, 1])])


def _response(scores: np.ndarray) -> ipb.ModelInferResponse:
    response = ipb.ModelInferResponse(outputs=[ipb.ModelInferResponse.InferOutputTensor(
        name="scores", datatype="FP32", shape=list(scores.shape))])
    response.raw_output_contents.append(scores.astype(np.float32).tobytes())
    return response


def _ask(output: str, count) -> ipb.ModelInferRequest:
    request = ipb.ModelInferRequest()
    out = request.outputs.add(name=output)
    if count is not None:
        out.parameters["classification"].int64_param = count
    return request


def test_classification_answers_the_best_classes_per_row_with_labels():
    model = _model(["cat", "dog", "eel", "fox"])
    request = _ask("scores", 2)
    asked = classification.requested(request, model)
    assert asked == {"scores": 2} and "classification" not in request.outputs[0].parameters
    response = _response(np.array([[0.1, 0.7, 0.2, 0.7], [4, 3, 2, 1]]))
    classification.classify(response, model, asked)
    out = response.outputs[0]
    assert (out.datatype, list(out.shape)) == ("BYTES", [2, 2])
    rows = deserialize_bytes(response.raw_output_contents[0], 4, "scores").reshape(2, 2)
    # Ties keep the lower index first, as Triton's sort does.
    assert rows.tolist() == [[b"0.700000:1:dog", b"0.700000:3:fox"], [b"4.000000:0:cat", b"3.000000:1:dog"]]


def test_classification_without_labels_and_its_refusals():
    model = _model()
    response = _response(np.array([[1, 2, 3, 4]]))
    classification.classify(response, model, classification.requested(_ask("scores", 9), model))
    assert deserialize_bytes(response.raw_output_contents[0], 4, "scores").tolist() == [
        b"4.000000:3", b"3.000000:2", b"2.000000:1", b"1.000000:0"]
    with pytest.raises(InvalidArgument, match="integer >= 1"):
        classification.requested(_ask("scores", 0), model)
    with pytest.raises(InvalidArgument, match="only a numeric output"):
        classification.requested(_ask("text", 1), model)
    assert classification.requested(_ask("scores", None), model) == {}


def _param(value: str | bytes) -> ipb.ModelRepositoryParameter:
    if isinstance(value, bytes):
        return ipb.ModelRepositoryParameter(bytes_param=value)
    return ipb.ModelRepositoryParameter(string_param=value)


def test_a_plain_load_has_no_override_and_a_config_makes_one_for_its_call():
    assert override_maker("m", {}, 1000) is None
    params = {"config": _param('{"max_batch_size": 4}'), "file:1/model.onnx": _param(b"onnx")}
    made = pb.ModelOverride.FromString(override_maker("m", params, 1000)(7))
    assert (made.seq, made.config_json, dict(made.files)) == (7, '{"max_batch_size": 4}', {"1/model.onnx": b"onnx"})


@pytest.mark.parametrize("path", ["../model.onnx", "/etc/passwd", "1/" + "A" * 256, "1//model.onnx", ""])
def test_a_file_outside_the_model_directory_is_refused_in_tritons_words(path):
    params = {"config": _param("{}"), f"file:{path}": _param(b"x")}
    with pytest.raises(Internal, match="^failed to poll from model repository: parameter 'file:"):
        override_maker("m", params, 1000)


def test_load_override_refusals_name_what_is_wrong():
    with pytest.raises(InvalidArgument, match="failed to load 'm': file parameters need a 'config'"):
        override_maker("m", {"file:1/model.onnx": _param(b"x")}, 1000)
    with pytest.raises(InvalidArgument, match="failed to load 'm': parameter 'config' is not valid JSON"):
        override_maker("m", {"config": _param('"parameters": {"config": {{"max_batch_size": "16"}}}')}, 1000)
    with pytest.raises(ResourceExhausted, match="load_files_max_bytes of 100"):
        override_maker("m", {"config": _param("{}"), "file:1/model.onnx": _param(b"x" * 200)}, 100)


def test_tritons_json_config_becomes_config_toml_keys():
    triton = {
        "name": "m", "backend": "onnxruntime", "max_batch_size": "16",
        "dynamic_batching": {"preferred_batch_size": [4, 8], "max_queue_delay_microseconds": "500",
                             "priority_levels": 3, "default_priority_level": 2,
                             "default_queue_policy": {"default_timeout_microseconds": 2000000, "max_queue_size": 10}},
        "instance_group": [{"count": 2, "kind": "KIND_CPU"}, {"count": 1}],
        "version_policy": {"specific": {"versions": ["1", 3]}},
        "input": [{"name": "image", "data_type": "TYPE_FP32", "format": "FORMAT_NHWC", "dims": [224, 224, 3]}],
        "output": [{"name": "probs", "label_filename": "labels.txt"}],
    }
    keys = config_keys(triton)
    assert keys == {"max_batch_size": 16, "preferred_batch_sizes": [4, 8], "max_queue_delay_ms": 0.5,
                    "priority_levels": 3, "default_priority": 2, "default_timeout_ms": 2000.0, "max_queue_size": 10,
                    "instance_count": 3, "version_policy": {"specific": [1, 3]},
                    "input_format": {"image": "FORMAT_NHWC"}, "label_filename": {"probs": "labels.txt"}}
    assert check_model_config(keys, "test")["instance_count"] == 3
    assert check_model_config({}, "test")["max_batch_size"] == 8  # what the override leaves out takes its default


def test_tritons_json_config_fields_batchline_does_not_serve_are_named():
    with pytest.raises(ConfigError, match=r"\['ensemble_scheduling', 'sequence_batching'\]"):
        config_keys({"sequence_batching": {}, "ensemble_scheduling": {}})
    with pytest.raises(ConfigError, match="ONNX Runtime only"):
        config_keys({"platform": "tensorflow_savedmodel"})
    with pytest.raises(ConfigError, match="max_batch_size must be an integer"):
        config_keys({"max_batch_size": "many"})
    with pytest.raises(ConfigError, match="input_format"):
        check_model_config(config_keys({"input": [{"name": "x", "format": "FORMAT_SIDEWAYS"}]}), "test")
    # Within the fields served: what asks for behaviour batchline lacks is named, not dropped.
    with pytest.raises(ConfigError, match=r"dynamic_batching: \['preserve_ordering'\]"):
        config_keys({"dynamic_batching": {"preserve_ordering": True}})
    with pytest.raises(ConfigError, match=r"default_queue_policy: \['timeout_action'\]"):
        config_keys({"dynamic_batching": {"default_queue_policy": {"timeout_action": "DELAY"}}})
    with pytest.raises(ConfigError, match=r"instance_group\[\]: \['gpus', 'kind'\]"):
        config_keys({"instance_group": [{"count": 2, "kind": "KIND_GPU", "gpus": [0]}]})
    # Triton's defaults, as a config read back from a server writes them, ask for nothing.
    assert config_keys({"dynamic_batching": {"preserve_ordering": False, "priority_queue_policy": {},
                                             "default_queue_policy": {"timeout_action": "REJECT",
                                                                      "allow_timeout_override": False}},
                        "instance_group": [{"count": 2, "kind": "KIND_AUTO", "gpus": []}]}) == {"instance_count": 2}
    # A default of one key is no default of another.
    with pytest.raises(ConfigError, match="not served by batchline's load overrides"):
        config_keys({"dynamic_batching": {"preserve_ordering": "REJECT"}})


def test_shared_memory_registration_refuses_keys_it_cannot_map():
    regions = SharedMemory()
    for key in ("../etc/passwd", "/a/b", "", "/.."):
        with pytest.raises(InvalidArgument, match="is not a shm_open name"):
            regions.register("r", key, 0, 8)
    with pytest.raises(InvalidArgument, match="unable to open shared memory key"):
        regions.register("r", f"/bl_absent_{uuid.uuid4().hex}", 0, 8)
    name = f"bl_unit_{uuid.uuid4().hex[:8]}"
    with open(f"/dev/shm/{name}", "wb") as f:
        f.write(b"\0" * 64)
    try:
        with pytest.raises(InvalidArgument, match="does not fit key"):
            regions.register("r", f"/{name}", 32, 64)
        regions.register("r", f"/{name}", 32, 32)
        assert [(r.name, r.offset, r.byte_size) for r in regions.status("")] == [("r", 32, 32)]
        with pytest.raises(InvalidArgument, match="'nope' is not registered"):
            regions.status("nope")
        regions.unregister("nope")  # no error, as in Triton
        regions.unregister("")
        assert regions.regions == {}
    finally:
        os.unlink(f"/dev/shm/{name}")


def test_a_region_unregistered_or_shrunk_under_a_request_is_refused_not_read():
    regions = SharedMemory()
    name = f"bl_unit_{uuid.uuid4().hex[:8]}"
    with open(f"/dev/shm/{name}", "wb") as f:
        f.write(b"\0" * 64)
    try:
        regions.register("out", f"/{name}", 0, 64)
        request = ipb.ModelInferRequest()
        out = request.outputs.add(name="scores")
        out.parameters["shared_memory_region"].string_param = "out"
        out.parameters["shared_memory_byte_size"].int64_param = 64
        targets = regions.output_targets(request)
        response = _response(np.ones((1, 4)))
        os.truncate(f"/dev/shm/{name}", 8)
        with pytest.raises(InvalidArgument, match="'out' shrank below 16 bytes"):
            SharedMemory.write_outputs(response, targets)
        regions.unregister("out")
        with pytest.raises(InvalidArgument, match="'out' was unregistered while the request ran"):
            SharedMemory.write_outputs(response, targets)
    finally:
        regions.unregister("")
        os.unlink(f"/dev/shm/{name}")


def test_a_tenant_sees_uses_and_unregisters_only_its_own_regions():
    regions = SharedMemory()
    name, bobs = f"bl_unit_{uuid.uuid4().hex[:8]}", f"bl_unit_{uuid.uuid4().hex[:8]}"
    for key in (name, bobs):
        with open(f"/dev/shm/{key}", "wb") as f:
            f.write(b"\0" * 64)
    try:
        regions.register("in", f"/{name}", 0, 64, tenant="alice")
        regions.register("in", f"/{bobs}", 0, 32, tenant="bob")  # the same name, a region (and file) of its own
        assert [r.byte_size for r in regions.status("", "alice")] == [64]
        assert [r.byte_size for r in regions.status("in", "bob")] == [32]
        assert regions.status("", "carol") == []
        request = ipb.ModelInferRequest()
        request.outputs.add(name="scores").parameters["shared_memory_region"].string_param = "in"
        request.outputs[0].parameters["shared_memory_byte_size"].int64_param = 16
        with pytest.raises(InvalidArgument, match="unable to find shared memory region: 'in'.*has none"):
            regions.output_targets(request, "carol")
        regions.unregister("", "bob")  # all of bob's: alice's stays
        assert [r.byte_size for r in regions.status("", "alice")] == [64] and regions.status("", "bob") == []
        regions.close()
        assert regions.regions == {}
    finally:
        regions.close()
        os.unlink(f"/dev/shm/{name}")
        os.unlink(f"/dev/shm/{bobs}")


def test_a_label_file_named_outside_the_model_directory_is_refused(tmp_path):
    from batchline.protocol import internal_pb2 as pb
    from executor.repository import RepositoryError, _triton_fields

    model_dir = tmp_path / "repo" / "m"
    model_dir.mkdir(parents=True)
    (tmp_path / "secret.txt").write_text("do not publish\n")
    (model_dir / "labels.txt").write_text("cat\ndog\n")
    config = {"input_format": {}, "label_filename": {"probs": "../../secret.txt"}}
    with pytest.raises(RepositoryError, match="'../../secret.txt' is outside the model's directory"):
        _triton_fields(model_dir, config, [], [pb.TensorSpec(name="probs")])
    # A link inside the directory (a load's config alone links the repository's files) is the model's.
    (model_dir / "linked.txt").symlink_to(model_dir / "labels.txt")
    outputs = [pb.TensorSpec(name="probs")]
    _triton_fields(model_dir, {"input_format": {}, "label_filename": {"probs": "linked.txt"}}, [], outputs)
    assert list(outputs[0].labels) == ["cat", "dog"]


@pytest.mark.parametrize("datatype, scores, best", [
    ("UINT8", [0, 5, 10], [b"10.000000:2", b"5.000000:1"]),  # negated, an unsigned score wraps
    ("INT8", [-128, 5, 10], [b"10.000000:2", b"5.000000:1"]),  # and so does the lowest signed one
    ("INT64", [-2**63, 0, 1], [b"1.000000:2", b"0.000000:1"]),
])
def test_classification_ranks_every_numeric_type_best_first(datatype, scores, best):
    from batchline.codec import DATATYPES

    model = pb.ModelInfo(name="m", max_batch_size=0, outputs=[pb.TensorSpec(name="scores", datatype=datatype)])
    response = ipb.ModelInferResponse(outputs=[ipb.ModelInferResponse.InferOutputTensor(
        name="scores", datatype=datatype, shape=[3])])
    response.raw_output_contents.append(np.array(scores, DATATYPES[datatype]).tobytes())
    classification.classify(response, model, classification.requested(_ask("scores", 2), model))
    assert deserialize_bytes(response.raw_output_contents[0], 2, "scores").tolist() == best


def test_a_bool_output_is_refused_for_classification_before_it_runs():
    model = pb.ModelInfo(name="m", outputs=[pb.TensorSpec(name="flags", datatype="BOOL")])
    with pytest.raises(InvalidArgument, match="is BOOL: only a numeric output"):
        classification.requested(_ask("flags", 1), model)
