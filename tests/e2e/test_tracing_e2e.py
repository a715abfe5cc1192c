"""Tracing end to end: `batchline up`'s processes export OTLP spans to a real receiver.

One traced mlp request must come back as two linked traces:

    request trace (the client's):  ModelInfer [gateway] -> enqueue [gateway]
                                                        -> queue_wait [scheduler]
                                                        -> execute [executor]
    batch trace (its own):         batch [scheduler, links to ModelInfer] -> run_batch [executor] -> fetch/infer/write

`pytest -s` prints both trees.
"""
from __future__ import annotations

import argparse
import os

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from batchline.mesh import Mesh
from batchline.testing.otlp_receiver import OtlpReceiver, ReceivedSpan, format_tree

CLIENT_TRACE_ID = os.urandom(16).hex()
CLIENT_SPAN_ID = os.urandom(8).hex()
REQUEST_ID = "trace-e2e-1"
EXECUTOR_ID = "executor-0"  # what batchline.mesh.Mesh names its first executor
SLACK_NS = 1_000_000  # timestamps travel in µs through Redis: allow for the rounding


@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as r:
        yield r


@pytest.fixture(scope="module")
def traced(receiver, model_repository):
    args = argparse.Namespace(
        model_repository=str(model_repository), redis_url="", executors=1, gateway_port=0, http_port=0,
        host="127.0.0.1", log_level="WARNING", startup_timeout=120.0,
    )
    # Whatever OTEL_* the caller's shell has must not leak in: each service names itself batchline-<service>.
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("OTEL_")}
    env.update(
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
        OTEL_EXPORTER_OTLP_INSECURE="true",
        OTEL_BSP_SCHEDULE_DELAY="100",
        OTEL_TRACES_SAMPLER="parentbased_always_on",
        # Metrics endpoints on free ports, so this mesh never collides with anything on 8002-8004.
        BATCHLINE_GATEWAY_METRICS_PORT="0",
        BATCHLINE_SCHEDULER_METRICS_PORT="0",
        BATCHLINE_EXECUTOR_METRICS_PORT="0",
    )
    mesh = Mesh(args, env=env)
    try:
        address = mesh.start()
        yield mesh, address
    finally:
        mesh.stop()


@pytest.fixture(scope="module")
def traced_mesh(traced):
    """The gateway's gRPC address."""
    return traced[1]


def _one(spans: list[ReceivedSpan], **match) -> ReceivedSpan | None:
    found = [s for s in spans if all(getattr(s, k) == v for k, v in match.items())]
    return found[0] if len(found) == 1 else None


def _linked_to(span: ReceivedSpan, target: ReceivedSpan) -> bool:
    return (target.trace_id, target.span_id) in span.links


def _find(spans: list[ReceivedSpan]) -> dict[str, ReceivedSpan] | None:
    """The spans of our request and of its batch, once every one has arrived."""
    request = [s for s in spans if s.trace_id == CLIENT_TRACE_ID]
    infer = _one(request, name="ModelInfer")
    if infer is None:
        return None
    found = {"ModelInfer": infer}
    for name in ("enqueue", "queue_wait", "execute"):
        span = _one(request, name=name)
        if span is None:
            return None
        found[name] = span
    batch = next((s for s in spans if s.name == "batch" and _linked_to(s, infer)), None)
    if batch is None:
        return None
    found["batch"] = batch
    run = _one(spans, name="run_batch", trace_id=batch.trace_id, parent_span_id=batch.span_id)
    if run is None:
        return None
    found["run_batch"] = run
    for name in ("fetch", "infer", "write"):
        span = _one(spans, name=name, trace_id=run.trace_id, parent_span_id=run.span_id)
        if span is None:
            return None
        found[name] = span
    return found


def test_one_request_is_traced_through_all_three_services(traced_mesh, receiver):
    # Health and reflection first: they must never be traced.
    with grpc.insecure_channel(traced_mesh) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        replies = list(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
        assert any(s.name == "inference.GRPCInferenceService" for s in replies[0].list_services_response.service)

    client = tc.InferenceServerClient(traced_mesh)
    try:
        x = np.random.default_rng(1).normal(size=(1, 32)).astype(np.float32)
        inp = tc.InferInput("features", [1, 32], "FP32")
        inp.set_data_from_numpy(x)
        result = client.infer("mlp", [inp], request_id=REQUEST_ID,
                              headers={"traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"})
        assert result.as_numpy("probability").shape == (1, 1)
    finally:
        client.close()

    spans = receiver.wait_for(lambda got: _find(got) is not None, timeout=30)
    check_traces(spans)


def check_traces(spans: list[ReceivedSpan]) -> None:
    s = _find(spans)
    print("\n" + format_tree([x for x in spans if x.trace_id in (CLIENT_TRACE_ID, s["batch"].trace_id)]))

    # The request trace spans all three services, each under its default name.
    request = [x for x in spans if x.trace_id == CLIENT_TRACE_ID]
    assert {x.service for x in request} == {"batchline-gateway", "batchline-scheduler", "batchline-executor"}

    infer = s["ModelInfer"]
    assert infer.service == "batchline-gateway" and infer.kind == "SERVER"
    assert infer.parent_span_id == CLIENT_SPAN_ID  # continues the client's traceparent
    assert infer.attributes["batchline.model"] == "mlp"
    assert infer.attributes["batchline.model_version"] == "1"
    assert infer.attributes["batchline.request_id"]
    assert infer.status != "ERROR"

    enqueue, wait, execute = s["enqueue"], s["queue_wait"], s["execute"]
    assert enqueue.service == "batchline-gateway" and enqueue.parent_span_id == infer.span_id
    assert wait.service == "batchline-scheduler" and wait.parent_span_id == infer.span_id
    assert execute.service == "batchline-executor" and execute.parent_span_id == infer.span_id

    # queue_wait is recorded after the fact: enqueue time -> dispatch time, inside the request.
    assert infer.start_ns - SLACK_NS <= wait.start_ns <= wait.end_ns <= infer.end_ns + SLACK_NS
    batch_id = wait.attributes["batchline.batch_id"]
    assert batch_id
    assert wait.attributes["batchline.dispatch_reason"] in ("full", "preferred", "deadline", "delay", "no_company")
    assert isinstance(wait.attributes["batchline.slack_ms"], (int, float))

    assert execute.attributes["batchline.batch_id"] == batch_id
    assert execute.attributes["batchline.executor_id"] == EXECUTOR_ID
    assert execute.attributes["batchline.provider"] == "CPUExecutionProvider"
    assert execute.attributes["batchline.batch_size"] >= 1

    # The batch trace: its own trace, linked to every member's ModelInfer.
    batch, run = s["batch"], s["run_batch"]
    assert batch.service == "batchline-scheduler" and batch.trace_id != CLIENT_TRACE_ID
    assert batch.parent_span_id == ""
    assert (CLIENT_TRACE_ID, infer.span_id) in batch.links
    assert batch.attributes["batchline.model"] == "mlp" and batch.attributes["batchline.model_version"] == "1"
    assert batch.attributes["batchline.batch_size"] == execute.attributes["batchline.batch_size"]
    assert batch.attributes["batchline.requests"] == len(batch.links) >= 1
    assert batch.attributes["batchline.dispatch_reason"] == wait.attributes["batchline.dispatch_reason"]
    assert isinstance(batch.attributes["batchline.min_slack_ms"], (int, float))
    assert batch.attributes["batchline.executor_id"] == EXECUTOR_ID

    assert run.service == "batchline-executor" and run.parent_span_id == batch.span_id
    assert run.attributes["batchline.provider"] == "CPUExecutionProvider"
    assert run.attributes["batchline.executor_id"] == EXECUTOR_ID
    assert run.attributes["batchline.model"] == "mlp" and run.attributes["batchline.model_version"] == "1"
    for name in ("fetch", "infer", "write"):
        assert s[name].service == "batchline-executor"
        assert run.start_ns <= s[name].start_ns <= s[name].end_ns <= run.end_ns

    # Nothing of the health check or the reflection call was traced.
    for x in spans:
        services = {str(v) for k, v in x.attributes.items() if k in ("rpc.service", "rpc.method")}
        text = " ".join([x.name, *services]).lower()
        assert "health" not in text and "reflection" not in text and x.name != "Check", x


def test_a_rest_request_joins_the_clients_trace_as_grpc_ones_do(traced, receiver):
    mesh, _ = traced
    import http.client
    import json

    trace_id, span_id = os.urandom(16).hex(), os.urandom(8).hex()
    body = json.dumps({"inputs": [{"name": "features", "shape": [1, 32], "datatype": "FP32", "data": [0.5] * 32}]})
    connection = http.client.HTTPConnection("127.0.0.1", mesh.http_port, timeout=30)
    try:
        connection.request("POST", "/v2/models/mlp/infer", body=body,
                           headers={"traceparent": f"00-{trace_id}-{span_id}-01"})
        assert connection.getresponse().status == 200
    finally:
        connection.close()

    def found(spans: list[ReceivedSpan]) -> bool:
        names = {s.name for s in spans if s.trace_id == trace_id}
        return {"HTTP ModelInfer", "enqueue", "queue_wait", "execute"} <= names

    spans = [s for s in receiver.wait_for(found, timeout=30) if s.trace_id == trace_id]
    infer = _one(spans, name="HTTP ModelInfer")
    assert infer.service == "batchline-gateway" and infer.kind == "SERVER" and infer.parent_span_id == span_id
    assert infer.attributes["batchline.model"] == "mlp"
    assert {s.service for s in spans} == {"batchline-gateway", "batchline-scheduler", "batchline-executor"}


def test_a_generated_sequence_is_one_span_with_its_steps_as_events(traced_mesh, receiver):
    trace_id, span_id = os.urandom(16).hex(), os.urandom(8).hex()
    prompt = tc.InferInput("text_input", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([b"def main("], dtype=object))
    with tc.InferenceServerClient(traced_mesh) as client:
        result = client.infer("gpt", [prompt], headers={"traceparent": f"00-{trace_id}-{span_id}-01"},
                              parameters={"max_tokens": 12, "ignore_eos": True, "temperature": 0})
    assert len(result.as_numpy("token_ids")) == 12

    def found(spans: list[ReceivedSpan]) -> bool:
        return {"ModelInfer", "generate"} <= {s.name for s in spans if s.trace_id == trace_id}

    spans = [s for s in receiver.wait_for(found, timeout=30) if s.trace_id == trace_id]
    generate = _one(spans, name="generate")
    assert generate.service == "batchline-executor" and generate.status == "UNSET"
    infer = _one(spans, name="ModelInfer")
    assert generate.parent_span_id == infer.span_id and infer.parent_span_id == span_id
    assert generate.attributes["batchline.finish_reason"] == "length"
    assert generate.attributes["batchline.generated_tokens"] == 12
    assert generate.attributes["batchline.prompt_tokens"] >= 1
    steps = [e for e in generate.events if e[0] == "step"]
    assert sum(e[2]["batchline.tokens"] for e in steps) == 12
    assert [e[2]["batchline.index"] for e in steps] == sorted(e[2]["batchline.index"] for e in steps)
    assert [e[0] for e in generate.events].count("first_token") == 1
    flushes = [e[2] for e in generate.events if e[0] == "flush"]
    assert flushes[0] == {"batchline.responses": 1, "batchline.tokens": 1}, "the first token goes at once, alone"
    assert sum(f["batchline.tokens"] for f in flushes) < 12  # the rest: in the final write
    assert all(f["batchline.responses"] == 1 for f in flushes), "a flush pushes one response of its tokens"
    times = [e[1] for e in generate.events]
    assert times == sorted(times) and generate.start_ns <= times[0] and times[-1] <= generate.end_ns
