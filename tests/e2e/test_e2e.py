"""End to end through stock tritonclient: gateway -> Redis -> scheduler -> executor -> back."""
from __future__ import annotations

import asyncio
import queue

import grpc
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as tc
import tritonclient.grpc.aio as tca
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from batchline.demo_models import load_minilm_tokenizer
from batchline.protocol import inference_pb2 as ipb

SENTENCES = [
    "A man is eating food.",
    "The quick brown fox jumps over the lazy dog, twice, because once was not enough.",
    "Batching",
    "ONNX Runtime runs the model on whatever execution provider the host has.",
]


@pytest.fixture(scope="module")
def sessions(model_repository):
    return {
        name: ort.InferenceSession(str(model_repository / name / "1" / "model.onnx"),
                                   providers=["CPUExecutionProvider"])
        for name in ("mlp", "minilm")
    }


@pytest.fixture(scope="module")
def client(mesh):
    c = tc.InferenceServerClient(mesh.address)
    yield c
    c.close()


def mlp_input(x: np.ndarray) -> tc.InferInput:
    inp = tc.InferInput("features", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return inp


def minilm_inputs(tokenizer, sentence: str, module=tc) -> tuple[list, dict[str, np.ndarray]]:
    enc = tokenizer([sentence], return_tensors="np")
    feeds = {"input_ids": enc["input_ids"].astype(np.int64), "attention_mask": enc["attention_mask"].astype(np.int64)}
    inputs = []
    for name, arr in feeds.items():
        inp = module.InferInput(name, list(arr.shape), "INT64")
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    return inputs, feeds


def test_server_and_model_metadata(client):
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("mlp") and client.is_model_ready("minilm", "1")
    meta = client.get_server_metadata()
    assert meta.name == "batchline" and "statistics" in meta.extensions
    mm = client.get_model_metadata("minilm")
    # The token ids, and the text the gateway tokenizes into them ([tokenizer] in config.toml).
    assert [(i.name, i.datatype, list(i.shape)) for i in mm.inputs] == [
        ("input_ids", "INT64", [-1, -1]), ("attention_mask", "INT64", [-1, -1]), ("text", "BYTES", [-1, 1])]
    assert mm.outputs[0].name == "sentence_embedding" and list(mm.outputs[0].shape) == [-1, 384]
    assert list(mm.versions) == ["1"] and mm.platform == "onnxruntime_onnx"


def test_model_config_as_triton_reports_it(client):
    """tritonclient's get_model_config (and so perf_analyzer) reads Triton's ModelConfig from config.toml and the
    session."""
    cfg = client.get_model_config("minilm", as_json=True)["config"]
    assert ((cfg["name"], cfg["platform"], cfg["backend"], cfg["max_batch_size"])
            == ("minilm", "onnxruntime_onnx", "onnxruntime", 32))
    # dims leave the batch dim out, as Triton's do for a batched model
    assert [(i["name"], i["data_type"], i["dims"]) for i in cfg["input"]] == [
        ("input_ids", "TYPE_INT64", ["-1"]), ("attention_mask", "TYPE_INT64", ["-1"]), ("text", "TYPE_STRING", ["1"])]
    assert cfg["parameters"]["text_input"]["string_value"] == "text"
    assert [(o["name"], o["data_type"], o["dims"])
            for o in cfg["output"]] == [("sentence_embedding", "TYPE_FP32", ["384"])]
    batching = cfg["dynamic_batching"]
    assert batching["max_queue_delay_microseconds"] == "5000"
    assert batching["default_priority_level"] == "1"
    assert batching["default_queue_policy"] == {"default_timeout_microseconds": "5000000",
                                                "allow_timeout_override": True}
    assert set(cfg["parameters"]["padded_inputs"]["string_value"].split(",")) == {"input_ids", "attention_mask"}
    assert cfg["parameters"]["providers"]["string_value"] == "CPUExecutionProvider"
    mlp = client.get_model_config("mlp", "1").config  # Triton's own ModelConfig message parses it
    assert mlp.max_batch_size == 64 and [list(i.dims) for i in mlp.input] == [[32]]
    assert mlp.dynamic_batching.max_queue_delay_microseconds == 10000


def test_mlp_matches_in_process_onnxruntime(client, sessions):
    x = np.random.default_rng(0).normal(size=(5, 32)).astype(np.float32)
    result = client.infer("mlp", [mlp_input(x)], request_id="req-17", outputs=[tc.InferRequestedOutput("probability")])
    expected = sessions["mlp"].run(None, {"features": x})[0]
    got = result.as_numpy("probability")
    assert got.shape == (5, 1)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
    assert result.get_response().id == "req-17"
    assert result.get_response().model_version == "1"


def test_minilm_matches_in_process_onnxruntime(client, sessions, model_repository):
    tokenizer = load_minilm_tokenizer(model_repository)
    for sentence in SENTENCES:
        inputs, feeds = minilm_inputs(tokenizer, sentence)
        got = client.infer("minilm", inputs).as_numpy("sentence_embedding")
        expected = sessions["minilm"].run(None, feeds)[0]
        assert got.shape == (1, 384)
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)


async def test_concurrent_minilm_of_different_lengths_batch_with_padding(mesh, sessions, model_repository):
    """Requests of different lengths share batches (padding) and each gets its own embedding back."""
    tokenizer = load_minilm_tokenizer(model_repository)
    client = tca.InferenceServerClient(mesh.address)
    try:
        cases = [minilm_inputs(tokenizer, SENTENCES[i % len(SENTENCES)], tca) for i in range(24)]
        results = await asyncio.gather(*(client.infer("minilm", inputs) for inputs, _ in cases))
        for (inputs, feeds), result in zip(cases, results):
            expected = sessions["minilm"].run(None, feeds)[0]
            np.testing.assert_allclose(result.as_numpy("sentence_embedding"), expected, rtol=0, atol=1e-5)
    finally:
        await client.close()


def test_typed_contents_are_accepted(mesh, sessions):
    """A request with typed `contents` instead of raw bytes (what non-Triton clients send)."""
    x = np.arange(64, dtype=np.float32).reshape(2, 32) / 64
    req = ipb.ModelInferRequest(model_name="mlp", id="typed")
    t = req.inputs.add(name="features", datatype="FP32", shape=[2, 32])
    t.contents.fp32_contents.extend(x.ravel().tolist())
    with grpc.insecure_channel(mesh.address) as channel:
        infer = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=ipb.ModelInferRequest.SerializeToString,
            response_deserializer=ipb.ModelInferResponse.FromString,
        )
        resp = infer(req, timeout=10)
    got = np.frombuffer(resp.raw_output_contents[0], dtype=np.float32).reshape(list(resp.outputs[0].shape))
    np.testing.assert_allclose(got, sessions["mlp"].run(None, {"features": x})[0], atol=1e-6)
    assert resp.id == "typed"


async def test_aio_client(mesh, sessions):
    client = tca.InferenceServerClient(mesh.address)
    try:
        assert await client.is_server_live()
        x = np.ones((1, 32), dtype=np.float32)
        inp = tca.InferInput("features", [1, 32], "FP32")
        inp.set_data_from_numpy(x)
        result = await client.infer("mlp", [inp], request_id="aio-1")
        np.testing.assert_allclose(result.as_numpy("probability"), sessions["mlp"].run(None, {"features": x})[0],
                                   atol=1e-6)
        stats = await client.get_inference_statistics("mlp")
        assert stats.model_stats[0].name == "mlp"
    finally:
        await client.close()


def test_streaming(client, sessions):
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        xs = {f"s{i}": np.full((1, 32), i / 10, dtype=np.float32) for i in range(8)}
        for rid, x in xs.items():
            client.async_stream_infer("mlp", [mlp_input(x)], request_id=rid)
        got = {}
        for _ in xs:
            result, error = answers.get(timeout=20)
            assert error is None, error
            got[result.get_response().id] = result.as_numpy("probability")
    finally:
        client.stop_stream()
    assert set(got) == set(xs)
    for rid, x in xs.items():
        np.testing.assert_allclose(got[rid], sessions["mlp"].run(None, {"features": x})[0], atol=1e-6)


async def test_aio_streaming(mesh, sessions):
    client = tca.InferenceServerClient(mesh.address)
    xs = {f"a{i}": np.full((1, 32), -i / 7, dtype=np.float32) for i in range(6)}

    async def requests():
        for rid, x in xs.items():
            inp = tca.InferInput("features", [1, 32], "FP32")
            inp.set_data_from_numpy(x)
            yield {"model_name": "mlp", "inputs": [inp], "request_id": rid}

    got = {}
    try:
        async for result, error in client.stream_infer(requests()):
            assert error is None, error
            got[result.get_response().id] = result.as_numpy("probability")
            if len(got) == len(xs):
                break
    finally:
        await client.close()
    for rid, x in xs.items():
        np.testing.assert_allclose(got[rid], sessions["mlp"].run(None, {"features": x})[0], atol=1e-6)


def _stats(client, model):
    s = client.get_inference_statistics(model).model_stats[0]
    return s.inference_count, s.execution_count, {b.batch_size: b.compute_infer.count for b in s.batch_stats}


async def test_64_concurrent_requests_are_batched(mesh, client, sessions):
    before = _stats(client, "mlp")
    aclient = tca.InferenceServerClient(mesh.address)
    rng = np.random.default_rng(1)
    xs = [rng.normal(size=(1, 32)).astype(np.float32) for _ in range(64)]

    async def one(x):
        inp = tca.InferInput("features", [1, 32], "FP32")
        inp.set_data_from_numpy(x)
        return await aclient.infer("mlp", [inp])

    try:
        results = await asyncio.gather(*(one(x) for x in xs))
    finally:
        await aclient.close()
    for x, r in zip(xs, results):
        np.testing.assert_allclose(r.as_numpy("probability"), sessions["mlp"].run(None, {"features": x})[0], atol=1e-6)
    inferences, executions, batches = _stats(client, "mlp")
    assert inferences - before[0] == 64
    runs = executions - before[1]
    assert runs < 64, f"64 requests ran in {runs} executions: no batching happened"
    new_sizes = {n: c - before[2].get(n, 0) for n, c in batches.items() if c - before[2].get(n, 0) > 0}
    assert max(new_sizes) > 1
    assert sum(n * c for n, c in new_sizes.items()) == 64


async def test_two_executors_share_the_load(mesh_factory, sessions):
    # Without room to queue a second batch on one executor, concurrent batches must spread.
    m = mesh_factory(executors=2, models=["mlp"], max_batches_per_executor=1)
    client = tca.InferenceServerClient(m.address)
    rng = np.random.default_rng(2)

    async def one(x):
        inp = tca.InferInput("features", [2, 32], "FP32")
        inp.set_data_from_numpy(x)
        r = await client.infer("mlp", [inp])
        np.testing.assert_allclose(r.as_numpy("probability"), sessions["mlp"].run(None, {"features": x})[0], atol=1e-6)

    try:
        for _ in range(4):
            await asyncio.gather(*(one(rng.normal(size=(2, 32)).astype(np.float32)) for _ in range(48)))
    finally:
        await client.close()
    executed = [e.executor.executed_batches for e in m.executors]
    assert all(n > 0 for n in executed), f"batches per executor: {executed}"


def test_every_service_serves_health_and_reflection(mesh):
    ports = {
        "gateway": (mesh.gateway.port, "inference.GRPCInferenceService"),
        "scheduler": (mesh.scheduler.port, "batchline.internal.v1.Scheduler"),
        "executor": (mesh.executors[0].port, "batchline.internal.v1.Executor"),
    }
    for name, (port, service) in ports.items():
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for svc in ("", service):
                status = health.Check(health_pb2.HealthCheckRequest(service=svc), timeout=5).status
                assert status == health_pb2.HealthCheckResponse.SERVING, (name, svc)
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            responses = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                       timeout=5))
            listed = {s.name for s in responses[0].list_services_response.service}
            assert service in listed, (name, listed)
            asked = reflection_pb2.ServerReflectionRequest(file_containing_symbol=service)
            fd = list(stub.ServerReflectionInfo(iter([asked]), timeout=5))
            assert fd[0].file_descriptor_response.file_descriptor_proto, \
                (name, "reflection cannot describe the service")
