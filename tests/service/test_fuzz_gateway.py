"""Fuzzing the gateway with malformed ModelInferRequests (hypothesis).

Whatever a client sends, the gateway must answer with a status it means
(OK, INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED,
UNAVAILABLE), never INTERNAL or UNKNOWN (an unhandled exception), answer
promptly, and keep serving: a well-formed mlp request sent after every
example must still get the right answer.

Requests are drawn two ways: near-valid ones (a correct request for mlp,
minilm or a BYTES echo model, then one to three mutations: datatypes, shapes,
raw/typed contents, BYTES length prefixes, duplicated/missing/unknown
inputs, outputs, parameters of every type, names) because those get past
the first checks; and arbitrary ones, empty request included. The echo
model (BYTES in, BYTES out) is added to the demo repository so that BYTES
decoding is reached at all.
"""
from __future__ import annotations

import itertools
import struct
import time

import grpc
import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from batchline.protocol import inference_pb2 as ipb
from batchline.testing.onnx_models import save_echo_model

ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNAVAILABLE,
}
ALLOWED_STREAM_PREFIXES = tuple(f"[{c.name}]" for c in ALLOWED if c != grpc.StatusCode.OK)
CLIENT_TIMEOUT_S = 10.0
PROMPT_S = 5.0  # a generous "promptly": every model here runs in milliseconds
MINILM_VOCAB = 30522

FUZZ_SETTINGS = dict(
    deadline=None,
    derandomize=True,  # the same examples on every run: CI failures reproduce
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)


# -- the mesh --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzz_mesh(model_repository, tmp_path_factory):
    """The demo models (linked, not copied) plus the BYTES echo model, on a mesh of its own."""
    from batchline.testing.in_process import InProcessMesh

    repo = tmp_path_factory.mktemp("fuzz-repository")
    for name in ("mlp", "minilm"):
        (repo / name).symlink_to(model_repository / name, target_is_directory=True)
    save_echo_model(repo)
    (repo / "echo" / "config.toml").write_text("max_batch_size = 8\nmax_queue_delay_ms = 1.0\n")
    with InProcessMesh(None, str(repo)) as m:
        yield m


@pytest.fixture(scope="module")
def channel(fuzz_mesh):
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    with grpc.insecure_channel(fuzz_mesh.address, options=options) as ch:
        yield ch


@pytest.fixture(scope="module")
def infer(channel):
    return channel.unary_unary(
        "/inference.GRPCInferenceService/ModelInfer",
        request_serializer=ipb.ModelInferRequest.SerializeToString,
        response_deserializer=ipb.ModelInferResponse.FromString,
    )


@pytest.fixture(scope="module")
def stream_infer(channel):
    return channel.stream_stream(
        "/inference.GRPCInferenceService/ModelStreamInfer",
        request_serializer=ipb.ModelInferRequest.SerializeToString,
        response_deserializer=ipb.ModelStreamInferResponse.FromString,
    )


@pytest.fixture(scope="module")
def mlp_session(model_repository):
    return ort.InferenceSession(str(model_repository / "mlp" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])


# -- strategies --------------------------------------------------------------------------------

DATATYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
             "FP16", "FP32", "FP64", "BYTES"]
JUNK_DATATYPES = ["", "fp32", "FP8", "BF16", "STRING", "TYPE_FP32", "FP32 ", "\x00"]
INPUT_NAMES = ["features", "input_ids", "attention_mask", "text", "", "bogus", "features\x00"]
OUTPUT_NAMES = ["probability", "sentence_embedding", "echo", "", "nope", "probability "]
PARAM_KEYS = ["timeout", "priority", "sequence_id", "sequence_start", "sequence_end", "binary_data_output",
              "binary_data", "shared_memory_region", "shared_memory_byte_size", "shared_memory_offset",
              "classification", "headers", ""]
INT64 = st.integers(-(2**63), 2**63 - 1)
UINT64 = st.integers(0, 2**64 - 1)
EDGE_INTS = [0, 1, -1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53, 2**62, 2**63 - 1, -(2**63)]

names = st.one_of(st.sampled_from(INPUT_NAMES), st.text(max_size=12))
dims = st.one_of(st.integers(-3, 70), st.sampled_from([-1, 0, 2**31 - 1, 2**31, 2**32, 2**62, 2**63 - 1, -(2**63)]))
shapes = st.lists(dims, max_size=5)
datatypes = st.sampled_from(DATATYPES + JUNK_DATATYPES)

param_values = st.one_of(
    st.tuples(st.just("bool_param"), st.booleans()),
    st.tuples(st.just("int64_param"), st.one_of(INT64, st.sampled_from(EDGE_INTS))),
    st.tuples(st.just("uint64_param"),
              st.one_of(UINT64, st.sampled_from([e for e in EDGE_INTS if e >= 0] + [2**64 - 1]))),
    st.tuples(st.just("string_param"),
              st.one_of(st.text(max_size=20), st.sampled_from(["1000", "-1", "1e9", "", "nan"]))),
    st.tuples(st.just("double_param"), st.floats(allow_nan=True, allow_infinity=True)),
    st.tuples(st.just(None), st.none()),  # a parameter with nothing set
)
param_maps = st.dictionaries(st.one_of(st.sampled_from(PARAM_KEYS), st.text(max_size=10)), param_values, max_size=4)
# The request parameters batchline reads, with odd values; integers at the edges of
# the wire types (and of the narrower fields they may end up in) more often than not.
edge_int_values = st.one_of(
    st.tuples(st.just("int64_param"), st.sampled_from(EDGE_INTS)),
    st.tuples(st.just("uint64_param"), st.sampled_from([0, 1, 2**31, 2**32 - 1, 2**32, 2**63, 2**64 - 1])),
)
budget_params = st.dictionaries(st.sampled_from(["timeout", "priority"]), st.one_of(edge_int_values, param_values),
                                min_size=1, max_size=2)

contents_values = st.one_of(
    st.tuples(st.just("bool_contents"), st.lists(st.booleans(), max_size=70)),
    st.tuples(st.just("int_contents"), st.lists(st.integers(-(2**31), 2**31 - 1), max_size=70)),
    st.tuples(st.just("int64_contents"), st.lists(INT64, max_size=70)),
    st.tuples(st.just("uint_contents"), st.lists(st.integers(0, 2**32 - 1), max_size=70)),
    st.tuples(st.just("uint64_contents"), st.lists(UINT64, max_size=70)),
    st.tuples(st.just("fp32_contents"), st.lists(st.floats(width=32), max_size=70)),
    st.tuples(st.just("fp64_contents"), st.lists(st.floats(), max_size=70)),
    st.tuples(st.just("bytes_contents"), st.lists(st.binary(max_size=12), max_size=12)),
)


@st.composite
def malformed_bytes(draw) -> bytes:
    """BYTES raw data: length-prefixed elements, with lying or truncated prefixes."""
    out = b""
    for _ in range(draw(st.integers(0, 5))):
        payload = draw(st.one_of(st.binary(max_size=10), st.text(max_size=6).map(str.encode)))
        declared = draw(st.one_of(st.just(len(payload)), st.integers(0, 40), st.sampled_from([2**31, 2**32 - 1])))
        out += struct.pack("<I", declared) + payload
    tail = draw(st.sampled_from([b"", b"\x01", b"\x05\x00", b"\xff\xff\xff", b"\xff\xff\xff\xff"]))
    return out + tail


raw_blobs = st.one_of(st.binary(max_size=600), malformed_bytes(), st.just(b""))


def set_param(target, key: str, value: tuple) -> None:
    kind, v = value
    param = target[key]
    if kind is None:
        param.Clear()
    else:
        setattr(param, kind, v)


def _bytes_raw(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(i)) + i for i in items)


@st.composite
def valid_requests(draw) -> ipb.ModelInferRequest:
    model = draw(st.sampled_from(["mlp", "minilm", "echo"]))
    rows = draw(st.integers(1, 4))
    r = ipb.ModelInferRequest(model_name=model, id=draw(st.text(max_size=8)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if model == "mlp":
        r.inputs.add(name="features", datatype="FP32", shape=[rows, 32])
        r.raw_input_contents.append(rng.standard_normal((rows, 32)).astype(np.float32).tobytes())
    elif model == "minilm":
        seq = draw(st.integers(1, 16))
        r.inputs.add(name="input_ids", datatype="INT64", shape=[rows, seq])
        r.inputs.add(name="attention_mask", datatype="INT64", shape=[rows, seq])
        r.raw_input_contents.append(rng.integers(0, MINILM_VOCAB, (rows, seq)).astype(np.int64).tobytes())
        r.raw_input_contents.append(np.ones((rows, seq), np.int64).tobytes())
    else:
        r.inputs.add(name="text", datatype="BYTES", shape=[rows, 2])
        r.raw_input_contents.append(_bytes_raw([draw(st.text(max_size=5)).encode() for _ in range(rows * 2)]))
    return r


def _to_typed(r: ipb.ModelInferRequest, draw) -> None:
    """Move every input from raw to typed contents, with the datatype's field or another."""
    raws = list(r.raw_input_contents)
    del r.raw_input_contents[:]
    for t, raw in zip(r.inputs, raws):
        field, values = draw(contents_values)
        # Often the same values in the right field (an earlier mutation may have cut the raw bytes).
        if draw(st.booleans()) and t.datatype == "FP32" and len(raw) % 4 == 0:
            field, values = "fp32_contents", np.frombuffer(raw, np.float32).tolist()
        elif draw(st.booleans()) and t.datatype == "INT64" and len(raw) % 8 == 0:
            field, values = "int64_contents", np.frombuffer(raw, np.int64).tolist()
        getattr(t.contents, field).extend(values)


MUTATIONS = [
    "datatype", "shape", "raw_garbage", "raw_truncate", "raw_extend", "typed", "raw_and_typed", "duplicate_input",
    "drop_input", "unknown_input", "raw_count", "outputs", "params", "budget_params", "tensor_params", "name",
    "version", "oov_tokens", "mismatched_seq", "bytes_prefix", "empty_shape_dims",
]


@st.composite
def mutated_requests(draw) -> ipb.ModelInferRequest:
    r = draw(valid_requests())
    for mutation in draw(st.lists(st.sampled_from(MUTATIONS), min_size=1, max_size=3)):
        i = draw(st.integers(0, max(0, len(r.inputs) - 1)))
        if mutation == "datatype" and r.inputs:
            r.inputs[i].datatype = draw(datatypes)
        elif mutation == "shape" and r.inputs:
            shape = list(r.inputs[i].shape)
            if shape and draw(st.booleans()):
                shape[draw(st.integers(0, len(shape) - 1))] = draw(dims)
            else:
                shape = draw(shapes)
            del r.inputs[i].shape[:]
            r.inputs[i].shape.extend(shape)
        elif mutation == "empty_shape_dims" and r.inputs:
            shape = list(r.inputs[i].shape)
            shape[-1:] = [0]
            del r.inputs[i].shape[:]
            r.inputs[i].shape.extend(shape)
            if i < len(r.raw_input_contents):
                r.raw_input_contents[i] = b""
        elif mutation == "raw_garbage" and r.raw_input_contents:
            r.raw_input_contents[min(i, len(r.raw_input_contents) - 1)] = draw(raw_blobs)
        elif mutation == "raw_truncate" and r.raw_input_contents:
            j = min(i, len(r.raw_input_contents) - 1)
            blob = r.raw_input_contents[j]
            r.raw_input_contents[j] = blob[: draw(st.integers(0, max(0, len(blob) - 1)))]
        elif mutation == "raw_extend" and r.raw_input_contents:
            j = min(i, len(r.raw_input_contents) - 1)
            r.raw_input_contents[j] = r.raw_input_contents[j] + draw(st.binary(min_size=1, max_size=16))
        elif mutation == "typed" and r.raw_input_contents:
            _to_typed(r, draw)
        elif mutation == "raw_and_typed" and r.inputs:
            field, values = draw(contents_values)
            getattr(r.inputs[i].contents, field).extend(values)
        elif mutation == "duplicate_input" and r.inputs:
            r.inputs.append(r.inputs[i])
            if r.raw_input_contents:
                r.raw_input_contents.append(r.raw_input_contents[min(i, len(r.raw_input_contents) - 1)])
        elif mutation == "drop_input" and r.inputs:
            del r.inputs[i]
            if i < len(r.raw_input_contents):
                del r.raw_input_contents[i]
        elif mutation == "unknown_input":
            r.inputs.add(name=draw(names), datatype=draw(datatypes), shape=draw(shapes))
            if r.raw_input_contents or draw(st.booleans()):
                r.raw_input_contents.append(draw(raw_blobs))
        elif mutation == "raw_count":
            if r.raw_input_contents and draw(st.booleans()):
                del r.raw_input_contents[-1]
            else:
                r.raw_input_contents.append(draw(raw_blobs))
        elif mutation == "outputs":
            for _ in range(draw(st.integers(1, 3))):
                out = r.outputs.add(name=draw(st.one_of(st.sampled_from(OUTPUT_NAMES), st.text(max_size=8))))
                for key, value in draw(param_maps).items():
                    set_param(out.parameters, key, value)
        elif mutation == "params":
            for key, value in draw(param_maps).items():
                set_param(r.parameters, key, value)
        elif mutation == "budget_params":
            for key, value in draw(budget_params).items():
                set_param(r.parameters, key, value)
        elif mutation == "tensor_params" and r.inputs:
            for key, value in draw(param_maps).items():
                set_param(r.inputs[i].parameters, key, value)
        elif mutation == "name":
            r.model_name = draw(st.one_of(st.sampled_from(["", "MLP", "mlp ", "minilm/1", "../mlp", "echo\x00"]),
                                          st.text(max_size=16)))
        elif mutation == "version":
            r.model_version = draw(st.one_of(st.sampled_from(["0", "1", "2", "-1", "01", "latest", " 1", "1.0"]),
                                             st.text(max_size=6)))
        elif mutation == "oov_tokens" and r.model_name == "minilm" and r.raw_input_contents:
            ids = np.frombuffer(r.raw_input_contents[0], np.int64).copy()
            if ids.size:
                ids[draw(st.integers(0, ids.size - 1))] = draw(st.sampled_from([-1, MINILM_VOCAB, 10**9, -(2**63)]))
                r.raw_input_contents[0] = ids.tobytes()
        elif mutation == "mismatched_seq" and r.model_name == "minilm" and len(r.inputs) == 2:
            rows, seq = r.inputs[1].shape
            del r.inputs[1].shape[:]
            r.inputs[1].shape.extend([rows, seq + 1])
            if len(r.raw_input_contents) == 2:
                r.raw_input_contents[1] = np.ones((rows, seq + 1), np.int64).tobytes()
        elif mutation == "bytes_prefix" and r.model_name == "echo" and r.raw_input_contents:
            r.raw_input_contents[0] = draw(malformed_bytes())
    return r


@st.composite
def arbitrary_requests(draw) -> ipb.ModelInferRequest:
    r = ipb.ModelInferRequest(
        model_name=draw(st.one_of(st.sampled_from(["mlp", "minilm", "echo", ""]), st.text(max_size=10))),
        model_version=draw(st.one_of(st.sampled_from(["", "1"]), st.text(max_size=4))),
        id=draw(st.text(max_size=8)),
    )
    for _ in range(draw(st.integers(0, 3))):
        t = r.inputs.add(name=draw(names), datatype=draw(datatypes), shape=draw(shapes))
        if draw(st.booleans()):
            field, values = draw(contents_values)
            getattr(t.contents, field).extend(values)
    for _ in range(draw(st.integers(0, 3))):
        r.raw_input_contents.append(draw(raw_blobs))
    for key, value in draw(param_maps).items():
        set_param(r.parameters, key, value)
    for name in draw(st.lists(st.sampled_from(OUTPUT_NAMES), max_size=2)):
        r.outputs.add(name=name)
    return r


@st.composite
def odd_parameter_requests(draw) -> ipb.ModelInferRequest:
    """Valid but for the request parameters, so that the budget and priority code is reached."""
    r = draw(valid_requests())
    for key, value in draw(budget_params).items():
        set_param(r.parameters, key, value)
    return r


requests = st.one_of(
    mutated_requests(),
    mutated_requests(),  # twice as likely: they get furthest into the gateway
    odd_parameter_requests(),
    arbitrary_requests(),
    st.just(ipb.ModelInferRequest()),
)


def _mlp_with(**params: tuple) -> ipb.ModelInferRequest:
    """A valid mlp request with these request parameters (name -> (kind, value))."""
    r = ipb.ModelInferRequest(model_name="mlp")
    r.inputs.add(name="features", datatype="FP32", shape=[1, 32])
    r.raw_input_contents.append(np.zeros((1, 32), np.float32).tobytes())
    for key, value in params.items():
        set_param(r.parameters, key, value)
    return r


# Always tried, whatever the generator draws: values that once got past validation.
PRIORITY_PAST_UINT32 = _mlp_with(priority=("int64_param", 2**32))
PRIORITY_UINT64_MAX = _mlp_with(priority=("uint64_param", 2**64 - 1))
TIMEOUT_UINT64_MAX = _mlp_with(timeout=("uint64_param", 2**64 - 1))


# -- checks ----------------------------------------------------------------------------------


def _call(infer, request: ipb.ModelInferRequest) -> tuple[grpc.StatusCode, str, ipb.ModelInferResponse | None]:
    try:
        return grpc.StatusCode.OK, "", infer(request, timeout=CLIENT_TIMEOUT_S)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", None


def _assert_still_serves(infer, mlp_session, seed: int) -> None:
    x = np.random.default_rng(seed).standard_normal((2, 32)).astype(np.float32)
    request = ipb.ModelInferRequest(model_name="mlp", id=f"probe-{seed}")
    request.inputs.add(name="features", datatype="FP32", shape=[2, 32])
    request.raw_input_contents.append(x.tobytes())
    code, details, response = _call(infer, request)
    assert code == grpc.StatusCode.OK, f"a well-formed request failed after fuzzing: {code.name}: {details}"
    (expected,) = mlp_session.run(["probability"], {"features": x})
    got = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(expected.shape)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert response.id == f"probe-{seed}"


_probes = itertools.count()


@settings(max_examples=150, **FUZZ_SETTINGS)
@given(request=requests)
@example(request=PRIORITY_PAST_UINT32)
@example(request=PRIORITY_UINT64_MAX)
@example(request=TIMEOUT_UINT64_MAX)
@example(request=ipb.ModelInferRequest())
def test_fuzzed_requests_get_meaningful_statuses(infer, mlp_session, request):
    started = time.monotonic()
    code, details, response = _call(infer, request)
    elapsed = time.monotonic() - started
    # `pytest --hypothesis-show-statistics` shows how far the examples got.
    event(f"{code.name}: {' '.join(details.split()[:4])}")
    assert code in ALLOWED, f"{code.name} for a client's mistake: {details!r}"
    assert elapsed < PROMPT_S, f"{code.name} after {elapsed:.1f} s: the gateway did not answer promptly"
    if code == grpc.StatusCode.OK:
        # An accepted request gets one output per requested name (or every output).
        wanted = [o.name for o in request.outputs]
        got = [o.name for o in response.outputs]
        assert not wanted or got == wanted, f"asked for {wanted}, got {got}"
        assert len(response.raw_output_contents) == len(response.outputs)
    _assert_still_serves(infer, mlp_session, next(_probes))


@settings(max_examples=40, **FUZZ_SETTINGS)
@given(batch=st.lists(requests, min_size=1, max_size=4))
@example(batch=[PRIORITY_PAST_UINT32, ipb.ModelInferRequest()])
def test_fuzzed_requests_on_a_stream(stream_infer, mlp_session, batch):
    """On ModelStreamInfer a failure is an in-band error_message: every request still gets
    exactly one answer, none of them an INTERNAL/UNKNOWN one, and the stream stays usable."""
    x = np.random.default_rng(len(batch)).standard_normal((1, 32)).astype(np.float32)
    probe = ipb.ModelInferRequest(model_name="mlp", id="probe")
    probe.inputs.add(name="features", datatype="FP32", shape=[1, 32])
    probe.raw_input_contents.append(x.tobytes())
    started = time.monotonic()
    try:
        answers = list(stream_infer(iter([*batch, probe]), timeout=CLIENT_TIMEOUT_S))
    except grpc.RpcError as exc:
        pytest.fail(f"the stream failed with {exc.code().name} after {time.monotonic() - started:.1f} s: "
                    f"{exc.details()}")
    assert len(answers) == len(batch) + 1, f"{len(batch) + 1} requests, {len(answers)} answers"
    for a in answers:
        if a.error_message:
            assert a.error_message.startswith(ALLOWED_STREAM_PREFIXES), f"stream error: {a.error_message!r}"
    probes = [a for a in answers if not a.error_message and a.infer_response.id == "probe"]
    assert probes, f"the well-formed request on the stream was not answered: {[a.error_message for a in answers]}"
    (expected,) = mlp_session.run(["probability"], {"features": x})
    got = np.frombuffer(probes[-1].infer_response.raw_output_contents[0], np.float32).reshape(expected.shape)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
