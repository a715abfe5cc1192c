"""End-to-end error handling through the stock tritonclient, against a real mesh.

Every rejection is checked for its gRPC status *and* for a message that names
the problem (the model, input, value or limit at fault), because a client can
only act on the message. Waiting is always a poll with a deadline.
"""
from __future__ import annotations

import functools
import logging
import queue
import threading
import time

import grpc
import numpy as np
import onnxruntime as ort
import pytest
import redis
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from batchline import contract
from batchline.protocol import inference_pb2 as ipb
from gateway.app import GatewayApp
from batchline.testing.polling import poll
from gateway.settings import GatewaySettings

INVALID_ARGUMENT = "StatusCode.INVALID_ARGUMENT"
NOT_FOUND = "StatusCode.NOT_FOUND"
DEADLINE_EXCEEDED = "StatusCode.DEADLINE_EXCEEDED"
RESOURCE_EXHAUSTED = "StatusCode.RESOURCE_EXHAUSTED"

MLP_MAX_BATCH = 64
MLP_FEATURES = 32


# -- helpers -----------------------------------------------------------------


def expect_error(call, status: str, *fragments: str) -> InferenceServerException:
    """Run `call`, which must fail with `status` and a message containing every fragment."""
    with pytest.raises(InferenceServerException) as info:
        call()
    exc = info.value
    assert exc.status() == status, f"expected {status}, got {exc.status()}: {exc.message()}"
    message = exc.message() or ""
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in error message {message!r}"
    return exc


def tensor(name: str, array: np.ndarray, datatype: str | None = None, shape=None) -> grpcclient.InferInput:
    datatype = datatype or {np.dtype("float32"): "FP32", np.dtype("float64"): "FP64",
                            np.dtype("int64"): "INT64"}[array.dtype]
    t = grpcclient.InferInput(name, list(shape if shape is not None else array.shape), datatype)
    t.set_data_from_numpy(array)
    return t


def features(rows: int, seed: int = 0, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, MLP_FEATURES)).astype(dtype)


def mlp_inputs(rows: int = 1, seed: int = 0) -> list[grpcclient.InferInput]:
    return [tensor("features", features(rows, seed))]


def raw_infer(address: str, request: ipb.ModelInferRequest, timeout: float = 10.0) -> ipb.ModelInferResponse:
    """ModelInfer over a plain grpc channel: no client-side checks of sizes or shapes."""
    with grpc.insecure_channel(
        address,
        options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)],
    ) as channel:
        call = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=ipb.ModelInferRequest.SerializeToString,
            response_deserializer=ipb.ModelInferResponse.FromString,
        )
        return call(request, timeout=timeout)


def bl_keys(r: redis.Redis, pattern: str = contract.PREFIX + "*") -> list[bytes]:
    return list(r.scan_iter(match=pattern, count=1000))


# -- fixtures ----------------------------------------------------------------


@pytest.fixture(scope="module")
def client(mesh):
    c = grpcclient.InferenceServerClient(mesh.address)
    yield c
    c.close()


@pytest.fixture(scope="module")
def rdb(mesh):
    r = redis.Redis.from_url(mesh.redis_url)
    yield r
    r.close()


@pytest.fixture(scope="module")
def mlp_session(model_repository) -> ort.InferenceSession:
    return ort.InferenceSession(str(model_repository / "mlp" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def minilm_session(model_repository) -> ort.InferenceSession:
    return ort.InferenceSession(str(model_repository / "minilm" / "1" / "model.onnx"),
                                providers=["CPUExecutionProvider"])


def reference(session: ort.InferenceSession, x: np.ndarray) -> np.ndarray:
    (out,) = session.run(["probability"], {"features": x})
    return out


@pytest.fixture
def stalled_mesh(mesh_factory):
    """A mesh (on a Redis of its own) whose scheduler never dispatches (max_batches_per_executor=0)."""
    return mesh_factory(models=["mlp"], max_batches_per_executor=0)


@pytest.fixture
def small_gateway(mesh):
    """A second gateway on the module mesh (same Redis) accepting messages of at most 1 MiB."""
    limit = 1024 * 1024

    async def start():
        return await GatewayApp(GatewaySettings(redis_url=mesh.redis_url, port=0, metrics_port=-1, http_port=-1,
                                                max_message_bytes=limit)).start()

    app = mesh.call(start())
    try:
        yield app, limit
    finally:
        mesh.call(app.stop(0), timeout=30)


# -- not found -----------------------------------------------------------------


def test_unknown_model_is_not_found(client):
    expect_error(lambda: client.infer("nope", mlp_inputs()), NOT_FOUND, "'nope'", "not served")


def test_unknown_version_is_not_found(client):
    expect_error(lambda: client.infer("mlp", mlp_inputs(), model_version="7"), NOT_FOUND, "'mlp'", "'7'",
                 "available: 1")


def test_metadata_and_config_of_unknown_model_are_not_found(client):
    expect_error(lambda: client.get_model_metadata("nope"), NOT_FOUND, "'nope'")
    expect_error(lambda: client.get_model_metadata("mlp", model_version="7"), NOT_FOUND, "'7'")
    expect_error(lambda: client.get_model_config("nope"), NOT_FOUND, "'nope'")
    expect_error(lambda: client.get_model_config("mlp", model_version="7"), NOT_FOUND, "'7'")


def test_model_ready(client):
    assert client.is_model_ready("nope") is False
    assert client.is_model_ready("mlp") is True
    assert client.is_model_ready("mlp", "1") is True
    assert client.is_model_ready("mlp", "7") is False


# -- invalid argument ----------------------------------------------------------


def test_wrong_datatype(client):
    expect_error(
        lambda: client.infer("mlp", [tensor("features", features(1, dtype=np.float64))]),
        INVALID_ARGUMENT, "'features'", "FP32", "FP64",
    )


def test_wrong_shape(client):
    x = np.zeros((1, 31), np.float32)
    expect_error(lambda: client.infer("mlp", [tensor("features", x)]), INVALID_ARGUMENT, "'features'", "32", "[1, 31]")


@pytest.mark.parametrize("shape", [[1, 32, 1], [32]], ids=["rank3", "rank1"])
def test_wrong_rank(client, shape):
    x = np.zeros(shape, np.float32)
    expect_error(lambda: client.infer("mlp", [tensor("features", x)]), INVALID_ARGUMENT, "'features'", "shape",
                 str(shape))


def test_missing_input(client):
    ids = np.ones((1, 8), np.int64)
    expect_error(
        lambda: client.infer("minilm", [tensor("input_ids", ids)]),
        INVALID_ARGUMENT, "attention_mask", "missing",
    )


def test_unknown_extra_input(client):
    inputs = mlp_inputs() + [tensor("bogus", np.zeros((1, 4), np.float32))]
    expect_error(lambda: client.infer("mlp", inputs), INVALID_ARGUMENT, "bogus", "features")


@pytest.mark.parametrize("rows", [MLP_MAX_BATCH + 1, 0], ids=["over_max", "empty"])
def test_batch_size_out_of_range(client, rows):
    expect_error(
        lambda: client.infer("mlp", [tensor("features", np.zeros((rows, MLP_FEATURES), np.float32))]),
        INVALID_ARGUMENT, "'features'", f"batch size {rows}", "1..64",
    )


def test_inputs_disagree_on_batch_size(client):
    inputs = [tensor("input_ids", np.ones((2, 8), np.int64)), tensor("attention_mask", np.ones((1, 8), np.int64))]
    expect_error(lambda: client.infer("minilm", inputs), INVALID_ARGUMENT, "batch size", "attention_mask")


def test_duplicate_input(client):
    expect_error(lambda: client.infer("mlp", mlp_inputs() + mlp_inputs()), INVALID_ARGUMENT, "'features'",
                 "more than once")


def test_sequence_id_is_refused(client):
    expect_error(lambda: client.infer("mlp", mlp_inputs(), sequence_id=5), INVALID_ARGUMENT, "sequence_id")


def test_byte_size_mismatch(mesh):
    # tritonclient checks sizes client-side, so the request is built by hand:
    # the tensor claims [2, 32] FP32 (256 bytes) but carries one row (128 bytes).
    request = ipb.ModelInferRequest(model_name="mlp")
    request.inputs.add(name="features", datatype="FP32", shape=[2, MLP_FEATURES])
    request.raw_input_contents.append(features(1).tobytes())
    with pytest.raises(grpc.RpcError) as info:
        raw_infer(mesh.address, request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    details = info.value.details()
    for fragment in ("'features'", "256", "128"):
        assert fragment in details, details


def test_raw_request_with_right_sizes_succeeds(mesh, mlp_session):
    # The same hand-built path as above, correct this time: the rejection is about the sizes.
    x = features(2, seed=3)
    request = ipb.ModelInferRequest(model_name="mlp")
    request.inputs.add(name="features", datatype="FP32", shape=[2, MLP_FEATURES])
    request.raw_input_contents.append(x.tobytes())
    response = raw_infer(mesh.address, request)
    out = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(list(response.outputs[0].shape))
    np.testing.assert_allclose(out, reference(mlp_session, x), rtol=1e-5, atol=1e-6)


def test_unknown_requested_output(client):
    outputs = [grpcclient.InferRequestedOutput("nope")]
    expect_error(lambda: client.infer("mlp", mlp_inputs(), outputs=outputs), INVALID_ARGUMENT, "'nope'", "probability")


def test_negative_timeout(client):
    expect_error(lambda: client.infer("mlp", mlp_inputs(), timeout=-5), INVALID_ARGUMENT, "timeout", "-5")


def test_huge_timeout_is_served_or_refused_cleanly(client, mlp_session):
    # Triton's `timeout` is a uint64 of microseconds; the largest int64 must
    # either be honoured (clamped) or refused as INVALID_ARGUMENT naming it.
    x = features(1, seed=7)
    try:
        result = client.infer("mlp", [tensor("features", x)], timeout=2**63 - 1)
    except InferenceServerException as exc:
        assert exc.status() == INVALID_ARGUMENT and "timeout" in exc.message(), f"{exc.status()}: {exc.message()}"
    else:
        np.testing.assert_allclose(result.as_numpy("probability"), reference(mlp_session, x), rtol=1e-5, atol=1e-6)


# -- deadlines -----------------------------------------------------------------


def test_timeout_parameter_of_one_microsecond(client, rdb):
    # No client deadline: the DEADLINE_EXCEEDED comes from the server.
    start = time.monotonic()
    exc = expect_error(lambda: client.infer("mlp", mlp_inputs(), timeout=1), DEADLINE_EXCEEDED, "mlp")
    assert time.monotonic() - start < 2.0
    assert "deadline" in exc.message() or "budget" in exc.message(), exc.message()
    # The abandoned request does not linger in Redis.
    poll(lambda: not bl_keys(rdb, contract.payload(("*", "*"), "*")), 2.0, what="bl:req:* keys to disappear")
    poll(lambda: rdb.zcard(contract.queue(("mlp", "1"))) == 0, 2.0, what="the mlp queue to be empty")


def test_undispatchable_request_times_out_and_is_cleaned_up(stalled_mesh):
    c = grpcclient.InferenceServerClient(stalled_mesh.address)
    r = redis.Redis.from_url(stalled_mesh.redis_url)
    try:
        assert c.is_model_ready("mlp")
        start = time.monotonic()
        exc = expect_error(lambda: c.infer("mlp", mlp_inputs(), timeout=200_000), DEADLINE_EXCEEDED, "mlp")
        elapsed = time.monotonic() - start
        assert elapsed < 1.5, f"answered after {elapsed:.2f} s for a 200 ms budget"
        assert any(w in exc.message() for w in ("deadline", "budget")), exc.message()
        poll(lambda: not bl_keys(r, contract.payload(("*", "*"), "*")), 2.0, what="bl:req:* keys to disappear")
        poll(lambda: r.zcard(contract.queue(("mlp", "1"))) == 0, 2.0, what="the mlp queue to be empty")
        # Nothing was ever dispatched.
        assert not bl_keys(r, contract.batch(("*", "*"), "*"))
    finally:
        c.close()
        r.close()


# -- message size ----------------------------------------------------------------


def test_message_over_gateway_limit_is_resource_exhausted(small_gateway, mlp_session):
    app, limit = small_gateway
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{app.port}")
    try:
        # Under the limit it serves normally...
        x = features(4, seed=9)
        result = c.infer("mlp", [tensor("features", x)])
        np.testing.assert_allclose(result.as_numpy("probability"), reference(mlp_session, x), rtol=1e-5, atol=1e-6)
        # ...over it the request is refused before anything else looks at it.
        rows = 2 * limit // (4 * MLP_FEATURES)
        exc = expect_error(lambda: c.infer("mlp", mlp_inputs(rows)), RESOURCE_EXHAUSTED)
        assert str(limit) in exc.message(), exc.message()
    finally:
        c.close()


def test_message_over_default_limit_is_resource_exhausted(mesh):
    # The stock gateway's limit (64 MiB): one raw request of 65 MiB.
    limit = GatewaySettings.model_fields["max_message_bytes"].default
    rows = (limit + 2**20) // (4 * MLP_FEATURES)
    request = ipb.ModelInferRequest(model_name="mlp")
    request.inputs.add(name="features", datatype="FP32", shape=[rows, MLP_FEATURES])
    request.raw_input_contents.append(bytes(rows * 4 * MLP_FEATURES))
    with pytest.raises(grpc.RpcError) as info:
        raw_infer(mesh.address, request)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
    assert str(limit) in info.value.details(), info.value.details()


# -- isolation -----------------------------------------------------------------


def test_bad_requests_do_not_fail_their_batch_neighbours(client, mlp_session):
    n_valid = 16
    valid = {i: features(1 + i % 4, seed=100 + i) for i in range(n_valid)}
    invalid = {
        n_valid + 0: [tensor("features", features(2, seed=1, dtype=np.float64))],  # datatype
        n_valid + 1: [tensor("features", features(1, seed=2, dtype=np.float64))],
        n_valid + 2: [tensor("features", np.zeros((2, 31), np.float32))],  # shape
        n_valid + 3: [tensor("features", features(MLP_MAX_BATCH + 1, seed=3))],  # batch size
        n_valid + 4: mlp_inputs() + [tensor("bogus", np.zeros((1, 1), np.float32))],  # extra input
    }
    done: dict[int, tuple] = {}
    lock = threading.Lock()
    all_done = threading.Event()
    total = len(valid) + len(invalid)

    def callback(i, result, error):
        with lock:
            done[i] = (result, error)
            if len(done) == total:
                all_done.set()

    order = list(valid) + list(invalid)
    # Interleave valid and invalid so they reach the gateway together.
    order = [x for pair in zip(order[: n_valid], order[n_valid:] + [None] * n_valid) for x in pair if x is not None]
    for i in order:
        inputs = [tensor("features", valid[i])] if i in valid else invalid[i]
        client.async_infer("mlp", inputs, functools.partial(callback, i), request_id=str(i))
    assert all_done.wait(10), f"only {len(done)} of {total} answered"

    for i, x in valid.items():
        result, error = done[i]
        assert error is None, f"valid request {i} failed: {error}"
        assert result.get_response().id == str(i)
        np.testing.assert_allclose(result.as_numpy("probability"), reference(mlp_session, x), rtol=1e-5, atol=1e-6)
    for i in invalid:
        result, error = done[i]
        assert result is None and error is not None, f"invalid request {i} succeeded"
        assert error.status() == INVALID_ARGUMENT, f"request {i}: {error.status()} {error.message()}"
        assert "features" in error.message() or "bogus" in error.message(), error.message()


def test_request_that_fails_in_the_model_fails_alone(client, minilm_session, caplog):
    """Token ids past the vocabulary pass the gateway (right dtype and shape) but make
    ONNX Runtime fail; the executor must retry its batch member by member so that only
    the poisoned requests fail. Rounds repeat until a poisoned request has actually
    shared a batch with valid ones (the executor logs the retry)."""
    caplog.set_level(logging.WARNING, logger="executor.service")
    before = client.get_inference_statistics("minilm").model_stats[0].inference_stats
    rng = np.random.default_rng(5)
    deadline = time.monotonic() + 10
    rounds = 0
    while True:
        rounds += 1
        valid = {}
        for i in range(8):
            seq = int(rng.integers(4, 13))
            valid[i] = (rng.integers(1000, 30000, (1 + i % 2, seq)).astype(np.int64),
                        np.ones((1 + i % 2, seq), np.int64))
        poisoned = {i: (np.full((1, 6), 10**9, np.int64), np.ones((1, 6), np.int64)) for i in (8, 9)}
        done: dict[int, tuple] = {}
        lock = threading.Lock()
        all_done = threading.Event()

        def callback(i, result, error):
            with lock:
                done[i] = (result, error)
                if len(done) == 10:
                    all_done.set()

        for i in (0, 8, 1, 2, 3, 9, 4, 5, 6, 7):
            ids, mask = poisoned.get(i) or valid[i]
            client.async_infer(
                "minilm", [tensor("input_ids", ids), tensor("attention_mask", mask)], functools.partial(callback, i)
            )
        assert all_done.wait(10), f"only {len(done)} of 10 answered"
        for i, (ids, mask) in valid.items():
            result, error = done[i]
            assert error is None, f"valid request {i} failed: {error}"
            (expected,) = minilm_session.run(["sentence_embedding"], {"input_ids": ids, "attention_mask": mask})
            np.testing.assert_allclose(result.as_numpy("sentence_embedding"), expected, rtol=1e-4, atol=1e-4)
        for i in poisoned:
            result, error = done[i]
            assert result is None and error is not None, f"poisoned request {i} succeeded"
            assert error.status() == INVALID_ARGUMENT, f"{error.status()}: {error.message()}"
            assert "minilm" in error.message() and "out of data bounds" in error.message(), error.message()
        if any("retrying members one by one" in r.getMessage() for r in caplog.records):
            break
        assert time.monotonic() < deadline, f"no poisoned request shared a batch with valid ones in {rounds} rounds"
    # The executor's statistics count each request once, as a success or a failure.
    after = client.get_inference_statistics("minilm").model_stats[0].inference_stats
    assert after.success.count - before.success.count == 8 * rounds
    assert after.fail.count - before.fail.count == 2 * rounds


# -- streaming -----------------------------------------------------------------


def test_stream_error_and_success_on_one_stream(mesh, mlp_session):
    answers: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(mesh.address)
    try:
        c.start_stream(callback=lambda result, error: answers.put((result, error)))
        c.async_stream_infer("mlp", [tensor("features", features(1, dtype=np.float64))], request_id="bad")
        c.async_stream_infer("nope", mlp_inputs(), request_id="unknown")
        x = features(3, seed=42)
        c.async_stream_infer("mlp", [tensor("features", x)], request_id="good")
        got = []
        deadline = time.monotonic() + 10
        while len(got) < 3:
            got.append(answers.get(timeout=max(0.01, deadline - time.monotonic())))
    finally:
        c.stop_stream()
        c.close()

    errors = [e for r, e in got if e is not None]
    results = [r for r, e in got if e is None]
    assert len(errors) == 2 and len(results) == 1, got
    messages = sorted((e.message() for e in errors), key=lambda m: "NOT_FOUND" in m)
    for fragment in ("INVALID_ARGUMENT", "'features'", "FP32", "FP64"):
        assert fragment in messages[0], messages
    for fragment in ("NOT_FOUND", "'nope'"):
        assert fragment in messages[1], messages
    assert results[0].get_response().id == "good"
    np.testing.assert_allclose(results[0].as_numpy("probability"), reference(mlp_session, x), rtol=1e-5, atol=1e-6)


def test_a_failure_nobody_foresaw_is_internal_and_the_stream_goes_on(mesh_factory, mlp_session):
    # A real one: while the executors' registry set holds the wrong type, the gateway's registry
    # refresh (which an unknown model name triggers) fails with a Redis ResponseError.
    m = mesh_factory(models=["mlp"])
    r = redis.Redis.from_url(m.redis_url)

    def break_registry():
        r.delete(contract.EXECUTORS)
        r.set(contract.EXECUTORS, "not-a-set", px=60_000)

    answers: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(m.address)
    try:
        break_registry()
        expect_error(lambda: c.infer("nope", mlp_inputs()), "StatusCode.INTERNAL", "unexpectedly", "WRONGTYPE")
        c.start_stream(callback=lambda result, error: answers.put((result, error)))
        c.async_stream_infer("nope", mlp_inputs(), request_id="broken")
        _, error = answers.get(timeout=10)
        assert error is not None and "[INTERNAL]" in error.message() and "WRONGTYPE" in error.message()
        r.delete(contract.EXECUTORS)  # mended: the executors add themselves back on their next heartbeat
        x = features(2, seed=7)
        c.async_stream_infer("mlp", [tensor("features", x)], request_id="good")  # on the same stream
        result, error = answers.get(timeout=15)
        assert error is None, error.message()
    finally:
        c.stop_stream()
        c.close()
        if r.type(contract.EXECUTORS) == b"string":
            r.delete(contract.EXECUTORS)  # so that the mesh stops cleanly whatever failed above
    np.testing.assert_allclose(result.as_numpy("probability"), reference(mlp_session, x), rtol=1e-5, atol=1e-6)


def test_redis_out_of_memory_is_unavailable_and_the_mesh_serves_once_it_has_room(mesh_factory):
    m = mesh_factory(models=["mlp"])
    r = redis.Redis.from_url(m.redis_url)
    c = grpcclient.InferenceServerClient(m.address)
    try:
        c.infer("mlp", mlp_inputs())
        r.config_set("maxmemory", 1)  # every write refused with OOM: what a Redis at its maxmemory does
        try:
            expect_error(lambda: c.infer("mlp", mlp_inputs()), "StatusCode.UNAVAILABLE", "Redis refuses writes",
                         "maxmemory")
            # Until the executors' registrations lapse (their heartbeats are refused): they come
            # back only if the heartbeats outlived the refusals.
            poll(lambda: not any(r.scan_iter(contract.executor("*"))), 15, "the registrations to lapse", interval=0.1)
        finally:
            r.config_set("maxmemory", 0)

        def served():
            try:
                return c.infer("mlp", mlp_inputs(), client_timeout=2)
            except InferenceServerException:
                return None

        poll(served, 15, "the mesh to serve again once Redis had room", interval=0.1)
    finally:
        c.close()


# -- Redis hygiene (keep last: it checks what the tests above left behind) --------


def test_every_key_expires(mesh, client, rdb):
    # Make sure something ran on this mesh even when this test runs alone.
    client.infer("mlp", mlp_inputs())
    keys = bl_keys(rdb)
    assert keys
    forever = [k.decode() for k in keys if rdb.ttl(k) == -1]
    assert not forever, f"keys without a TTL: {forever}"


def test_members_retried_one_by_one_past_their_deadline_are_not_run(model_repository):
    """A batch one member poisons is retried member by member: one whose deadline passed meanwhile
    is answered DEADLINE_EXCEEDED without running (its gateway gave up; a sequence's next request
    may already run), not run late."""
    import asyncio

    from batchline.clock import now_us
    from batchline.protocol import internal_pb2 as pb
    from executor import running
    from executor.repository import load_model, read_config

    repo = model_repository / "minilm"
    model = load_model(repo, repo / "1", read_config(repo), ["CPUExecutionProvider"], "", 1)

    def member(request_id: str, ids: np.ndarray, deadline_us: int) -> running.Member:
        request = ipb.ModelInferRequest(model_name="minilm", id=request_id)
        for name, value in (("input_ids", ids), ("attention_mask", np.ones_like(ids))):
            request.inputs.add(name=name, datatype="INT64", shape=list(value.shape))
            request.raw_input_contents.append(value.tobytes())
        entry = pb.QueueEntry(request_id=request_id, rows=1, gateway_id="g", deadline_us=deadline_us)
        return running.decoded(entry, request.SerializeToString(), model, pb.Batch(model_name="minilm"), "e")

    valid = np.arange(1000, 1006, dtype=np.int64).reshape(1, 6)
    poisoned = np.full((1, 6), 10**9, np.int64)
    late = now_us() - 1  # passed by the time the batched run has failed
    members = [member("ok", valid, late), member("bad", poisoned, late)]
    asyncio.run(running.run(model, members, "e"))
    assert all(m.outputs is None for m in members)
    assert all("deadline exceeded" in str(m.error) for m in members), [str(m.error) for m in members]
