"""`batchline status`, the real command against a real mesh whose queue is held back."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import grpc
import numpy as np
import redis

from batchline import contract
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import inference_pb2_grpc
from batchline.testing.processes import poll


def _request(priority: int) -> ipb.ModelInferRequest:
    req = ipb.ModelInferRequest(model_name="mlp")
    req.inputs.add(name="features", datatype="FP32", shape=[1, 32])
    req.raw_input_contents.append(np.zeros((1, 32), np.float32).tobytes())
    req.parameters["priority"].uint64_param = priority
    req.parameters["timeout"].int64_param = 30_000_000
    return req


def _status(url: str, *flags: str) -> str:
    out = subprocess.run([sys.executable, "-m", "batchline.cli", "status", "--redis-url", url, *flags],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_status_shows_the_leader_executors_gateways_and_queues_by_priority(mesh_factory):
    m = mesh_factory(models=["mlp"])
    r = redis.Redis.from_url(m.redis_url)
    taken = time.monotonic()
    r.set(contract.LEADER, "held-by-the-test", px=120_000)  # nothing is dispatched: the requests stay queued
    poll(lambda: m.scheduler.scheduler.lease.attempted_at > taken and not m.scheduler.scheduler.leader, 15,
         "the scheduler to stand by")
    channel = grpc.insecure_channel(m.address)
    stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
    calls = [stub.ModelInfer.future(_request(p), timeout=30) for p in (1, 3, 3)]
    try:
        poll(lambda: r.zcard(contract.queue("mlp", "1")) == 3, 15, "three requests queued")
        status = json.loads(_status(m.redis_url, "--json"))
        assert status["leader"] == "held-by-the-test"
        [executor] = status["executors"]
        assert executor["models"] == [{"name": "mlp", "version": "1", "provider": "CPUExecutionProvider", "unloading": False}]
        assert 0 <= executor["heartbeat_age_s"] < 15 and 0 <= executor["busy_share"] <= 1
        assert [g["address"] for g in status["gateways"]] == [m.address]
        assert status["queues"] == [{"model": "mlp", "version": "1", "depth": 3, "by_priority": {"1": 1, "3": 2}}]
        screen = _status(m.redis_url)
        assert "leader scheduler: held-by-the-test" in screen
        assert "mlp:1 on CPUExecutionProvider" in screen and m.address in screen
        assert "mlp:1: 3 (priority 1: 1, priority 3: 2)" in screen
    finally:
        r.delete(contract.LEADER)  # the scheduler takes the lease back and answers them
        for call in calls:
            assert call.result(timeout=30) is not None
        channel.close()


def test_status_of_an_unreachable_redis_says_so_in_one_line():
    out = subprocess.run([sys.executable, "-m", "batchline.cli", "status", "--redis-url", "redis://127.0.0.1:1/0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stdout.startswith("batchline status: cannot read the mesh's state from Redis at redis://127.0.0.1:1/0")
    assert "Traceback" not in out.stdout + out.stderr
