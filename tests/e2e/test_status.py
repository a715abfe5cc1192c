"""`batchline status`, the real command against a real mesh whose queue is held back."""
from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
import redis

from batchline import contract
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import inference_pb2_grpc
from batchline.testing.polling import poll


def _request(priority: int) -> ipb.ModelInferRequest:
    req = ipb.ModelInferRequest(model_name="mlp")
    req.inputs.add(name="features", datatype="FP32", shape=[1, 32])
    req.raw_input_contents.append(np.zeros((1, 32), np.float32).tobytes())
    req.parameters["priority"].uint64_param = priority
    req.parameters["timeout"].int64_param = 30_000_000
    return req


def _run_status(url: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchline.cli", "status", "--redis-url", url, *flags],
                          capture_output=True, text=True, timeout=60)


def _status(url: str, *flags: str) -> str:
    out = _run_status(url, *flags)
    assert out.returncode == 0 and not out.stderr, out.stdout + out.stderr
    return out.stdout


def _hold_the_lease(m, r: redis.Redis) -> None:
    """Make the mesh's scheduler stand by, so that nothing is dispatched: requests stay queued."""
    taken = time.monotonic()
    r.set(contract.LEADER, "held-by-the-test", px=120_000)
    poll(lambda: m.scheduler.scheduler.lease.attempted_at > taken and not m.scheduler.scheduler.leader, 15,
         "the scheduler to stand by")


@contextlib.contextmanager
def _three_queued(m):
    """Requests of priority 1, 3 and 3 queued for mlp while the scheduler stands by; yields Redis
    and the calls, which are cancelled at the end if still unanswered."""
    r = redis.Redis.from_url(m.redis_url)
    _hold_the_lease(m, r)
    channel = grpc.insecure_channel(m.address)
    stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
    calls = [stub.ModelInfer.future(_request(p), timeout=30) for p in (1, 3, 3)]
    try:
        poll(lambda: r.zcard(contract.queue(("mlp", "1"))) == 3, 15, "three requests queued")
        yield r, calls
    finally:
        for call in calls:
            call.cancel()
        channel.close()
        r.delete(contract.LEADER)


def test_status_shows_the_leader_executors_gateways_and_queues_by_priority(mesh_factory):
    m = mesh_factory(models=["mlp"])
    with _three_queued(m) as (r, calls):
        status = json.loads(_status(m.redis_url, "--json"))
        assert status["leader"] == "held-by-the-test"
        [executor] = status["executors"]
        assert executor["models"] == [{"name": "mlp", "version": "1", "provider": "CPUExecutionProvider",
                                       "unloading": False}]
        assert 0 <= executor["heartbeat_age_s"] < 15 and 0 <= executor["busy_share"] <= 1
        assert [g["address"] for g in status["gateways"]] == [m.address]
        assert status["queues"] == [{"model": "mlp", "version": "1", "depth": 3, "by_priority": {"1": 1, "3": 2},
                                     "served": True}]
        screen = _status(m.redis_url)
        assert "leader scheduler: held-by-the-test" in screen
        assert "mlp:1 on CPUExecutionProvider" in screen and m.address in screen
        assert "mlp:1: 3 (priority 1: 1, priority 3: 2)" in screen
        r.delete(contract.LEADER)  # the scheduler takes the lease back and answers them
        for call in calls:
            assert call.result(timeout=30) is not None


def test_status_shows_the_requests_queued_for_a_model_no_executor_serves(mesh_factory):
    m = mesh_factory(models=["mlp"])
    with _three_queued(m) as (r, _):
        executor = m.executors.pop()
        m.call(executor.stop(0))  # the only executor deregisters: no model is served
        poll(lambda: not any(r.exists(contract.executor(e.decode())) for e in r.smembers(contract.EXECUTORS)), 15,
             "the executor to deregister")
        status = json.loads(_status(m.redis_url, "--json"))
        assert status["executors"] == []
        assert status["queues"] == [{"model": "mlp", "version": "1", "depth": 3, "by_priority": {"1": 1, "3": 2},
                                     "served": False}]
        screen = _status(m.redis_url)
        assert "mlp:1: 3 (priority 1: 1, priority 3: 2), served by no executor" in screen, screen
        assert "no model served" not in screen


@pytest.mark.parametrize("flags", [(), ("--json",)], ids=["screen", "json"])
def test_status_of_an_unreachable_redis_says_so_in_one_line_on_stderr(flags):
    out = _run_status("redis://127.0.0.1:1/0", *flags)
    assert out.returncode == 1
    assert out.stdout == ""
    assert out.stderr.startswith("batchline status: cannot read the mesh's state from Redis at redis://127.0.0.1:1/0")
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
