"""Unit tests for batchline/codec.py: KServe v2 tensors <-> numpy arrays."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from batchline.codec import (
    CONTENTS_FIELD,
    DATATYPES,
    decode_inputs,
    decode_tensor,
    encode_array,
    onnx_datatype,
    serialize_bytes,
)
from batchline.errors import InvalidArgument
from batchline.protocol import inference_pb2 as ipb

SHAPE = [2, 3]


def sample(datatype: str) -> np.ndarray:
    """A 2x3 array of `datatype` with values that exercise its range."""
    if datatype == "BYTES":
        arr = np.empty(6, dtype=object)
        arr[:] = [b"", b"a", "h\u00e9llo".encode(), b"\x00\xff", b"xyz" * 10, "\u65e5\u672c".encode()]
        return arr.reshape(SHAPE)
    dtype = DATATYPES[datatype]
    if datatype == "BOOL":
        return np.array([[True, False, True], [False, False, True]])
    if dtype.kind == "f":
        return np.array([[0.0, -1.5, 3.25], [1e3, -0.0, 0.125]], dtype=dtype)
    info = np.iinfo(dtype)
    return np.array([[info.min, info.max, 0], [1, info.max - 1, info.min + 1]], dtype=dtype)


def assert_same(decoded: np.ndarray, original: np.ndarray, datatype: str) -> None:
    assert decoded.shape == original.shape
    assert decoded.dtype == DATATYPES[datatype]
    assert decoded.tolist() == original.tolist()


# --- round trips -------------------------------------------------------------


@pytest.mark.parametrize("datatype", sorted(DATATYPES))
def test_raw_round_trip(datatype):
    arr = sample(datatype)
    dt, shape, raw = encode_array(arr)
    assert dt == datatype
    assert shape == SHAPE
    if datatype != "BYTES":
        assert len(raw) == 6 * DATATYPES[datatype].itemsize
    decoded = decode_tensor("in0", dt, shape, raw, None)
    assert_same(decoded, arr, datatype)


def test_contents_field_covers_every_datatype_but_fp16():
    assert set(CONTENTS_FIELD) == set(DATATYPES) - {"FP16"}


@pytest.mark.parametrize("datatype", sorted(CONTENTS_FIELD))
def test_typed_contents_round_trip(datatype):
    arr = sample(datatype)
    contents = ipb.InferTensorContents()
    getattr(contents, CONTENTS_FIELD[datatype]).extend(arr.reshape(-1).tolist())
    decoded = decode_tensor("in0", datatype, SHAPE, None, contents)
    assert_same(decoded, arr, datatype)


def test_raw_little_endian_layout():
    _, _, raw = encode_array(np.array([1, 256], dtype=">i4"))  # big-endian input is normalised
    assert raw == b"\x01\x00\x00\x00\x00\x01\x00\x00"


# --- BYTES wire form ---------------------------------------------------------


def test_bytes_serialisation_is_le_length_prefix_plus_bytes():
    arr = np.array([b"", "h\u00e9".encode(), b"ab"], dtype=object)
    expected = (
        struct.pack("<I", 0)
        + struct.pack("<I", 3) + b"h\xc3\xa9"
        + struct.pack("<I", 2) + b"ab"
    )
    assert serialize_bytes(arr) == expected
    dt, shape, raw = encode_array(arr)
    assert (dt, shape, raw) == ("BYTES", [3], expected)


def test_bytes_round_trip_empty_and_non_ascii():
    originals = [b"", "\u00fcber".encode(), b"", "\U0001f600".encode(), b"plain"]
    arr = np.empty(5, dtype=object)
    arr[:] = originals
    dt, shape, raw = encode_array(arr)
    decoded = decode_tensor("text", dt, shape, raw, None)
    assert decoded.tolist() == originals
    assert decoded.dtype == object


def test_str_arrays_are_sent_as_utf8_bytes():
    dt, shape, raw = encode_array(np.array(["h\u00e9llo", ""]))
    assert dt == "BYTES"
    assert decode_tensor("t", dt, shape, raw, None).tolist() == ["h\u00e9llo".encode(), b""]


# --- rejections --------------------------------------------------------------


def test_wrong_raw_byte_size():
    with pytest.raises(InvalidArgument) as e:
        decode_tensor("features", "FP32", [2, 2], b"\x00" * 12, None)
    msg = str(e.value)
    assert "'features'" in msg and "16" in msg and "12" in msg


def test_truncated_bytes_length_prefix():
    raw = struct.pack("<I", 1) + b"a" + b"\x05\x00"  # second prefix cut after 2 of 4 bytes
    with pytest.raises(InvalidArgument) as e:
        decode_tensor("text", "BYTES", [2], raw, None)
    assert "'text'" in str(e.value)
    assert "truncated" in str(e.value)


def test_bytes_element_longer_than_the_data():
    raw = struct.pack("<I", 10) + b"abc"
    with pytest.raises(InvalidArgument) as e:
        decode_tensor("text", "BYTES", [1], raw, None)
    assert "'text'" in str(e.value) and "10" in str(e.value)


@pytest.mark.parametrize("count", [1, 3])
def test_wrong_bytes_element_count(count):
    raw = serialize_bytes(np.array([b"a", b"b"], dtype=object))
    with pytest.raises(InvalidArgument) as e:
        decode_tensor("text", "BYTES", [count], raw, None)
    msg = str(e.value)
    assert "'text'" in msg and f"needs {count}" in msg and ("holds 2" if count > 2 else "holds more than 1") in msg


def test_bytes_past_the_shapes_elements_are_refused_without_walking_them():
    raw = b"\x00" * (60 << 20)  # 15.7 M empty elements for a shape of one: walked, seconds on the event loop
    with pytest.raises(InvalidArgument) as e:
        decode_tensor("text", "BYTES", [1, 1], raw, None)
    # Refused at the second element: every byte after the first element's is left unread.
    assert f"holds more than 1 ({len(raw) - 4} bytes past the last)" in str(e.value)


def test_a_shape_too_large_to_hold_is_invalid_argument_not_an_internal_error():
    with pytest.raises(InvalidArgument, match="too large to hold"):
        decode_tensor("x", "FP32", [1, 0, 2**62], b"", None)


def test_wrong_typed_contents_count():
    contents = ipb.InferTensorContents(fp32_contents=[1.0, 2.0, 3.0])
    with pytest.raises(InvalidArgument) as e:
        decode_tensor("features", "FP32", [2, 2], None, contents)
    msg = str(e.value)
    assert "'features'" in msg and "fp32_contents" in msg and "4" in msg and "3" in msg


def test_fp16_in_typed_contents_is_rejected():
    contents = ipb.InferTensorContents(fp32_contents=[1.0, 2.0])
    with pytest.raises(InvalidArgument) as e:
        decode_tensor("half", "FP16", [2], None, contents)
    assert "'half'" in str(e.value) and "raw" in str(e.value)


def test_unknown_datatype():
    with pytest.raises(InvalidArgument) as e:
        decode_tensor("weird", "FP8", [1], b"\x00", None)
    assert "'weird'" in str(e.value) and "FP8" in str(e.value)


@pytest.mark.parametrize("value", [128, -129, 1000])
def test_int8_out_of_range_in_int_contents(value):
    contents = ipb.InferTensorContents(int_contents=[1, value])
    with pytest.raises(InvalidArgument) as e:
        decode_tensor("small", "INT8", [2], None, contents)
    assert "'small'" in str(e.value) and "INT8" in str(e.value)


def test_narrow_unsigned_out_of_range_in_uint_contents():
    contents = ipb.InferTensorContents(uint_contents=[70000])
    with pytest.raises(InvalidArgument) as e:
        decode_tensor("u", "UINT16", [1], None, contents)
    assert "'u'" in str(e.value) and "UINT16" in str(e.value)


def test_negative_dimension_is_rejected():
    with pytest.raises(InvalidArgument) as e:
        decode_tensor("features", "FP32", [-1, 4], b"", None)
    assert "'features'" in str(e.value) and "negative" in str(e.value)


# --- decode_inputs -----------------------------------------------------------


def _raw_request(**arrays: np.ndarray) -> ipb.ModelInferRequest:
    req = ipb.ModelInferRequest(model_name="m")
    for name, arr in arrays.items():
        dt, shape, raw = encode_array(arr)
        req.inputs.add(name=name, datatype=dt, shape=shape)
        req.raw_input_contents.append(raw)
    return req


def test_decode_inputs_all_raw():
    a = np.arange(6, dtype=np.int64).reshape(2, 3)
    b = np.array([[0.5], [1.5]], dtype=np.float32)
    out = decode_inputs(_raw_request(ids=a, score=b))
    assert list(out) == ["ids", "score"]
    np.testing.assert_array_equal(out["ids"], a)
    np.testing.assert_array_equal(out["score"], b)


def test_decode_inputs_typed_contents():
    req = ipb.ModelInferRequest(model_name="m")
    t = req.inputs.add(name="ids", datatype="INT64", shape=[3])
    t.contents.int64_contents.extend([1, 2, 3])
    out = decode_inputs(req)
    assert out["ids"].tolist() == [1, 2, 3]


def test_decode_inputs_raw_count_mismatch():
    req = _raw_request(a=np.zeros(2, np.float32), b=np.zeros(2, np.float32))
    del req.raw_input_contents[1]
    with pytest.raises(InvalidArgument) as e:
        decode_inputs(req)
    assert "raw_input_contents" in str(e.value) and "1" in str(e.value) and "2 inputs" in str(e.value)


def test_decode_inputs_duplicate_name():
    req = _raw_request(a=np.zeros(2, np.float32))
    req.inputs.add(name="a", datatype="FP32", shape=[2])
    req.raw_input_contents.append(np.zeros(2, np.float32).tobytes())
    with pytest.raises(InvalidArgument) as e:
        decode_inputs(req)
    assert "'a'" in str(e.value) and "more than once" in str(e.value)


# --- ONNX datatypes ---------------------------------------------------------


@pytest.mark.parametrize(
    "onnx_type, datatype",
    [
        ("tensor(bool)", "BOOL"),
        ("tensor(uint8)", "UINT8"),
        ("tensor(uint16)", "UINT16"),
        ("tensor(uint32)", "UINT32"),
        ("tensor(uint64)", "UINT64"),
        ("tensor(int8)", "INT8"),
        ("tensor(int16)", "INT16"),
        ("tensor(int32)", "INT32"),
        ("tensor(int64)", "INT64"),
        ("tensor(float16)", "FP16"),
        ("tensor(float)", "FP32"),
        ("tensor(double)", "FP64"),
        ("tensor(string)", "BYTES"),
    ],
)
def test_onnx_datatype(onnx_type, datatype):
    assert onnx_datatype(onnx_type) == datatype
    assert datatype in DATATYPES


@pytest.mark.parametrize("onnx_type", ["tensor(bfloat16)", "tensor(complex64)", "seq(tensor(float))", "float"])
def test_onnx_datatype_unsupported(onnx_type):
    with pytest.raises(ValueError, match="no KServe datatype"):
        onnx_datatype(onnx_type)


def test_bool_raw_bytes_other_than_0_and_1_are_refused():
    """numpy reads byte 2 as True; ONNX Runtime's Not of it is true and its Cast is 2: such a
    byte would be answered as no bool is."""
    from batchline.codec import decode_tensor
    from batchline.errors import InvalidArgument

    assert decode_tensor("b", "BOOL", [3], b"\x01\x00\x01", None).tolist() == [True, False, True]
    with pytest.raises(InvalidArgument, match="BOOL raw bytes must be 0 or 1, got 2"):
        decode_tensor("b", "BOOL", [3], b"\x02\x01\x00", None)
