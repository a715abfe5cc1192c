"""The REST body parser on its own (gateway/rest_tensors.py): whatever a client sends, the answer
is a ModelInferRequest or InvalidArgument naming the problem, never another exception (which the
REST port would answer 500). Pure units, with hypothesis."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchline.errors import InvalidArgument
from batchline.protocol import inference_pb2 as ipb
from gateway.rest_tensors import OutputChoice, infer_request, infer_response

DATATYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64",
             "BYTES", "BF16", "", None, 3]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20)


@st.composite
def bodies(draw) -> tuple[bytes, int | None]:
    tensors = draw(st.lists(st.fixed_dictionaries({
        "name": st.sampled_from(["a", "b", 1]),
        "datatype": st.sampled_from(DATATYPES),
        "shape": st.one_of(st.lists(st.integers(-1, 4), max_size=3), json_values),
    }, optional={
        "data": json_values,
        "parameters": st.one_of(st.fixed_dictionaries({"binary_data_size": st.integers(-2, 40)}), json_values),
    }), max_size=3))
    header = {"inputs": tensors}
    for key in ("id", "parameters"):
        if draw(st.booleans()):
            header[key] = draw(json_values)
    if draw(st.booleans()):
        header["outputs"] = draw(st.one_of(json_values, st.lists(st.fixed_dictionaries(
            {"name": st.sampled_from(["y", 2])}, optional={"parameters": json_values}), max_size=2)))
    text = json.dumps(header).encode()
    binary = draw(st.binary(max_size=64))
    length = draw(st.sampled_from([len(text), None, len(text) + len(binary) + 1, max(0, len(text) - 3)]))
    return text + binary, length


@settings(max_examples=400, deadline=None)
@given(bodies())
def test_any_body_parses_or_is_invalid_argument(body):
    data, length = body
    try:
        request, choice = infer_request(data, length, "m", "")
    except InvalidArgument as exc:
        assert str(exc)
        return
    assert len(request.raw_input_contents) == len(request.inputs)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200), st.one_of(st.none(), st.integers(0, 300)))
def test_any_bytes_parse_or_are_invalid_argument(data, length):
    try:
        infer_request(data, length, "m", "")
    except InvalidArgument:
        pass


@pytest.mark.parametrize("header", [
    {"inputs": [], "outputs": [{"name": "y", "parameters": [1]}]},
    {"inputs": [], "outputs": [{"name": "y", "parameters": {"binary_data": {"a": 1}}}]},
    {"inputs": [], "parameters": {"priority": [1]}},
])
def test_parameters_that_are_no_object_or_value_are_invalid_argument(header):
    with pytest.raises(InvalidArgument):
        infer_request(json.dumps(header).encode(), None, "m", "")


@pytest.mark.parametrize("value", [2**64, -2**63 - 1])
def test_an_integer_parameter_past_64_bits_is_invalid_argument(value):
    with pytest.raises(InvalidArgument, match=f"'timeout': {value} does not fit a 64-bit integer"):
        infer_request(json.dumps({"inputs": [], "parameters": {"timeout": value}}).encode(), None, "m", "")
    infer_request(json.dumps({"inputs": [], "parameters": {"timeout": value // 2}}).encode(), None, "m", "")


def test_an_unsigned_64_bit_parameter_is_carried_as_grpc_carries_it():
    request, _ = infer_request(json.dumps({"inputs": [], "parameters": {"sequence_id": 2**63}}).encode(),
                               None, "m", "")
    assert request.parameters["sequence_id"].uint64_param == 2**63


@pytest.mark.parametrize("body, says", [
    (b'{"id": "\\ud800", "inputs": []}', "not valid Unicode"),
    (b'{"inputs": [{"name": "x\\udc00", "datatype": "FP32", "shape": [1], "data": [1]}]}', "not valid Unicode"),
    (b'{"parameters": {"k": "\\ud800"}, "inputs": []}', "not valid Unicode"),
    (b'{"inputs": [{"name": "x", "datatype": [], "shape": [1], "data": [1]}]}', "`datatype` must be one of"),
    (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [9223372036854775808], "data": [1]}]}',
     r"integers from 0 to 2\^63 - 1"),
    (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1], '
     b'"parameters": {"shared_memory_region": "r"}}]}', "the REST port serves no shared memory"),
    (b'{"inputs": [], "outputs": [{"name": "y", "parameters": {"shared_memory_byte_size": 4}}]}',
     "the REST port serves no shared memory"),
])
def test_what_no_protobuf_or_rest_port_can_carry_is_invalid_argument(body, says):
    with pytest.raises(InvalidArgument, match=says):
        infer_request(body, None, "m", "")


def test_deep_nesting_is_invalid_argument():
    with pytest.raises(InvalidArgument, match="not valid JSON"):
        infer_request(b"[" * 100_000, None, "m", "")


@pytest.mark.parametrize("datatype,values", [
    ("FP16", [0.5, -2.0, 65504.0]), ("FP32", [1.5, -0.0, 2.0**100]), ("UINT64", [0, 2**64 - 1, 7]),
    ("INT8", [-128, 127, 0]), ("BOOL", [True, False, True]), ("BYTES", ["héllo", "", "\u0000x"]),
])
def test_json_data_and_binary_answers_round_trip(datatype, values):
    header = {"inputs": [{"name": "x", "shape": [1, 3], "datatype": datatype, "data": [values]}]}
    request, _ = infer_request(json.dumps(header).encode(), None, "m", "")
    response = ipb.ModelInferResponse(model_name="m", model_version="1", outputs=[
        ipb.ModelInferResponse.InferOutputTensor(name="y", datatype=datatype, shape=[1, 3])],
        raw_output_contents=list(request.raw_input_contents))
    as_json, length = infer_response(response, OutputChoice())
    assert length is None and json.loads(as_json)["outputs"][0]["data"] == values
    as_binary, length = infer_response(response, OutputChoice(by_name={"y": True}))
    assert as_binary[length:] == request.raw_input_contents[0]
    if datatype not in ("BYTES", "BOOL"):
        dtype = {"FP16": "<f2", "FP32": "<f4", "UINT64": "<u8", "INT8": "<i1"}[datatype]
        assert np.frombuffer(as_binary[length:], dtype).tolist() == values


@pytest.mark.parametrize("datatype, value", [("FP16", 70000.0), ("FP32", 1e39)])
def test_a_float_past_its_types_range_in_json_is_refused_not_made_infinite(datatype, value):
    body = json.dumps({"inputs": [{"name": "x", "datatype": datatype, "shape": [2], "data": [1.0, value]}]})
    with pytest.raises(InvalidArgument, match=f"out of the range of {datatype}"):
        infer_request(body.encode(), None, "m", "")
    ok = json.dumps({"inputs": [{"name": "x", "datatype": datatype, "shape": [1], "data": [1.5]}]})
    request, _ = infer_request(ok.encode(), None, "m", "")
    assert np.frombuffer(request.raw_input_contents[0], np.float16 if datatype == "FP16" else np.float32) == 1.5


def _one_input(**extra) -> bytes:
    return json.dumps({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1.0]}], **extra}).encode()


@pytest.mark.parametrize("extra, says", [
    ({"parameters": []}, "`parameters` must be an object"),
    ({"parameters": 0}, "`parameters` must be an object"),
    ({"outputs": {}}, "`outputs` must be an array"),
    ({"outputs": ""}, "`outputs` must be an array"),
])
def test_a_field_of_the_wrong_type_is_refused_even_when_empty(extra, says):
    with pytest.raises(InvalidArgument, match=says):
        infer_request(_one_input(**extra), None, "m", "")
    # Missing or null is the default.
    infer_request(_one_input(parameters=None, outputs=None), None, "m", "")


def test_a_bytes_element_that_is_not_text_is_refused_at_the_door():
    body = json.dumps({"inputs": [{"name": "s", "datatype": "BYTES", "shape": [1], "data": ["\ud800"]}]}).encode()
    with pytest.raises(InvalidArgument, match="lone surrogate"):
        infer_request(body, None, "m", "")


def test_an_error_shows_at_most_80_characters_of_what_the_client_sent():
    body = json.dumps({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1.0],
                                   "parameters": {"p": list(range(100_000))}}]}).encode()
    with pytest.raises(InvalidArgument) as info:
        infer_request(body, None, "m", "")
    assert "must be a boolean, a number or a string" in str(info.value) and len(str(info.value)) < 300
