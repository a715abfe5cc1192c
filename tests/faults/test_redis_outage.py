"""Redis going away: clients get UNAVAILABLE at once, and the mesh serves again once it is back."""
from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

from batchline.grpc_server import LIVENESS
from batchline.testing.polling import poll


def _wait_health(address: str, want: int, timeout: float = 10, service: str = "") -> None:
    """Poll the gRPC health service until it reports `want`."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        poll(lambda: stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status == want,
             timeout, f"{address} health to report {want}")


def _features() -> tc.InferInput:
    inp = tc.InferInput("features", [1, 32], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 32), np.float32))
    return inp


def test_unavailable_while_redis_is_down_then_served_again(mesh_factory):
    m = mesh_factory(models=["mlp"])
    client = tc.InferenceServerClient(m.address)
    client.infer("mlp", [_features()])

    m.own_redis.stop(kill=True)
    started = time.monotonic()
    with pytest.raises(InferenceServerException) as info:
        client.infer("mlp", [_features()], client_timeout=10)
    assert info.value.status() == "StatusCode.UNAVAILABLE"
    assert "Redis" in info.value.message()
    # The client is told of the outage, not where the mesh's Redis lives.
    assert str(m.own_redis.port) not in info.value.message(), info.value.message()
    assert time.monotonic() - started < 2.0, "the gateway hung instead of answering UNAVAILABLE"
    assert client.is_server_live() and not client.is_server_ready()
    # Every service reports NOT_SERVING while Redis is gone ...
    addresses = [m.address, f"127.0.0.1:{m.scheduler.port}", *(f"127.0.0.1:{e.port}" for e in m.executors)]
    for address in addresses:
        _wait_health(address, health_pb2.HealthCheckResponse.NOT_SERVING)
        # ... but stays live, so that a liveness probe does not restart it (deploy/k8s probe LIVENESS)
        _wait_health(address, health_pb2.HealthCheckResponse.SERVING, timeout=0, service=LIVENESS)

    m.own_redis.start()  # same port, empty: executors re-register on their next heartbeat

    def served():
        try:
            return client.infer("mlp", [_features()], client_timeout=2)
        except InferenceServerException:
            return None

    result = poll(served, 20, "the mesh to serve again after Redis came back", interval=0.1)
    assert result.as_numpy("probability").shape == (1, 1)
    assert client.is_server_ready()
    for address in addresses:  # ... and SERVING again once it is back
        _wait_health(address, health_pb2.HealthCheckResponse.SERVING)
    client.close()



def _keep_requests_queued(m) -> None:
    """Another "scheduler" holds the lease: requests stay queued, waiting for their answers."""
    import redis

    from batchline import contract

    taken = time.monotonic()
    redis.Redis.from_url(m.redis_url).set(contract.LEADER, "someone-else", px=60_000)
    scheduler = m.scheduler.scheduler
    # It notices at its next renewal.
    poll(lambda: not scheduler.leader and scheduler.lease.attempted_at > taken, 10,
         "the scheduler to stop dispatching without the lease", interval=0.02)


def _wait_queued(m) -> None:
    """Until the gateway knows its request is queued: Redis acknowledged the write. (The entry can
    be in the queue before its acknowledgement reaches the gateway; losing Redis then fails the
    write, "cannot queue the request", not the queued request.)"""
    poll(lambda: m.gateway.gateway.replies.acknowledged, 10, "the request to be queued")

def test_a_request_waiting_when_redis_dies_is_answered_unavailable_at_once(mesh_factory):
    import concurrent.futures

    m = mesh_factory(models=["mlp"])
    client = tc.InferenceServerClient(m.address)
    client.infer("mlp", [_features()])
    _keep_requests_queued(m)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(client.infer, "mlp", [_features()], client_timeout=30)
        _wait_queued(m)
        m.own_redis.stop(kill=True)
        killed = time.monotonic()
        with pytest.raises(InferenceServerException) as info:
            waiting.result(timeout=10)
    assert info.value.status() == "StatusCode.UNAVAILABLE"
    assert "lost contact with Redis" in info.value.message()
    assert time.monotonic() - killed < 3.0, "a waiting request hung after Redis died"
    client.close()


def test_a_request_lost_in_a_quick_redis_restart_is_answered_unavailable(mesh_factory):
    import concurrent.futures

    m = mesh_factory(models=["mlp"])
    client = tc.InferenceServerClient(m.address)
    _keep_requests_queued(m)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(client.infer, "mlp", [_features()], client_timeout=30)
        _wait_queued(m)
        # Gone and back between two health checks: only Redis's new run_id tells.
        m.own_redis.restart()
        with pytest.raises(InferenceServerException) as info:
            waiting.result(timeout=15)
    assert info.value.status() == "StatusCode.UNAVAILABLE"
    assert "Redis changed primary" in info.value.message() or "lost contact with Redis" in info.value.message()
    client.close()


def test_an_executor_started_before_redis_waits_for_it(model_repository, tmp_path):
    """A pod scheduled before Redis (or a Sentinel group still electing its primary): the executor
    loads its models, finds Redis unreachable, and waits for it rather than exiting (and loading
    its models again at each restart)."""
    from batchline.testing.processes import ProcessMesh

    with ProcessMesh(model_repository, tmp_path / "logs", models=["mlp"]) as mesh:
        name = mesh.add_executor()
        executor = mesh.services[name]
        poll(lambda: "Redis is unreachable" in executor.tail(50), 60, "the executor to find Redis unreachable",
             check=mesh.check_alive)
        mesh.start_redis()
        mesh.probe.wait_for_executors(1, timeout=30)
        mesh.check_alive()
