"""Redis going away: clients get UNAVAILABLE at once, and the mesh serves again once it is back."""
from __future__ import annotations

import time

import numpy as np
import pytest
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException


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
    assert time.monotonic() - started < 2.0, "the gateway hung instead of answering UNAVAILABLE"
    assert client.is_server_live() and not client.is_server_ready()

    m.own_redis.start()  # same port, empty: executors re-register on their next heartbeat
    deadline = time.monotonic() + 20
    while True:
        try:
            result = client.infer("mlp", [_features()], client_timeout=2)
            break
        except InferenceServerException:
            assert time.monotonic() < deadline, "the mesh did not serve again after Redis came back"
            time.sleep(0.1)
    assert result.as_numpy("probability").shape == (1, 1)
    assert client.is_server_ready()
    client.close()
