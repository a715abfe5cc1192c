"""The demand and capacity signals (scheduler/demand.py) on a real mesh: what the gateways count,
what the leader publishes in Redis, as gauges and in `batchline status`."""
from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import prometheus_client
import pytest
import redis

from batchline import contract
from batchline.contract import keys
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import inference_pb2_grpc
from batchline.protocol import internal_pb2 as pb
from batchline.testing.processes import poll

WAIT_S = 15.0
MLP = ("mlp", "1")


def _request() -> ipb.ModelInferRequest:
    req = ipb.ModelInferRequest(model_name="mlp", id="t")
    req.inputs.add(name="features", datatype="FP32", shape=[1, 32])
    req.raw_input_contents.append(np.zeros((1, 32), np.float32).tobytes())
    return req


def _mlp_repository(model_repository, tmp_path, extra: str = "") -> str:
    repo = pathlib.Path(tmp_path) / "repo"
    shutil.copytree(pathlib.Path(model_repository) / "mlp", repo / "mlp")
    (repo / "mlp" / "config.toml").write_text((repo / "mlp" / "config.toml").read_text() + extra)
    return str(repo)


def test_refused_requests_count_as_arrivals(model_repository, tmp_path):
    from batchline.testing.in_process import InProcessMesh

    m = InProcessMesh(None, _mlp_repository(model_repository, tmp_path, "\nmax_queue_size = 2\n"),
                      models=["mlp"]).start()
    try:
        r = redis.Redis.from_url(m.redis_url)
        taken = time.monotonic()
        r.set(contract.LEADER, "someone-else", px=120_000)  # nothing is dispatched: the queue fills
        poll(lambda: m.scheduler.scheduler.lease.attempted_at > taken and not m.scheduler.scheduler.leader, WAIT_S,
             "the scheduler to stand by")
        stub = inference_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(m.address))
        waiting = [stub.ModelInfer.future(_request(), timeout=30) for _ in range(2)]
        poll(lambda: r.zcard(contract.queue(MLP)) == 2, WAIT_S, "two queued requests")
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as info:
                stub.ModelInfer(_request(), timeout=10)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        poll(lambda: int(r.get(keys.arrivals(MLP)) or 0) == 5, WAIT_S,
             "five arrivals counted, three refused among them")
        assert 0 < r.ttl(keys.arrivals(MLP)) <= keys.ARRIVALS_TTL
        r.delete(contract.LEADER)
        assert all(f.result(timeout=WAIT_S).id == "t" for f in waiting)
    finally:
        m.stop()


def test_the_leader_publishes_demand_capacity_and_start_time(model_repository, tmp_path):
    from batchline.testing.in_process import InProcessMesh

    m = InProcessMesh(None, _mlp_repository(model_repository, tmp_path), models=["mlp"], forecast_step_s=0.25).start()
    stop = threading.Event()

    def client() -> None:
        stub = inference_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(m.address))
        while not stop.is_set():
            stub.ModelInfer(_request(), timeout=10)
            time.sleep(0.01)

    sender = threading.Thread(target=client, daemon=True)
    sender.start()
    try:
        r = redis.Redis.from_url(m.redis_url)

        def serving() -> pb.MeshDemand | None:
            blob = r.get(keys.DEMAND)
            d = pb.MeshDemand.FromString(blob) if blob else None
            return d if d and d.models and d.models[0].arrival_rate > 0 and d.models[0].forecast_rate > 0 else None

        d = poll(serving, WAIT_S, "a demand with arrivals")
        model = d.models[0]
        assert (model.name, model.version) == MLP
        assert model.budget_s == pytest.approx(5.0)  # mlp's default_timeout_ms
        assert model.capacity > model.arrival_rate, "one executor serves one closed-loop client"
        assert d.executors_wanted == 1
        assert d.executor_start_s > 0, "the executor's registration carries its start-to-serving time"
        assert d.horizon_s == pytest.approx(d.executor_start_s)
        assert 0 < r.pttl(keys.DEMAND) <= keys.DEMAND_TTL_MS
        gauge = prometheus_client.REGISTRY.get_sample_value
        assert gauge("batchline_executors_wanted") >= 1
        assert gauge("batchline_executor_capacity", {"model": "mlp", "version": "1"}) > 0
        assert gauge("batchline_arrival_rate_forecast", {"model": "mlp", "version": "1"}) > 0
        assert gauge("batchline_executor_start_seconds") > 0
        out = subprocess.run([sys.executable, "-m", "batchline.cli", "status", "--redis-url", m.redis_url, "--json"],
                             capture_output=True, text=True, timeout=60)
        shown = json.loads(out.stdout)["demand"]
        assert shown["executors_wanted"] >= 1 and shown["models"][0]["model"] == "mlp"
        text = subprocess.run([sys.executable, "-m", "batchline.cli", "status", "--redis-url", m.redis_url],
                              capture_output=True, text=True, timeout=60).stdout
        assert "executors wanted:" in text and "per executor within 5000 ms" in text
    finally:
        stop.set()
        sender.join(10)
        m.stop()
