"""The gateway's group commit on a real mesh: it waits for company only while requests arrive
close together and many are in flight, and never spends more than a tenth of a waiting request's
budget doing so. The scheduler stands by (its lease held by someone else) while requests arrive, so
that they all stay in flight."""
from __future__ import annotations

import time

import grpc
import numpy as np
import prometheus_client
import redis

from batchline import contract
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import inference_pb2_grpc
from batchline.testing.polling import poll


def _commits() -> float:
    # The services of the tests' meshes share this process's registry; only differences count.
    return prometheus_client.REGISTRY.get_sample_value(
        "batchline_redis_roundtrip_seconds_count", {"service": "gateway", "op": "enqueue"}) or 0.0


def _request(i: int, timeout_us: int) -> ipb.ModelInferRequest:
    req = ipb.ModelInferRequest(model_name="mlp", id=f"r{i}")
    req.inputs.add(name="features", datatype="FP32", shape=[1, 32])
    req.raw_input_contents.append(np.full((1, 32), i / 100, np.float32).tobytes())
    req.parameters["timeout"].int64_param = timeout_us
    return req


def _paced(stub, n: int, gap_s: float) -> list:
    """n requests with 60 s budgets, one every gap_s; their calls."""
    calls = []
    for i in range(n):
        calls.append(stub.ModelInfer.future(_request(i, 60_000_000), timeout=90))
        time.sleep(gap_s)
    return calls


def _stand_by(m) -> redis.Redis:
    r = redis.Redis.from_url(m.redis_url)
    scheduler = m.scheduler.scheduler
    taken = time.monotonic()
    r.set(contract.LEADER, "someone-else", px=120_000)
    poll(lambda: scheduler.lease.attempted_at > taken and not scheduler.leader, 15, "the scheduler to stand by")
    return r


def _lead(m, r: redis.Redis) -> None:
    r.delete(contract.LEADER)
    poll(lambda: m.scheduler.scheduler.leader, 15, "the scheduler to lead again")


def _commits_for_paced_requests(mesh_factory, linger_ms: float, n: int = 30) -> float:
    m = mesh_factory(models=["mlp"], gateway_overrides={"commit_linger_ms": linger_ms})
    with grpc.insecure_channel(m.address) as channel:
        stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
        stub.ModelInfer(_request(0, 60_000_000), timeout=90)  # warm
        r = _stand_by(m)
        before = _commits()
        calls = _paced(stub, n, 0.01)  # 10 ms apart
        poll(lambda: r.zcard(contract.queue(("mlp", "1"))) == n, 15, "every request to be queued")
        commits = _commits() - before
        _lead(m, r)
        assert [c.result().id for c in calls] == [f"r{i}" for i in range(n)]
    return commits


def test_requests_arriving_within_the_window_share_commits(mesh_factory):
    # A 200 ms window: the first 7 go alone (fewer than 8 in flight), the other 23 about 20 to a commit.
    assert _commits_for_paced_requests(mesh_factory, 200.0) <= 13


def test_without_a_window_requests_apart_are_committed_one_by_one(mesh_factory):
    # The same traffic with no window: each request is alone when its commit goes.
    assert _commits_for_paced_requests(mesh_factory, 0.0) >= 20


def test_a_tight_budget_cuts_a_long_wait_short(mesh_factory):
    m = mesh_factory(models=["mlp"], gateway_overrides={"commit_linger_ms": 20_000.0})
    with grpc.insecure_channel(m.address) as channel:
        stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
        r = _stand_by(m)
        # From the 8th on, the commit waits a tenth of the 60 s budgets: 6 s.
        patient = _paced(stub, 12, 0.01)
        _lead(m, r)
        # A request with a 500 ms budget joins that commit: it must go within 50 ms, or the gateway
        # answers DEADLINE_EXCEEDED when the budget runs out.
        reply = stub.ModelInfer(_request(99, 500_000), timeout=30)
        assert reply.id == "r99"
        assert [c.result().id for c in patient] == [f"r{i}" for i in range(12)]
