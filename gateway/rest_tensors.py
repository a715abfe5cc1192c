"""The REST port's inference bodies <-> ModelInferRequest and ModelInferResponse.

A request body is a JSON header, optionally followed by the binary tensor data of Triton's binary
tensor data extension (`Inference-Header-Content-Length` says where the JSON ends, each binary
input's `binary_data_size` how many bytes of the rest are its). Every input becomes
`raw_input_contents`, so the request continues exactly as a gRPC one does. Outputs go back as JSON
`data`, or as binary (asked for by the `binary_data_output` request parameter or an output's
`binary_data` parameter) after the JSON header.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

import numpy as np

from batchline.codec import DATATYPES, element_count
from batchline.errors import InvalidArgument
from batchline.protocol import inference_pb2 as ipb

# Parameters of the binary extension: they shape the HTTP body and are not passed along.
_BINARY_OUTPUT = "binary_data_output"
_BINARY = "binary_data"
_BINARY_SIZE = "binary_data_size"
# Triton's system shared memory parameters: the REST port serves no shared memory (its regions are
# registered and answered on the gRPC port), so a REST request that names them is refused.
_SHARED_MEMORY = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")
_MAX_DIM = 2**63 - 1  # a dimension is an int64 on the wire


@dataclass
class OutputChoice:
    """Which outputs the client wants back as binary rather than JSON `data`."""
    default: bool = False
    by_name: dict[str, bool] = field(default_factory=dict)

    def binary(self, name: str) -> bool:
        return self.by_name.get(name, self.default)


def set_parameter(parameters, name: str, value) -> None:
    """A JSON parameter value into an InferParameter map."""
    param = parameters[name]
    if isinstance(value, bool):
        param.bool_param = value
    elif isinstance(value, int):
        if -2**63 <= value < 2**63:
            param.int64_param = value
        elif 2**63 <= value < 2**64:
            param.uint64_param = value  # as gRPC carries it (sequence_id, for one)
        else:
            raise InvalidArgument(f"parameter '{name}': {value} does not fit a 64-bit integer")
    elif isinstance(value, float):
        param.double_param = value
    elif isinstance(value, str):
        param.string_param = value
    else:
        raise InvalidArgument(f"parameter '{name}' must be a boolean, a number or a string, got {shown(value)}")


def given(obj: dict, key: str, default):
    """`obj[key]`, or `default` where it is missing or null (any other value is checked by the caller:
    an empty list where an object belongs is wrong, not absent)."""
    value = obj.get(key)
    return default if value is None else value


def shown(value, most: int = 80) -> str:
    """A client's value as JSON in an error message, cut to `most` characters."""
    text = json.dumps(value)
    return text if len(text) <= most else text[:most - 3] + "..."


def parameter_value(param: ipb.InferParameter):
    kind = param.WhichOneof("parameter_choice")
    return getattr(param, kind) if kind else None


def _flag(value, what: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgument(f"{what} must be true or false, got {shown(value)}")
    return value


def _json_header(body: bytes, header_length: int | None) -> tuple[dict, memoryview]:
    if header_length is None:
        header_length = len(body)
    elif header_length > len(body):
        raise InvalidArgument(f"the Inference-Header-Content-Length header says the JSON header is {header_length} "
                              f"bytes, but the whole body is {len(body)} bytes")
    try:
        header = json.loads(body[:header_length])
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError; RecursionError: too deep
        hint = " (is Inference-Header-Content-Length right?)" if header_length < len(body) else ""
        raise InvalidArgument(f"the request's JSON header is not valid JSON{hint}: {exc}") from None
    if not isinstance(header, dict):
        raise InvalidArgument("the request's JSON header must be an object with an `inputs` array")
    return header, memoryview(body)[header_length:]


def _bytes_elements(values: list, name: str, field: str) -> bytes:
    out = bytearray()
    for v in values:
        if not isinstance(v, str):
            raise InvalidArgument(f"input '{name}' is BYTES: each element of {field} must be a string, "
                                  f"got {shown(v)}")
        try:
            b = v.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgument(f"input '{name}': an element of {field} is not text (it holds a lone surrogate, "
                                  f"{shown(v)}): send bytes that are not text as binary data") from None
        out += struct.pack("<I", len(b)) + b
    return bytes(out)


def _flatten(data, name: str) -> list:
    if not isinstance(data, list):
        return [data]
    flat: list = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            flat.append(item)
        else:
            stack.pop()
    return flat


def _json_data(tensor: dict, name: str, datatype: str, shape: list[int]) -> bytes:
    if "data" not in tensor:
        raise InvalidArgument(f"input '{name}' has neither `data` nor a `binary_data_size` parameter")
    values = _flatten(tensor["data"], name)
    count = element_count(shape)
    if len(values) != count:
        raise InvalidArgument(f"input '{name}' has {len(values)} values in `data`, but its shape {shape} holds {count}")
    return json_tensor(values, name, datatype)


def json_tensor(values: list, name: str, datatype: str, field: str = "`data`") -> bytes:
    """JSON values (flat) as an input's raw contents of `datatype`; InvalidArgument naming what is
    wrong, and where: `field`, the JSON that held them."""
    if datatype == "BYTES":
        return _bytes_elements(values, name, field)
    dtype = DATATYPES[datatype]
    if datatype == "BOOL":
        if not all(isinstance(v, bool) for v in values):
            raise InvalidArgument(f"input '{name}' is BOOL: {field} must hold true or false")
    elif dtype.kind in "iu" and not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise InvalidArgument(f"input '{name}' is {datatype}: {field} must hold integers")
    elif dtype.kind == "f" and not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise InvalidArgument(f"input '{name}' is {datatype}: {field} must hold numbers")
    try:
        # A float past the type's range would otherwise become infinity, with only a warning.
        with np.errstate(over="raise"):
            return np.array(values, dtype=dtype).tobytes()
    except (OverflowError, FloatingPointError):
        raise InvalidArgument(f"input '{name}': a value of {field} is out of the range of {datatype}") from None


def _shape(tensor: dict, name: str) -> list[int]:
    shape = tensor.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= _MAX_DIM
                                              for d in shape):
        raise InvalidArgument(f"input '{name}': `shape` must be an array of integers from 0 to 2^63 - 1")
    return shape


def _no_shared_memory(parameters: dict, what: str) -> None:
    named = [k for k in _SHARED_MEMORY if k in parameters]
    if named:
        raise InvalidArgument(f"{what}: parameter '{named[0]}': the REST port serves no shared memory; register "
                              "regions and send the requests that use them on the gRPC port")


def infer_request(body: bytes, header_length: int | None, model: str,
                  version: str) -> tuple[ipb.ModelInferRequest, OutputChoice]:
    """The ModelInferRequest of a REST infer body (InvalidArgument naming what is wrong), and
    which outputs go back binary."""
    header, binary = _json_header(body, header_length)
    try:
        return _request(header, binary, model, version)
    except UnicodeEncodeError:
        # JSON may carry a lone surrogate (\ud800), which no protobuf string holds.
        raise InvalidArgument("the request's JSON header holds a string that is not valid Unicode (a lone "
                              "surrogate escape such as \\ud800) in an id, a name or a parameter") from None


def _request(header: dict, binary: memoryview, model: str, version: str) -> tuple[ipb.ModelInferRequest, OutputChoice]:
    request = ipb.ModelInferRequest(model_name=model, model_version=version)
    if "id" in header:
        if not isinstance(header["id"], str):
            raise InvalidArgument("`id` must be a string")
        request.id = header["id"]
    choice = OutputChoice()
    parameters = given(header, "parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidArgument("`parameters` must be an object")
    for key, value in parameters.items():
        if key == _BINARY_OUTPUT:
            choice.default = _flag(value, f"parameter '{_BINARY_OUTPUT}'")
        else:
            set_parameter(request.parameters, key, value)
    _inputs(request, header.get("inputs"), binary)
    _outputs(request, given(header, "outputs", []), choice)
    return request, choice


def _inputs(request: ipb.ModelInferRequest, inputs, binary) -> None:
    """The header's `inputs` onto `request`, each one's data from JSON or from its slice of `binary`."""
    if not isinstance(inputs, list) or not all(isinstance(t, dict) for t in inputs):
        raise InvalidArgument("the request's JSON header needs `inputs`: an array of tensors")
    offset = 0
    for tensor in inputs:
        name = tensor.get("name")
        if not isinstance(name, str):
            raise InvalidArgument("every input needs a `name` (a string)")
        datatype = tensor.get("datatype")
        if not isinstance(datatype, str) or datatype not in DATATYPES:
            raise InvalidArgument(f"input '{name}': `datatype` must be one of {sorted(DATATYPES)}, "
                                  f"got {shown(datatype)}")
        shape = _shape(tensor, name)
        entry = request.inputs.add(name=name, datatype=datatype, shape=shape)
        tensor_parameters = given(tensor, "parameters", {})
        if not isinstance(tensor_parameters, dict):
            raise InvalidArgument(f"input '{name}': `parameters` must be an object")
        _no_shared_memory(tensor_parameters, f"input '{name}'")
        size = None
        for key, value in tensor_parameters.items():
            if key == _BINARY_SIZE:
                size = value
            else:
                set_parameter(entry.parameters, key, value)
        if size is None:
            request.raw_input_contents.append(_json_data(tensor, name, datatype, shape))
            continue
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise InvalidArgument(f"input '{name}': `binary_data_size` must be an integer >= 0")
        if offset + size > len(binary):
            raise InvalidArgument(
                f"input '{name}' declares {size} bytes of binary data at offset {offset}, but the body has only "
                f"{len(binary)} bytes after the JSON header: the binary section is shorter than declared")
        request.raw_input_contents.append(bytes(binary[offset:offset + size]))
        offset += size
    if offset != len(binary):
        raise InvalidArgument(f"the body has {len(binary)} bytes after the JSON header, but the inputs' "
                              f"`binary_data_size` add up to {offset} (is Inference-Header-Content-Length right?)")


def _outputs(request: ipb.ModelInferRequest, outputs, choice: OutputChoice) -> None:
    """The header's `outputs` onto `request`, and which of them go back binary into `choice`."""
    if not isinstance(outputs, list) or not all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                                for t in outputs):
        raise InvalidArgument("`outputs` must be an array of objects, each with a `name`")
    for tensor in outputs:
        entry = request.outputs.add(name=tensor["name"])
        tensor_parameters = given(tensor, "parameters", {})
        if not isinstance(tensor_parameters, dict):
            raise InvalidArgument(f"output '{entry.name}': `parameters` must be an object")
        _no_shared_memory(tensor_parameters, f"output '{entry.name}'")
        for key, value in tensor_parameters.items():
            if key == _BINARY:
                choice.by_name[entry.name] = _flag(value, f"output '{entry.name}': parameter '{_BINARY}'")
            else:
                set_parameter(entry.parameters, key, value)


def _json_values(raw: bytes, datatype: str, name: str) -> list:
    if datatype != "BYTES":
        return np.frombuffer(raw, dtype=DATATYPES[datatype]).tolist()
    values, offset = [], 0
    while offset < len(raw):
        (n,) = struct.unpack_from("<I", raw, offset)
        element = raw[offset + 4:offset + 4 + n]
        offset += 4 + n
        try:
            values.append(element.decode("utf-8"))
        except UnicodeDecodeError:
            raise InvalidArgument(f"output '{name}' holds bytes that are not UTF-8, which JSON cannot carry: "
                                  "ask for it as binary (`binary_data`)") from None
    return values


def infer_response(response: ipb.ModelInferResponse, choice: OutputChoice) -> tuple[bytes, int | None]:
    """The REST body of an answer, and the length of its JSON header when binary data follows."""
    header: dict = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id:
        header["id"] = response.id
    if response.parameters:
        header["parameters"] = {k: parameter_value(v) for k, v in response.parameters.items()}
    outputs, binary = [], []
    for tensor, raw in zip(response.outputs, response.raw_output_contents):
        entry = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
        if choice.binary(tensor.name):
            entry["parameters"] = {_BINARY_SIZE: len(raw)}
            binary.append(raw)
        else:
            entry["data"] = _json_values(raw, tensor.datatype, tensor.name)
        outputs.append(entry)
    header["outputs"] = outputs
    text = json.dumps(header, separators=(",", ":")).encode()
    if not binary:
        return text, None
    return b"".join([text, *binary]), len(text)
