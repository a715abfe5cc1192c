"""The gateway's group commit on a real mesh: it waits for company only while requests arrive
close together, and never spends more than a tenth of a waiting request's budget doing so."""
from __future__ import annotations

import time

import grpc
import numpy as np
import prometheus_client

from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import inference_pb2_grpc


def _commits() -> float:
    # The services of the tests' meshes share this process's registry; only differences count.
    return prometheus_client.REGISTRY.get_sample_value(
        "batchline_redis_roundtrip_seconds_count", {"service": "gateway", "op": "enqueue"}) or 0.0


def _request(i: int, timeout_us: int | None = None) -> ipb.ModelInferRequest:
    req = ipb.ModelInferRequest(model_name="mlp", id=f"r{i}")
    req.inputs.add(name="features", datatype="FP32", shape=[1, 32])
    req.raw_input_contents.append(np.full((1, 32), i / 100, np.float32).tobytes())
    if timeout_us is not None:
        req.parameters["timeout"].int64_param = timeout_us
    return req


def _paced(stub, n: int, gap_s: float) -> list:
    """n requests, one every gap_s, all in flight together; their calls."""
    calls = []
    for i in range(n):
        calls.append(stub.ModelInfer.future(_request(i), timeout=30))
        time.sleep(gap_s)
    return calls


def _commits_for_paced_requests(mesh_factory, linger_ms: float, n: int = 30, gap_s: float = 0.01) -> float:
    m = mesh_factory(models=["mlp"], gateway_overrides={"commit_linger_ms": linger_ms})
    with grpc.insecure_channel(m.address) as channel:
        stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
        stub.ModelInfer(_request(0), timeout=30)  # warm
        before = _commits()
        replies = [c.result() for c in _paced(stub, n, gap_s)]
    assert [r.id for r in replies] == [f"r{i}" for i in range(n)]
    return _commits() - before


def test_requests_arriving_within_the_window_share_commits(mesh_factory):
    # 10 ms apart, a 200 ms window: about 20 requests to a commit.
    assert _commits_for_paced_requests(mesh_factory, 200.0) <= 30 / 4


def test_without_a_window_requests_apart_are_committed_one_by_one(mesh_factory):
    # The same traffic with no window: each request is alone when its commit goes.
    assert _commits_for_paced_requests(mesh_factory, 0.0) >= 30 / 2


def test_a_tight_budget_cuts_a_long_wait_short(mesh_factory):
    # A 10 s window that dense traffic keeps open; each of these requests may wait a tenth of its 30 s.
    m = mesh_factory(models=["mlp"], gateway_overrides={"commit_linger_ms": 10_000.0})
    with grpc.insecure_channel(m.address) as channel:
        stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
        patient = _paced(stub, 8, 0.01)
        # A request with a 500 ms budget joins the commit, which would wait 3 s: it must go within
        # 50 ms, or the gateway answers DEADLINE_EXCEEDED when the budget runs out.
        reply = stub.ModelInfer(_request(99, timeout_us=500_000), timeout=30)
        assert reply.id == "r99"
        assert [c.result().id for c in patient] == [f"r{i}" for i in range(8)]
