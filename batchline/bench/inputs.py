"""Request pools: random inputs shaped after a model's metadata, serialized once.

The load generator shares the machine with the server, so every request a
run sends is built and serialized here, before the clock starts: during a
run a request is a bytes object handed to gRPC as is.
"""
from __future__ import annotations

import string
from dataclasses import dataclass, field

import numpy as np
from tritonclient.grpc import service_pb2
from tritonclient.utils import serialize_byte_tensor

# KServe v2 datatype -> numpy dtype of the raw little-endian contents.
_NUMPY = {
    "BOOL": np.bool_,
    "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
    "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
    "FP16": np.float16, "FP32": np.float32, "FP64": np.float64,
}
INTEGER_TYPES = {k for k, v in _NUMPY.items() if np.issubdtype(v, np.integer)}
# Integers default to small non-negative values: valid ids in any vocabulary
# or embedding table; inputs named like masks default to all ones.
DEFAULT_INT_RANGE = (0, 100)
MASK_INT_RANGE = (1, 1)
_WORD_CHARS = np.array(list(string.ascii_lowercase))


class InputError(ValueError):
    """A shape or range option that does not fit the model's inputs."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    datatype: str
    shape: tuple[int, ...]  # -1 = dynamic


@dataclass
class InputOptions:
    """How to fill a model's inputs (the --shape / --int-range / --default-dim / --seq-len flags)."""

    shapes: dict[str, list[int]] = field(default_factory=dict)
    int_ranges: dict[str, tuple[int, int]] = field(default_factory=dict)
    default_dim: int = 16
    seq_len: int | None = None
    # Token-style [batch, seq] inputs: each request's seq length drawn from these (--seq-len-dist).
    seq_lens: list[int] | None = None
    texts: list[str] = field(default_factory=list)  # --texts: one request a sentence, on the text input
    pool_size: int = 64
    seed: int = 0


@dataclass
class RequestPool:
    """Distinct serialized ModelInferRequests, and the concrete shapes they use."""

    requests: list[bytes]
    shapes: dict[str, list[int]]
    rows: int  # batch rows per request (first dim), for reading throughput in samples/s

    def __len__(self) -> int:
        return len(self.requests)


def parse_shape(text: str) -> tuple[str, list[int]]:
    """``NAME=d0,d1,...`` -> (name, dims)."""
    name, sep, dims = text.partition("=")
    try:
        if not sep or not name:
            raise ValueError
        shape = [int(d) for d in dims.split(",")]
    except ValueError:
        raise InputError(f"--shape {text!r}: expected NAME=d0,d1,... (e.g. input_ids=1,128)") from None
    if any(d < 0 for d in shape):
        raise InputError(f"--shape {text!r}: dimensions must be >= 0")
    return name, shape


def parse_seq_len_dist(text: str, seed: int = 0, n: int = 4096) -> list[int]:
    """``L1,L2,...`` (each equally likely) or ``lognormal:MEAN:MAX`` -> lengths to draw from."""
    try:
        if text.startswith("lognormal:"):
            mean, cap = (float(x) for x in text.split(":")[1:])
            if mean < 1 or cap < 1:
                raise ValueError
            # A long tail: sigma 0.8, scaled so that the mean (before the cap) is MEAN.
            sigma = 0.8
            draws = np.random.default_rng(seed).lognormal(np.log(mean) - sigma**2 / 2, sigma, n)
            return [int(min(cap, max(1, round(d)))) for d in draws]
        lengths = [int(x) for x in text.split(",")]
        if not lengths or min(lengths) < 1:
            raise ValueError
        return lengths
    except ValueError:
        raise InputError(f"--seq-len-dist {text!r}: expected L1,L2,... or lognormal:MEAN:MAX "
                         "with values >= 1") from None


def parse_int_range(text: str) -> tuple[str, tuple[int, int]]:
    """``NAME=LO:HI`` (inclusive) -> (name, (lo, hi))."""
    name, sep, rng = text.partition("=")
    try:
        lo, colon, hi = rng.partition(":")
        if not sep or not name or not colon:
            raise ValueError
        bounds = int(lo), int(hi)
    except ValueError:
        raise InputError(f"--int-range {text!r}: expected NAME=LO:HI (e.g. attention_mask=1:1)") from None
    if bounds[0] > bounds[1]:
        raise InputError(f"--int-range {text!r}: LO must be <= HI")
    return name, bounds


def resolve_shape(info: TensorInfo, opts: InputOptions) -> list[int]:
    """The concrete shape sent for one input: --shape if given, else -1 dims filled in."""
    if info.name in opts.shapes:
        shape = list(opts.shapes[info.name])
        if len(shape) != len(info.shape):
            raise InputError(f"--shape {info.name}: the model's input has {len(info.shape)} dims "
                             f"{list(info.shape)}, got {len(shape)}")
        for i, (want, got) in enumerate(zip(info.shape, shape)):
            if want >= 0 and want != got:
                raise InputError(f"--shape {info.name}: dim {i} is fixed to {want} by the model, got {got}")
        return shape
    shape = []
    for i, d in enumerate(info.shape):
        if d >= 0:
            shape.append(d)
        elif i == 0:
            shape.append(1)  # a dynamic first dim is the batch dim: one row per request
        elif opts.seq_len is not None and info.datatype in INTEGER_TYPES and len(info.shape) == 2:
            shape.append(opts.seq_len)  # token-style [batch, seq] inputs
        else:
            shape.append(opts.default_dim)
    return shape


def int_range(info: TensorInfo, opts: InputOptions) -> tuple[int, int]:
    if info.name in opts.int_ranges:
        return opts.int_ranges[info.name]
    return MASK_INT_RANGE if "mask" in info.name.lower() else DEFAULT_INT_RANGE


def random_tensor(info: TensorInfo, shape: list[int], opts: InputOptions, rng: np.random.Generator) -> np.ndarray:
    dt = info.datatype
    if dt == "BYTES":
        # Random lowercase ASCII words of 3-10 letters.
        n = int(np.prod(shape))
        lengths = rng.integers(3, 11, size=n)
        words = ["".join(rng.choice(_WORD_CHARS, size=k)) for k in lengths]
        return np.array([w.encode() for w in words], dtype=np.object_).reshape(shape)
    if dt == "BOOL":
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if dt in INTEGER_TYPES:
        lo, hi = int_range(info, opts)
        info_t = np.iinfo(_NUMPY[dt])
        if lo < info_t.min or hi > info_t.max:
            raise InputError(f"--int-range {info.name}: {lo}:{hi} does not fit {dt}")
        return rng.integers(lo, hi, size=shape, endpoint=True, dtype=_NUMPY[dt])
    if dt in ("FP16", "FP32", "FP64"):
        return rng.standard_normal(size=shape).astype(_NUMPY[dt])
    if dt == "BF16":
        # bfloat16 = the top half of a float32.
        return (rng.standard_normal(size=shape).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    raise InputError(f"input {info.name}: datatype {dt} is not supported by the generator")


def _raw(array: np.ndarray, datatype: str) -> bytes:
    if datatype == "BYTES":
        serialized = serialize_byte_tensor(array)
        return serialized.item() if serialized.size else b""
    return np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<"), copy=False).tobytes()


def check_options(inputs: list[TensorInfo], opts: InputOptions) -> None:
    names = {i.name for i in inputs}
    for flag, given in (("--shape", opts.shapes), ("--int-range", opts.int_ranges)):
        unknown = sorted(set(given) - names)
        if unknown:
            raise InputError(f"{flag}: the model has no input {', '.join(unknown)} "
                             f"(inputs: {', '.join(sorted(names))})")


def build_pool(
    model: str,
    inputs: list[TensorInfo],
    opts: InputOptions,
    *,
    version: str = "",
    budget_ms: float | None = None,
    priority: int = 0,
) -> RequestPool:
    """Pre-serialize `opts.pool_size` distinct requests; the budget travels as the `timeout` parameter (µs)."""
    check_options(inputs, opts)
    rng = np.random.default_rng(opts.seed)
    shapes = {i.name: resolve_shape(i, opts) for i in inputs}
    requests = []
    for _ in range(max(1, opts.pool_size)):
        req = service_pb2.ModelInferRequest(model_name=model, model_version=version)
        seq = int(rng.choice(opts.seq_lens)) if opts.seq_lens else None
        for info in inputs:
            shape = list(shapes[info.name])
            if seq is not None and info.name not in opts.shapes and _token_style(info):
                shape[1] = seq
            tensor = req.inputs.add()
            tensor.name, tensor.datatype = info.name, info.datatype
            tensor.shape.extend(shape)
            req.raw_input_contents.append(_raw(random_tensor(info, shape, opts, rng), info.datatype))
        if budget_ms is not None:
            req.parameters["timeout"].int64_param = max(1, int(budget_ms * 1000))
        if priority:
            req.parameters["priority"].uint64_param = priority
        requests.append(req.SerializeToString())
    first = [s[0] for s in shapes.values() if s]
    return RequestPool(requests=requests, shapes=shapes, rows=first[0] if first else 1)


def _token_style(info: TensorInfo) -> bool:
    return info.datatype in INTEGER_TYPES and len(info.shape) == 2 and info.shape[1] < 0


def build_text_pool(model: str, text_input: str, opts: InputOptions, *, version: str = "",
                    budget_ms: float | None = None, priority: int = 0) -> RequestPool:
    """One request a sentence of `opts.texts`, in a random order: BYTES [1, 1] on `text_input`."""
    order = np.random.default_rng(opts.seed).permutation(len(opts.texts))
    requests = []
    for k in order:
        req = service_pb2.ModelInferRequest(model_name=model, model_version=version)
        tensor = req.inputs.add()
        tensor.name, tensor.datatype = text_input, "BYTES"
        tensor.shape.extend([1, 1])
        req.raw_input_contents.append(_raw(np.array([[opts.texts[k].encode()]], dtype=np.object_), "BYTES"))
        if budget_ms is not None:
            req.parameters["timeout"].int64_param = max(1, int(budget_ms * 1000))
        if priority:
            req.parameters["priority"].uint64_param = priority
        requests.append(req.SerializeToString())
    return RequestPool(requests=requests, shapes={text_input: [1, 1]}, rows=1)
