"""KServe v2 tensors <-> numpy arrays.

Both wire forms are accepted: `raw_input_contents` (little-endian, row-major;
BYTES elements as a 4-byte little-endian length followed by the bytes) and
the typed `contents` fields. Outputs are always written raw, as Triton does.
"""
from __future__ import annotations

import functools
import struct
from typing import Mapping, Sequence

import numpy as np

from batchline.errors import InvalidArgument

# KServe datatype -> numpy dtype (explicitly little-endian for the wire).
DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype("bool"),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "BYTES": np.dtype("object"),
}

# Which typed-contents field carries each datatype (FP16 has none: raw only).
CONTENTS_FIELD: dict[str, str] = {
    "BOOL": "bool_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}

_ONNX_TO_DATATYPE = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
}


def onnx_datatype(onnx_type: str) -> str:
    try:
        return _ONNX_TO_DATATYPE[onnx_type]
    except KeyError:
        raise ValueError(f"ONNX type {onnx_type} has no KServe datatype") from None


def numpy_datatype(dtype: np.dtype) -> str:
    # Asked for every output of every answer: a dtype's answer is looked up once.
    return _numpy_datatype(dtype)


@functools.lru_cache(maxsize=64)
def _numpy_datatype(dtype: np.dtype) -> str:
    if dtype.kind in "OUS":
        return "BYTES"
    for name, dt in DATATYPES.items():
        if name != "BYTES" and dt == dtype.newbyteorder("<"):
            return name
    raise ValueError(f"numpy dtype {dtype} has no KServe datatype")


def element_count(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def serialize_bytes(array: np.ndarray) -> bytes:
    parts = []
    for item in array.reshape(-1):
        if isinstance(item, str):
            item = item.encode("utf-8")
        elif not isinstance(item, (bytes, bytearray)):
            item = str(item).encode("utf-8")
        parts.append(struct.pack("<I", len(item)))
        parts.append(bytes(item))
    return b"".join(parts)


def deserialize_bytes(buffer: bytes, count: int, name: str) -> np.ndarray:
    items = []
    offset, size = 0, len(buffer)
    while offset < size:
        if offset + 4 > size:
            raise InvalidArgument(f"input '{name}': BYTES data is truncated inside a length prefix at byte {offset}")
        if len(items) == count:
            # More than the shape holds: refused now, not after walking what may be millions of elements.
            raise InvalidArgument(f"input '{name}': shape needs {count} BYTES elements, the data holds more than "
                                  f"{count} ({size - offset} bytes past the last)")
        (length,) = struct.unpack_from("<I", buffer, offset)
        offset += 4
        if offset + length > size:
            raise InvalidArgument(
                f"input '{name}': BYTES element {len(items)} declares {length} bytes but only {size - offset} remain"
            )
        items.append(bytes(buffer[offset : offset + length]))
        offset += length
    if len(items) != count:
        raise InvalidArgument(f"input '{name}': shape needs {count} BYTES elements, the data holds {len(items)}")
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out


def onnx_strings(array: np.ndarray, name: str) -> np.ndarray:
    """BYTES elements as the str objects ONNX Runtime string tensors need.

    ONNX strings are UTF-8; ONNX Runtime would turn a bytes object into the
    text of its repr (b'...') rather than refuse it.
    """
    out = np.empty(array.shape, dtype=object)
    flat_in, flat_out = array.reshape(-1), out.reshape(-1)
    for i, item in enumerate(flat_in):
        if isinstance(item, (bytes, bytearray)):
            try:
                item = bytes(item).decode("utf-8")
            except UnicodeDecodeError:
                raise InvalidArgument(
                    f"input '{name}': BYTES element {i} is not valid UTF-8, which ONNX string tensors require"
                ) from None
        flat_out[i] = item
    return out


def check_raw_size(name: str, datatype: str, shape: Sequence[int], size: int) -> None:
    """InvalidArgument unless `size` raw bytes are what a fixed-size `datatype` of `shape` takes."""
    dtype = DATATYPES.get(datatype)
    if dtype is None or datatype == "BYTES":
        raise InvalidArgument(f"input '{name}': datatype '{datatype}' has no fixed size")
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"input '{name}': shape {list(shape)} has a negative dimension")
    expected = element_count(shape) * dtype.itemsize
    if size != expected:
        raise InvalidArgument(f"input '{name}': {datatype} shape {list(shape)} needs {expected} bytes, got {size}")


def decode_tensor(name: str, datatype: str, shape: Sequence[int], raw: bytes | None, contents) -> np.ndarray:
    """Decode one input tensor, checking that the data matches the shape.

    `raw` is its `raw_input_contents` entry (None when the request uses typed
    contents); `contents` is its `InferTensorContents`.
    """
    dtype = DATATYPES.get(datatype)
    if dtype is None:
        raise InvalidArgument(f"input '{name}': unknown datatype '{datatype}'")
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"input '{name}': shape {list(shape)} has a negative dimension")
    count = element_count(shape)
    if raw is not None:
        if datatype == "BYTES":
            flat = deserialize_bytes(raw, count, name)
        else:
            check_raw_size(name, datatype, shape, len(raw))
            flat = np.frombuffer(raw, dtype=dtype)
            if datatype == "BOOL" and flat.size and flat.view(np.uint8).max() > 1:
                # numpy reads any non-zero byte as True, ONNX Runtime's operators do not (Not of 2 is
                # true, Cast of it 2): a byte that is no bool would answer differently from its value.
                raise InvalidArgument(f"input '{name}': BOOL raw bytes must be 0 or 1, got "
                                      f"{int(flat.view(np.uint8).max())}")
        return _shaped(flat, shape, name)
    field = CONTENTS_FIELD.get(datatype)
    if field is None:
        raise InvalidArgument(f"input '{name}': {datatype} can only be sent in raw_input_contents")
    values = getattr(contents, field)
    if len(values) != count:
        raise InvalidArgument(
            f"input '{name}': shape {list(shape)} needs {count} values in contents.{field}, got {len(values)}"
        )
    if datatype == "BYTES":
        flat = np.empty(count, dtype=object)
        flat[:] = list(values)
    else:
        try:
            flat = np.array(values, dtype=dtype)
        except OverflowError:
            raise InvalidArgument(f"input '{name}': a value in contents.{field} does not fit {datatype}") from None
        if dtype.kind in "iu" and len(values) and datatype not in ("INT64", "UINT64"):
            # int_contents/uint_contents are 32-bit on the wire: narrow types must not wrap silently.
            wide = np.array(values, dtype=np.int64)
            if not np.array_equal(wide, flat.astype(np.int64)):
                raise InvalidArgument(f"input '{name}': a value in contents.{field} does not fit {datatype}")
    return _shaped(flat, shape, name)


def _shaped(flat: np.ndarray, shape: Sequence[int], name: str) -> np.ndarray:
    try:
        return flat.reshape(tuple(shape))
    except ValueError:  # a dimension past what numpy indexes ([1, 0, 2**62]: no elements, yet too big)
        raise InvalidArgument(f"input '{name}': shape {list(shape)} is too large to hold") from None


def encode_array(array: np.ndarray) -> tuple[str, list[int], bytes]:
    """(datatype, shape, raw bytes) of an output array."""
    datatype = numpy_datatype(array.dtype)
    if datatype == "BYTES":
        raw = serialize_bytes(array)
    else:
        raw = np.ascontiguousarray(array, dtype=DATATYPES[datatype]).tobytes()
    return datatype, list(array.shape), raw


def decode_inputs(request, given: Mapping[str, np.ndarray | None] | None = None) -> dict[str, np.ndarray]:
    """Every input of a ModelInferRequest as an array, checking data against shapes; those in
    `given` (read from shared memory, batchline/regions.py) are taken from it instead."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidArgument(
            f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs; "
            "send every input raw or none"
        )
    arrays: dict[str, np.ndarray] = {}
    for i, tensor in enumerate(request.inputs):
        if tensor.name in arrays:
            raise InvalidArgument(f"input '{tensor.name}' appears more than once")
        if given is not None and tensor.name in given:
            arrays[tensor.name] = given[tensor.name]  # type: ignore[assignment]
            continue
        arrays[tensor.name] = decode_tensor(
            tensor.name, tensor.datatype, list(tensor.shape), raw[i] if raw else None, tensor.contents
        )
    return arrays
