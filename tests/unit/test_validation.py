"""Unit tests for gateway/validation.py (checking requests at the door) and
batchline/errors.py (error classes <-> gRPC status codes)."""
from __future__ import annotations

import re

import grpc
import numpy as np
import pytest

from batchline import errors
from batchline.codec import encode_array
from batchline.errors import InvalidArgument
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import internal_pb2 as pb
from gateway.validation import request_priority, request_timeout_us, validate


def mlp_model(**overrides) -> pb.ModelInfo:
    fields = dict(
        name="mlp",
        version="1",
        platform="onnxruntime_onnx",
        max_batch_size=64,
        inputs=[pb.TensorSpec(name="features", datatype="FP32", shape=[-1, 32])],
        outputs=[pb.TensorSpec(name="probability", datatype="FP32", shape=[-1, 1])],
    )
    fields.update(overrides)
    return pb.ModelInfo(**fields)


def pair_model() -> pb.ModelInfo:
    return pb.ModelInfo(
        name="pair",
        version="1",
        max_batch_size=8,
        inputs=[
            pb.TensorSpec(name="input_ids", datatype="INT64", shape=[-1, -1]),
            pb.TensorSpec(name="attention_mask", datatype="INT64", shape=[-1, -1]),
        ],
        outputs=[pb.TensorSpec(name="embedding", datatype="FP32", shape=[-1, 4])],
    )


def unbatched_model() -> pb.ModelInfo:
    return pb.ModelInfo(
        name="fixed",
        version="1",
        max_batch_size=0,
        inputs=[pb.TensorSpec(name="image", datatype="UINT8", shape=[4, 4])],
        outputs=[pb.TensorSpec(name="label", datatype="INT64", shape=[1])],
    )


def request(model_name: str = "mlp", outputs: tuple[str, ...] = (), **arrays: np.ndarray) -> ipb.ModelInferRequest:
    req = ipb.ModelInferRequest(model_name=model_name)
    for name, arr in arrays.items():
        dt, shape, raw = encode_array(arr)
        req.inputs.add(name=name, datatype=dt, shape=shape)
        req.raw_input_contents.append(raw)
    for name in outputs:
        req.outputs.add(name=name)
    return req


def features(rows: int, width: int = 32, dtype=np.float32) -> np.ndarray:
    return np.zeros((rows, width), dtype=dtype)


def tokens(rows: int, seq: int) -> np.ndarray:
    return np.ones((rows, seq), dtype=np.int64)


def rejected(req, model) -> str:
    with pytest.raises(InvalidArgument) as e:
        validate(req, model)
    return str(e.value)


# --- valid requests ---------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 3, 64])
def test_valid_request_returns_rows(rows):
    assert validate(request(features=features(rows), outputs=("probability",)), mlp_model()) == rows


def test_valid_two_input_request_returns_rows():
    req = request("pair", input_ids=tokens(2, 7), attention_mask=tokens(2, 7))
    assert validate(req, pair_model()) == 2


def test_valid_typed_contents_request():
    req = ipb.ModelInferRequest(model_name="mlp")
    t = req.inputs.add(name="features", datatype="FP32", shape=[2, 32])
    t.contents.fp32_contents.extend([0.5] * 64)
    assert validate(req, mlp_model()) == 2


def test_unbatched_model_counts_one_row():
    req = request("fixed", image=np.zeros((4, 4), np.uint8))
    assert validate(req, unbatched_model()) == 1


def test_unbatched_model_fixed_dims_are_checked():
    msg = rejected(request("fixed", image=np.zeros((2, 4), np.uint8)), unbatched_model())
    assert "'image'" in msg and "[4, 4]" in msg and "[2, 4]" in msg


# --- inputs -----------------------------------------------------------------


def test_missing_input():
    msg = rejected(request("pair", input_ids=tokens(1, 3)), pair_model())
    assert "missing" in msg and "attention_mask" in msg
    assert "'pair'" in msg


def test_unknown_input():
    msg = rejected(request(features=features(1), extra=features(1)), mlp_model())
    assert "'extra'" in msg and "features" in msg


def test_wrong_datatype():
    msg = rejected(request(features=features(1, dtype=np.float64)), mlp_model())
    assert "'features'" in msg and "must be FP32" in msg and "FP64" in msg


def test_wrong_rank():
    msg = rejected(request(features=np.zeros(32, np.float32)), mlp_model())
    assert "'features'" in msg and "['batch', 32]" in msg and "[32]" in msg


def test_wrong_fixed_dim():
    msg = rejected(request(features=features(2, width=31)), mlp_model())
    assert "'features'" in msg and "['batch', 32]" in msg and "[2, 31]" in msg


def test_batch_size_zero():
    msg = rejected(request(features=features(0)), mlp_model())
    assert "'features'" in msg and "batch size 0" in msg and "1..64" in msg


def test_batch_size_above_max_batch_size():
    msg = rejected(request(features=features(65)), mlp_model())
    assert "'features'" in msg and "batch size 65" in msg and "1..64" in msg


def test_inputs_disagree_on_batch_size():
    msg = rejected(request("pair", input_ids=tokens(2, 5), attention_mask=tokens(3, 5)), pair_model())
    assert "disagree" in msg and "'attention_mask'" in msg and "3" in msg and "2" in msg


def test_unknown_requested_output():
    msg = rejected(request(features=features(1), outputs=("probabilty",)), mlp_model())
    assert "'probabilty'" in msg and "probability" in msg


def test_byte_size_mismatch():
    req = request(features=features(2))
    req.raw_input_contents[0] = req.raw_input_contents[0][:-4]
    msg = rejected(req, mlp_model())
    assert "'features'" in msg and "256" in msg and "252" in msg


def test_duplicated_input_is_rejected():
    req = request(features=features(1))
    req.inputs.add(name="features", datatype="FP32", shape=[1, 32])
    req.raw_input_contents.append(features(1).tobytes())
    msg = rejected(req, mlp_model())
    assert "'features'" in msg and "more than once" in msg


def test_non_zero_sequence_id():
    req = request(features=features(1))
    req.parameters["sequence_id"].int64_param = 42
    msg = rejected(req, mlp_model())
    assert "sequence_id" in msg and "sequence batching" in msg


def test_zero_sequence_id_is_accepted():
    req = request(features=features(1))
    req.parameters["sequence_id"].int64_param = 0
    assert validate(req, mlp_model()) == 1


# --- timeout ----------------------------------------------------------------


def test_timeout_absent():
    assert request_timeout_us(request(features=features(1))) is None


def test_timeout_int64_param():
    req = request(features=features(1))
    req.parameters["timeout"].int64_param = 2500
    assert request_timeout_us(req) == 2500


def test_timeout_uint64_param():
    req = request(features=features(1))
    req.parameters["timeout"].uint64_param = 1_000_000
    assert request_timeout_us(req) == 1_000_000


def test_timeout_zero_means_not_set():
    req = request(features=features(1))
    req.parameters["timeout"].int64_param = 0
    assert request_timeout_us(req) is None


def test_timeout_negative():
    req = request(features=features(1))
    req.parameters["timeout"].int64_param = -5
    with pytest.raises(InvalidArgument, match=r"'timeout'.*>= 0.*-5"):
        request_timeout_us(req)


def test_timeout_string_param():
    req = request(features=features(1))
    req.parameters["timeout"].string_param = "100"
    with pytest.raises(InvalidArgument, match=r"'timeout' must be an integer, got string_param"):
        request_timeout_us(req)


# --- priority ---------------------------------------------------------------


def test_priority_absent_uses_model_default():
    assert request_priority(request(features=features(1)), mlp_model(default_priority=2, priority_levels=3)) == 2


def test_priority_absent_and_no_model_default_is_one():
    assert request_priority(request(features=features(1)), mlp_model()) == 1


def test_priority_zero_uses_model_default():
    req = request(features=features(1))
    req.parameters["priority"].uint64_param = 0
    assert request_priority(req, mlp_model(default_priority=3, priority_levels=4)) == 3
    assert request_priority(req, mlp_model()) == 1


@pytest.mark.parametrize("kind", ["int64_param", "uint64_param"])
def test_priority_in_range(kind):
    req = request(features=features(1))
    setattr(req.parameters["priority"], kind, 2)
    assert request_priority(req, mlp_model(default_priority=1, priority_levels=2)) == 2


def test_priority_out_of_range():
    req = request(features=features(1))
    req.parameters["priority"].uint64_param = 3
    with pytest.raises(InvalidArgument) as e:
        request_priority(req, mlp_model(priority_levels=2))
    msg = str(e.value)
    assert "priority 3" in msg and "'mlp'" in msg and "to 2" in msg


def test_priority_unbounded_without_levels():
    req = request(features=features(1))
    req.parameters["priority"].uint64_param = 7
    assert request_priority(req, mlp_model()) == 7


def test_priority_negative():
    req = request(features=features(1))
    req.parameters["priority"].int64_param = -1
    with pytest.raises(InvalidArgument, match="'priority'"):
        request_priority(req, mlp_model(priority_levels=2))


def test_priority_must_be_an_integer():
    req = request(features=features(1))
    req.parameters["priority"].double_param = 1.0
    with pytest.raises(InvalidArgument, match="'priority' must be an integer"):
        request_priority(req, mlp_model(priority_levels=2))


# --- errors.py ----------------------------------------------------------------

ERROR_CLASSES = [
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.Internal, grpc.StatusCode.INTERNAL),
]


@pytest.mark.parametrize("cls, code", ERROR_CLASSES, ids=[c.__name__ for c, _ in ERROR_CLASSES])
def test_error_maps_to_its_grpc_code(cls, code):
    err = cls("boom")
    assert isinstance(err, errors.BatchlineError)
    assert errors.grpc_status(err) is code
    assert errors.status_value(err) == code.value[0]


@pytest.mark.parametrize("cls, code", ERROR_CLASSES, ids=[c.__name__ for c, _ in ERROR_CLASSES])
def test_error_round_trips_through_status_value(cls, code):
    back = errors.from_status_value(errors.status_value(cls("x")), "the message")
    assert type(back) is cls
    assert str(back) == "the message"


def test_every_error_class_is_named_after_its_code():
    # Guards against a new class being added without a mapping (it would become INTERNAL).
    subclasses = errors.BatchlineError.__subclasses__()
    assert {c for c, _ in ERROR_CLASSES} <= set(subclasses)
    for cls in subclasses:
        code_name = re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).upper()
        assert errors.grpc_status(cls("m")) is getattr(grpc.StatusCode, code_name)


def test_unmapped_errors_are_internal():
    assert errors.grpc_status(ValueError("x")) is grpc.StatusCode.INTERNAL
    assert errors.grpc_status(errors.BatchlineError("x")) is grpc.StatusCode.INTERNAL
    assert type(errors.from_status_value(grpc.StatusCode.ABORTED.value[0], "m")) is errors.Internal


def test_error_subclass_inherits_parent_code():
    class TooBig(errors.ResourceExhausted):
        pass

    assert errors.grpc_status(TooBig("x")) is grpc.StatusCode.RESOURCE_EXHAUSTED


def test_priority_without_levels_is_capped_above_the_over_share_levels():
    # Clients ask for 1 to 450: 451 to 900 are where a tenant over its share queues, below them all.
    req = request(features=features(1))
    req.parameters["priority"].uint64_param = 450
    assert request_priority(req, mlp_model()) == 450
    for huge in (451, 900, 2**32, 2**64 - 1):
        req.parameters["priority"].uint64_param = huge
        with pytest.raises(InvalidArgument, match="levels are 1 \\(highest\\) to 450"):
            request_priority(req, mlp_model())


def test_a_model_may_not_declare_the_over_share_levels_its_clients():
    from executor.model_config import ConfigError, check_model_config

    assert check_model_config({"priority_levels": 450}, "here")["priority_levels"] == 450
    with pytest.raises(ConfigError, match="priority_levels must be at most 450"):
        check_model_config({"priority_levels": 451}, "here")
    with pytest.raises(ConfigError, match="default_priority 600 is past the 450 levels"):
        check_model_config({"default_priority": 600}, "here")


@pytest.mark.parametrize("name, ok", [
    ("mlp", True), ("team-a.model_2", True), ("", False), (".", False), ("..", False),
    ("team-a-x/../team-b", False), ("a\\b", False), ("a:b", False), ("a\0b", False), ("x" * 256, False),
])
def test_a_models_name_is_one_directory_of_the_repository(name, ok):
    from batchline.registry import model_name_problem

    assert (model_name_problem(name) is None) == ok


def test_inputs_padded_together_must_have_one_shape():
    """ids of 7 tokens with a mask of 3: alone ONNX Runtime refuses it, batched a neighbour's length
    would pad the mask and answer it. Refused at the door, so it fails the same either way."""
    model = pair_model()
    model.padded_inputs.extend(["input_ids", "attention_mask"])
    ok = request("pair", input_ids=np.ones((1, 7), np.int64), attention_mask=np.ones((1, 7), np.int64))
    assert validate(ok, model) == 1
    bad = request("pair", input_ids=np.ones((1, 7), np.int64), attention_mask=np.ones((1, 3), np.int64))
    with pytest.raises(InvalidArgument, match="pads \\['attention_mask', 'input_ids'\\] together: they must have one"):
        validate(bad, model)
    assert validate(bad, pair_model()) == 1  # unpadded, the model itself judges its inputs
    # Features [B, T, 80] padded with their mask [B, T]: compared along T only.
    audio = pb.ModelInfo(name="audio", version="1", max_batch_size=8, padded_inputs=["features", "mask"],
                         inputs=[pb.TensorSpec(name="features", datatype="FP32", shape=[-1, -1, 80]),
                                 pb.TensorSpec(name="mask", datatype="INT64", shape=[-1, -1])],
                         outputs=[pb.TensorSpec(name="y", datatype="FP32", shape=[-1, 4])])
    ok = request("audio", features=np.zeros((1, 7, 80), np.float32), mask=np.ones((1, 7), np.int64))
    assert validate(ok, audio) == 1
    with pytest.raises(InvalidArgument, match="one length along the axes they share"):
        validate(request("audio", features=np.zeros((1, 7, 80), np.float32), mask=np.ones((1, 5), np.int64)),
                 audio)
