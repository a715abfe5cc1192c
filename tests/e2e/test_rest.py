"""The REST port (KServe v2 HTTP with Triton's binary tensor data extension) against a real mesh:
stock tritonclient.http, answers bit for bit equal to gRPC's, and refusals with their HTTP status."""
from __future__ import annotations

import asyncio
import contextlib
import gc
import http.client
import json
import logging
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import redis
import tritonclient.grpc as tg
import tritonclient.http as th
import tritonclient.http.aio as tha
from tritonclient.utils import InferenceServerException

from batchline import contract
from batchline.protocol import internal_pb2 as pb
from batchline.testing.checkout import ROOT
from batchline.testing.decoder import build_gpt
from batchline.testing.onnx_models import ONNX_TYPES, save_identity_model, save_triton_example_models
from batchline.testing.polling import poll

BODY_CAP = 1 << 20


@pytest.fixture(scope="module")
def rest_repository(tmp_path_factory, model_repository):
    repo = tmp_path_factory.mktemp("rest-repo")
    save_identity_model(repo)
    save_triton_example_models(repo)
    build_gpt(repo)
    for name in ("mlp", "minilm"):
        (repo / name).symlink_to(model_repository / name)
    return repo


@pytest.fixture(scope="module")
def rest_mesh(rest_repository):
    from batchline.testing.in_process import InProcessMesh

    with InProcessMesh(None, str(rest_repository), gateway_overrides={"max_message_bytes": BODY_CAP}) as m:
        yield m


@contextlib.contextmanager
def http_client(mesh, **kwargs):
    """A tritonclient.http client, closed and collected on this thread: its gevent pool may not be
    joined from another (the mesh's, should the garbage collector run there)."""
    client = th.InferenceServerClient(mesh.http_address, **kwargs)
    try:
        yield client
    finally:
        client.close()
        del client
        gc.collect()


def _values(datatype: str, rng: np.random.Generator) -> np.ndarray:
    shape = (2, 3)
    if datatype == "BYTES":
        return np.array([["héllo", "", "a b"], ["batch", "line", "\u2603"]], dtype=object)
    if datatype == "BOOL":
        return rng.integers(0, 2, shape).astype(bool)
    dtype = np.dtype(tg.triton_to_np_dtype(datatype))
    if dtype.kind == "f":
        return (rng.standard_normal(shape) * 100).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)


def _raw(array: np.ndarray) -> list:
    """What comparing bit for bit compares: the bytes of a numeric array, the elements of a BYTES one."""
    if array.dtype == object:
        return [v if isinstance(v, bytes) else v.encode() for v in array.flatten()]
    return [array.tobytes(), array.dtype.str, array.shape]


def _http_infer(client, arrays: dict[str, np.ndarray], binary_in: bool, binary_out: bool):
    inputs = []
    for datatype, array in arrays.items():
        tensor = th.InferInput(f"in_{datatype}", list(array.shape), datatype)
        tensor.set_data_from_numpy(array, binary_data=binary_in)
        inputs.append(tensor)
    outputs = [th.InferRequestedOutput(f"out_{dt}", binary_data=binary_out) for dt in arrays]
    return client.infer("identity", inputs, outputs=outputs, request_id="r-1")


@pytest.mark.parametrize("binary_in,binary_out", [(True, True), (False, False), (True, False), (False, True)])
def test_every_datatype_answers_as_grpc_does_bit_for_bit(rest_mesh, binary_in, binary_out):
    rng = np.random.default_rng(7)
    arrays = {dt: _values(dt, rng) for dt in ONNX_TYPES}
    grpc_client = tg.InferenceServerClient(rest_mesh.address)
    grpc_inputs = []
    for datatype, array in arrays.items():
        tensor = tg.InferInput(f"in_{datatype}", list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        grpc_inputs.append(tensor)
    by_grpc = grpc_client.infer("identity", grpc_inputs)
    with http_client(rest_mesh) as client:
        by_http = _http_infer(client, arrays, binary_in, binary_out)
    assert by_http.get_response()["id"] == "r-1" and by_http.get_response()["model_name"] == "identity"
    for datatype, array in arrays.items():
        got = by_http.as_numpy(f"out_{datatype}")
        expected = by_grpc.as_numpy(f"out_{datatype}")
        if datatype == "BYTES" and not binary_out:
            got = np.array([v.encode() for v in got.flatten()], dtype=object).reshape(got.shape)
        assert _raw(got) == _raw(expected), datatype
        assert _raw(expected) == _raw(array.astype(expected.dtype) if datatype != "BYTES" else
                                      np.array([v.encode() for v in array.flatten()], dtype=object)), datatype
    grpc_client.close()


def test_async_infer_and_the_aio_client(rest_mesh):
    x = np.random.default_rng(1).random((4, 32), dtype=np.float32)
    grpc_client = tg.InferenceServerClient(rest_mesh.address)
    grpc_in = tg.InferInput("features", [4, 32], "FP32")
    grpc_in.set_data_from_numpy(x)
    expected = grpc_client.infer("mlp", [grpc_in]).as_numpy("probability")
    grpc_client.close()

    tensor = th.InferInput("features", [4, 32], "FP32")
    tensor.set_data_from_numpy(x)
    with http_client(rest_mesh, concurrency=4) as client:
        pending = [client.async_infer("mlp", [tensor]) for _ in range(8)]
        for request in pending:
            assert request.get_result().as_numpy("probability").tobytes() == expected.tobytes()

    async def aio() -> list[bytes]:
        async with tha.InferenceServerClient(rest_mesh.http_address) as aclient:
            assert await aclient.is_server_ready()
            answers = await asyncio.gather(*(aclient.infer("mlp", [tensor]) for _ in range(4)))
            return [a.as_numpy("probability").tobytes() for a in answers]

    assert asyncio.run(aio()) == [expected.tobytes()] * 4


def test_health_metadata_config_statistics_and_repository(rest_mesh):
    grpc_client = tg.InferenceServerClient(rest_mesh.address)
    with http_client(rest_mesh) as client:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("mlp") and client.is_model_ready("mlp", "1")
        assert not client.is_model_ready("nope")
        meta = client.get_server_metadata()
        assert meta["name"] == "batchline" and "binary_tensor_data" in meta["extensions"]
        model = client.get_model_metadata("simple", "1")
        assert model["versions"] == ["1"] and model["platform"] == "onnxruntime_onnx"
        assert model["inputs"][0] == {"name": "INPUT0", "datatype": "INT32", "shape": [-1, 16]}
        config = client.get_model_config("simple")
        assert config["max_batch_size"] == 8 and config["input"][0]["data_type"] == "TYPE_INT32"
        assert config["input"][0]["dims"] == [16]
        assert config["dynamic_batching"]["default_queue_policy"]["timeout_action"] == "REJECT"
        # The same answers as gRPC's, in numbers (protobuf's JSON would quote 64-bit integers).
        grpc_stats = grpc_client.get_inference_statistics("simple", as_json=True)
        stats = client.get_inference_statistics("simple")
        assert stats["model_stats"][0]["inference_count"] == int(grpc_stats["model_stats"][0].get("inference_count", 0))
        assert isinstance(stats["model_stats"][0]["inference_count"], int)
        assert len(client.get_inference_statistics()["model_stats"]) == 7
        index = client.get_model_repository_index()
        assert {(e["name"], e["state"]) for e in index} == {
            (m, "READY") for m in ("gpt", "identity", "minilm", "mlp", "simple", "simple_identity", "simple_string")}
        with pytest.raises(InferenceServerException) as info:
            client.get_model_metadata("wrong_model_name")
        assert info.value.status() == "404" and info.value.message().startswith("Request for unknown model")
        with pytest.raises(InferenceServerException) as info:
            client.load_model("simple")
        assert info.value.status() == "503" and "explicit" in info.value.message()
    grpc_client.close()


def _post(address: str, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict, bytes]:
    host, port = address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request("POST", path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def _simple_body(binary_size: int = 64) -> tuple[bytes, int]:
    header = json.dumps({"inputs": [
        {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "parameters": {"binary_data_size": binary_size}},
        {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))}]}).encode()
    return header + np.arange(16, dtype="<i4").tobytes(), len(header)


def _inference_count(mesh) -> int:
    stats = mesh.call(mesh.gateway.gateway.catalog.statistics("simple", ""))
    return sum(s.get("inference_count", 0) for _, s in stats)


@pytest.mark.parametrize("case", ["malformed JSON", "header length past the body", "header length short",
                                  "binary shorter than declared", "binary longer than declared", "over the cap",
                                  "bad header length", "JSON data count"])
def test_malformed_bodies_are_400_naming_the_problem_and_nothing_is_queued(rest_mesh, case):
    body, length = _simple_body()
    headers = {"Inference-Header-Content-Length": str(length)}
    says = {
        "malformed JSON": "not valid JSON",
        "header length past the body": "Inference-Header-Content-Length header says",
        "header length short": "not valid JSON (is Inference-Header-Content-Length right?)",
        "binary shorter than declared": "shorter than declared",
        "binary longer than declared": "add up to 64",
        "over the cap": f"over the gateway's limit of {BODY_CAP}",
        "bad header length": "must be a byte count",
        "JSON data count": "has 15 values in `data`",
    }[case]
    if case == "malformed JSON":
        body = b"{" + body[1:length - 1] + body[length:]
        headers["Inference-Header-Content-Length"] = str(length - 1)
    elif case == "header length past the body":
        headers["Inference-Header-Content-Length"] = str(len(body) + 1)
    elif case == "header length short":
        headers["Inference-Header-Content-Length"] = str(length - 5)
    elif case == "binary shorter than declared":
        body = body[:-4]
    elif case == "binary longer than declared":
        body = body + b"\0\0\0\0"
    elif case == "over the cap":
        body = body + bytes(BODY_CAP)
    elif case == "bad header length":
        headers["Inference-Header-Content-Length"] = "12x"
    elif case == "JSON data count":
        body = body.replace(b"[0, 1, 2,", b"[1, 2,")
        headers["Inference-Header-Content-Length"] = str(length - 3)
    before = _inference_count(rest_mesh)
    status, answer_headers, answer = _post(rest_mesh.http_address, "/v2/models/simple/infer", body, headers)
    assert status == 400, answer
    assert answer_headers["content-type"] == "application/json"
    assert says in json.loads(answer)["error"]
    assert not rest_mesh.gateway.gateway.replies.waiting
    # A good request goes through, and is the only one counted.
    good, good_length = _simple_body()
    status, answer_headers, answer = _post(rest_mesh.http_address, "/v2/models/simple/infer", good,
                                           {"Inference-Header-Content-Length": str(good_length)})
    assert status == 200, answer
    assert _inference_count(rest_mesh) == before + 1


def test_json_without_binary_and_binary_data_output(rest_mesh):
    body = json.dumps({"id": "x-1", "parameters": {"binary_data_output": True, "priority": 1, "timeout": 2_000_000},
                       "inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32", "data": [[3] * 16]}
                                  for n in ("INPUT0", "INPUT1")]}).encode()
    status, headers, answer = _post(rest_mesh.http_address, "/v2/models/simple/versions/1/infer", body,
                                    {"Content-Type": "application/json"})
    assert status == 200, answer
    length = int(headers["inference-header-content-length"])
    header = json.loads(answer[:length])
    assert header["id"] == "x-1" and header["model_version"] == "1"
    assert [o["parameters"]["binary_data_size"] for o in header["outputs"]] == [64, 64]
    assert np.frombuffer(answer[length:length + 64], "<i4").tolist() == [6] * 16
    assert np.frombuffer(answer[length + 64:], "<i4").tolist() == [0] * 16


@pytest.mark.parametrize("path,body,headers,status,says", [
    ("/v2/models/nope/infer", b"{}", {}, 404, "Request for unknown model: 'nope'"),
    ("/v2/models/simple/infer", json.dumps({"inputs": [
        {"name": n, "shape": [1, 16], "datatype": "FP32", "data": [0.0] * 16} for n in ("INPUT0", "INPUT1")]}).encode(),
     {}, 400, "input 'INPUT0' of model 'simple' must be INT32, got FP32"),
    ("/v2/models/simple/infer", json.dumps({"inputs": []}).encode(), {}, 400, "expects inputs"),
    ("/v2/models/simple/infer", b"{}", {"Batchline-Timeout-Ms": "soon"}, 400,
     "batchline-timeout-ms header must be a number of milliseconds"),
    ("/v2/nothing", b"", {}, 404, "no such endpoint: POST /v2/nothing"),
])
def test_refusals_have_their_http_status_and_the_grpc_message(rest_mesh, path, body, headers, status, says):
    got, answer_headers, answer = _post(rest_mesh.http_address, path, body, headers)
    assert got == status and says in json.loads(answer)["error"], answer


def test_a_budget_too_short_is_504_as_deadline_exceeded_is(rest_mesh):
    body, length = _simple_body()
    status, _, answer = _post(rest_mesh.http_address, "/v2/models/simple/infer", body,
                              {"Inference-Header-Content-Length": str(length), "Batchline-Timeout-Ms": "0.001"})
    assert status == 504, answer
    # Refused by admission (too short a budget), or found spent already: the header counts from the
    # request's arrival, and reading it takes more than a microsecond.
    error = json.loads(answer)["error"]
    assert "budget" in error or "the request's deadline had passed" in error, error


def test_a_client_that_hangs_up_while_its_request_is_queued_withdraws_it(mesh_factory, caplog):
    m = mesh_factory(models=["mlp"])
    r = redis.Redis.from_url(m.redis_url)
    # A scheduler of the test's holds the lease: the mesh's stands by, and nothing is dispatched.
    taken = time.monotonic()
    r.set(contract.LEADER, "held-by-the-test", px=120_000)
    scheduler = m.scheduler.scheduler
    poll(lambda: scheduler.lease.attempted_at > taken and not scheduler.leader, 15, "the scheduler to stand by")
    queue = contract.queue(("mlp", "1"))
    body = json.dumps({"inputs": [{"name": "features", "shape": [1, 32], "datatype": "FP32",
                                   "data": [0.5] * 32}]}).encode()
    host, port = m.http_address.rsplit(":", 1)
    # A minute's budget: the request cannot leave its queue by timing out during the test.
    head = (f"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Batchline-Timeout-Ms: 60000\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((host, int(port)), timeout=10) as client:
        client.sendall(head + body)
        poll(lambda: r.zcard(queue) == 1, 15, "the request queued")
        [member] = r.zrange(queue, 0, -1)
        payload = contract.payload(("mlp", "1"), pb.QueueEntry.FromString(member).request_id)
        assert r.exists(payload)
    hung_up = time.monotonic()
    poll(lambda: r.zcard(queue) == 0, 10, "the request to leave its queue")
    assert time.monotonic() - hung_up < 5  # withdrawn at the hang-up, not at its deadline
    assert not r.exists(payload)
    poll(lambda: not m.gateway.gateway.replies.waiting, 10, "the gateway to stop waiting for its reply")
    assert not [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.ERROR]  # uvicorn's included
    # Dispatching again, the mesh answers the next request and never runs the withdrawn one.
    r.delete(contract.LEADER)
    status, _, answer = _post(m.http_address, "/v2/models/mlp/infer", body)
    assert status == 200, answer
    stats = m.call(m.gateway.gateway.catalog.statistics("mlp", "1"))
    assert [s.get("inference_count", 0) for _, s in stats] == [1]


@pytest.mark.parametrize("example,flags,says", [
    ("simple_http_infer_client", [], "15 + -1 = 14"),
    ("simple_http_infer_client", ["--request-compression-algorithm", "gzip"], "15 + -1 = 14"),
    ("simple_http_infer_client", ["--request-compression-algorithm", "deflate"], "15 + -1 = 14"),
    ("simple_http_async_infer_client", [], "15 + 1 = 16"),
    ("simple_http_string_infer_client", [], "PASS: string"),
    ("simple_http_health_metadata", [], "'name': 'simple'")])
def test_tritons_http_example_clients_pass_unmodified(rest_mesh, example, flags, says):
    script = ROOT / "tests" / "triton_examples" / f"{example}.py"
    out = subprocess.run([sys.executable, str(script), "-u", rest_mesh.http_address, *flags], capture_output=True,
                         text=True, timeout=120)
    # Each exits 1 on a wrong answer or error message.
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert says in out.stdout


def test_the_repository_extension_loads_and_unloads_in_explicit_mode(rest_repository):
    from batchline.testing.in_process import InProcessMesh

    with InProcessMesh(None, str(rest_repository), gateway_overrides={"model_control_mode": "explicit"},
              executor_overrides={"model_control_mode": "explicit", "load_model": ["simple"]}) as m, \
            http_client(m) as client:
        assert client.is_model_ready("simple") and not client.is_model_ready("simple_string")
        index = {e["name"]: e["state"] for e in client.get_model_repository_index()}
        assert index["simple"] == "READY" and index["simple_string"] == ""
        client.load_model("simple_string")
        assert client.is_model_ready("simple_string")
        client.unload_model("simple_string")
        assert not client.is_model_ready("simple_string")
        with pytest.raises(InferenceServerException) as info:
            client.load_model("nope")
        assert info.value.status() == "404" and "failed to load 'nope'" in info.value.message()
        # Triton's load overrides, as over gRPC: a config, and files (base64 in the JSON body).
        client.load_model("simple", config='{"max_batch_size": 16}')
        assert client.get_model_config("simple")["max_batch_size"] == 16
        onnx_file = (rest_repository / "simple" / "1" / "model.onnx").read_bytes()
        client.load_model("simple_copy", config="{}", files={"file:1/model.onnx": onnx_file})
        assert client.is_model_ready("simple_copy")


def test_text_inputs_in_json_answer_as_grpc_does(rest_mesh):
    sentences = ["A cat sits on the mat.", "Batching makes small models cheap to serve, at scale."]
    grpc_client = tg.InferenceServerClient(rest_mesh.address)
    text = tg.InferInput("text", [2, 1], "BYTES")
    text.set_data_from_numpy(np.array([[s.encode()] for s in sentences], dtype=object))
    expected = grpc_client.infer("minilm", [text], client_timeout=120).as_numpy("sentence_embedding")
    grpc_client.close()
    body = json.dumps({"parameters": {"priority": 1}, "inputs": [
        {"name": "text", "shape": [2, 1], "datatype": "BYTES", "data": [[s] for s in sentences]}],
        "outputs": [{"name": "sentence_embedding", "parameters": {"binary_data": True}}]}).encode()
    status, headers, answer = _post(rest_mesh.http_address, "/v2/models/minilm/infer", body,
                                    {"Batchline-Timeout-Ms": "60000"})
    assert status == 200, answer
    length = int(headers["inference-header-content-length"])
    assert answer[length:] == expected.tobytes()


def _curl_blocks() -> list[str]:
    page = (ROOT / "docs" / "reference" / "protocol.md").read_text()
    section = page[page.index("## REST (HTTP)"):]
    return [block.split("```", 1)[0] for block in section.split("```sh\n")[1:]]


def test_the_curl_examples_of_the_protocol_reference_run(rest_mesh):
    blocks = _curl_blocks()
    assert len(blocks) == 5
    outputs = []
    for block in blocks:
        script = block.replace("localhost:8000", rest_mesh.http_address)
        out = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, (block, out.stderr)
        outputs.append(out.stdout)
    ready, metadata = outputs[0].split("\n", 1)
    assert ready == "200" and json.loads(metadata)["name"] == "mlp"
    answer = json.loads(outputs[1])
    assert answer["id"] == "r1" and answer["outputs"][0]["name"] == "probability"
    assert len(json.loads(outputs[2])["outputs"][0]["data"]) == 1
    body, status = outputs[3].rsplit(" ", 1)
    assert status.strip() == "404" and json.loads(body)["error"].startswith("Request for unknown model: 'nope'")
    whole, rest = outputs[4].split("\n", 1)
    streamed, top_level = rest.rstrip("\n").rsplit("\n", 1)
    events = [json.loads(e.removeprefix("data: ")) for e in streamed.split("\n\n") if e]
    assert [t for e in events for t in e["token_ids"]] == json.loads(whole)["token_ids"]
    assert "".join(e["text_output"] for e in events) == json.loads(whole)["text_output"]
    assert json.loads(top_level)["token_ids"] == json.loads(whole)["token_ids"]


def test_compressed_bodies_are_read_within_the_cap(rest_mesh):
    import gzip

    body, length = _simple_body()
    status, _, answer = _post(rest_mesh.http_address, "/v2/models/simple/infer", gzip.compress(body),
                              {"Inference-Header-Content-Length": str(length), "Content-Encoding": "gzip"})
    assert status == 200, answer
    status, _, answer = _post(rest_mesh.http_address, "/v2/models/simple/infer", b"not gzip",
                              {"Content-Encoding": "gzip"})
    assert status == 400 and "not valid gzip data" in json.loads(answer)["error"]
    status, _, answer = _post(rest_mesh.http_address, "/v2/models/simple/infer", gzip.compress(bytes(BODY_CAP + 1)),
                              {"Content-Encoding": "gzip"})
    assert status == 400 and "once decompressed" in json.loads(answer)["error"]
    status, _, answer = _post(rest_mesh.http_address, "/v2/models/simple/infer", body, {"Content-Encoding": "br"})
    assert status == 400 and "'br' is not supported" in json.loads(answer)["error"]


def _exchange(address: str, data: bytes, timeout: float = 10.0) -> bytes:
    """Send raw bytes on a new connection; what comes back until the server closes it."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        got = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return got
            got += chunk


def test_a_request_head_too_large_or_too_slow_is_refused_and_its_connection_closed(rest_mesh, monkeypatch):
    from gateway import http_server

    big = (b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (http_server.HEAD_MAX_BYTES + 1)
           + b"\r\n\r\n")
    assert _exchange(rest_mesh.http_address, big).startswith(b"HTTP/1.1 431 ")
    monkeypatch.setattr(http_server, "HEAD_TIMEOUT_S", 0.5)
    began = time.monotonic()
    answer = _exchange(rest_mesh.http_address, b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n")  # and no more
    assert answer.startswith(b"HTTP/1.1 408 ") and time.monotonic() - began < 5
    assert _exchange(rest_mesh.http_address, b"").startswith(b"HTTP/1.1 408 ")  # one that sends nothing too
    # A whole head in time is served, and its connection kept.
    status, headers, _ = _post(rest_mesh.http_address, "/v2/models/simple/infer", *_simple_body()[:1],
                               {"Inference-Header-Content-Length": str(_simple_body()[1])})
    assert status == 200 and headers.get("connection") != "close"


def test_a_body_answered_before_it_is_read_is_dropped_for_a_while_then_its_connection_closed(rest_mesh,
                                                                                              monkeypatch):
    from gateway import http_server

    # The client sends the whole body, then reads the answer: it gets it, on a connection kept.
    status, headers, answer = _post(rest_mesh.http_address, "/v2/models/no-such-model/infer", bytes(100_000))
    assert status == 404 and b"no-such-model" in answer
    # One that goes on sending (a body of a terabyte) has its connection closed once the time is up.
    monkeypatch.setattr(http_server, "DISCARD_S", 0.5)
    host, port = rest_mesh.http_address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v2/models/no-such-model/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % 10**12)
        began, closed = time.monotonic(), False
        while time.monotonic() - began < 8:
            try:
                s.sendall(bytes(65536))
            except OSError:  # the server closed it
                closed = True
                break
            time.sleep(0.01)
    assert closed and time.monotonic() - began < 8


def test_a_framing_header_given_twice_with_different_values_is_400(rest_mesh):
    body, length = _simple_body()
    head = (f"POST /v2/models/simple/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
            f"Inference-Header-Content-Length: {length}\r\nInference-Header-Content-Length: {length - 1}\r\n"
            "Connection: close\r\n\r\n").encode()
    answer = _exchange(rest_mesh.http_address, head + body)
    assert answer.startswith(b"HTTP/1.1 400 ") and b"given 2 times with different values" in answer


def test_a_body_that_stalls_is_given_up(rest_mesh, monkeypatch):
    from gateway import rest

    monkeypatch.setattr(rest, "UPLOAD_IDLE_S", 0.5)
    head = b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
    answer = _exchange(rest_mesh.http_address, head + b"{" * 10)  # then nothing
    assert answer.startswith(b"HTTP/1.1 400 ") and b"the request body stalled" in answer


def test_a_request_past_the_connection_cap_is_answered_503_and_its_connection_closed():
    from gateway.http_server import HttpServer

    async def ok(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def ask(reader, writer) -> tuple[bytes, bytes]:
        writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        head = (await reader.readuntil(b"\r\n\r\n")).lower()
        return head, await reader.readexactly(int(head.split(b"content-length: ")[1].split(b"\r\n")[0]))

    async def scenario() -> None:
        server = HttpServer(ok, "127.0.0.1", 0, max_connections=2)
        port = await server.start()
        try:
            kept = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
            for connection in kept:
                assert (await ask(*connection))[0].startswith(b"http/1.1 200")
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            head, body = await ask(reader, writer)
            assert head.startswith(b"http/1.1 503") and b"retry-after: 1\r\n" in head
            assert "at most 2 REST connections" in json.loads(body)["error"]
            assert await reader.read() == b""  # and closed
            writer.close()
            assert (await ask(*kept[0]))[0].startswith(b"http/1.1 200")  # those within the cap go on
            kept[1][1].close()
            await kept[1][1].wait_closed()
            # Once the server has seen one close, a new connection is served.
            deadline = time.monotonic() + 10
            while True:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                head, _ = await ask(reader, writer)
                writer.close()
                if head.startswith(b"http/1.1 200") or time.monotonic() > deadline:
                    break
            assert head.startswith(b"http/1.1 200"), head
        finally:
            await server.stop()

    asyncio.run(scenario())
