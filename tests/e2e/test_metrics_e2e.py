"""Prometheus metrics end to end: requests through the in-process mesh show up at /metrics.

All three services of tests/mesh.py run in this process and share prometheus_client's
default registry, so the test serves that registry itself on a free port and scrapes it.
Every check is a delta between two scrapes: other tests' traffic does not matter.
"""
from __future__ import annotations

import asyncio
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc.aio as tca
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from batchline import metrics

N = 12
ROWS = [1 + i % 3 for i in range(N)]  # 24 rows in all


@pytest.fixture(scope="module")
def metrics_port():
    port = metrics.start_metrics_server("127.0.0.1", 0)
    yield port
    metrics.stop_metrics_server(port)


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: dict, name: str, **labels: str) -> float:
    """Sum of a metric's samples whose labels include `labels` (e.g. over every version)."""
    want = set(labels.items())
    return sum(v for (n, lbls), v in samples.items() if n == name and want <= lbls)


def present(samples: dict, name: str, **labels: str) -> bool:
    want = set(labels.items())
    return any(n == name and want <= lbls for (n, lbls) in samples)


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    return total(after, name, **labels) - total(before, name, **labels)


async def _infer(client: tca.InferenceServerClient, rows: int):
    x = np.random.default_rng(rows).normal(size=(rows, 32)).astype(np.float32)
    inp = tca.InferInput("features", [rows, 32], "FP32")
    inp.set_data_from_numpy(x)
    return await client.infer("mlp", [inp])


async def test_requests_show_up_in_the_metrics(mesh, metrics_port):
    before = await asyncio.to_thread(scrape, metrics_port)
    client = tca.InferenceServerClient(mesh.address)
    try:
        # Concurrent, so some of them share batches.
        results = await asyncio.gather(*(_infer(client, rows) for rows in ROWS))
        assert [r.as_numpy("probability").shape for r in results] == [(rows, 1) for rows in ROWS]
        bad = tca.InferInput("features", [1, 31], "FP32")
        bad.set_data_from_numpy(np.zeros((1, 31), dtype=np.float32))
        with pytest.raises(InferenceServerException) as err:
            await client.infer("mlp", [bad])
        assert "INVALID_ARGUMENT" in str(err.value.status())
        with pytest.raises(InferenceServerException) as err:
            await client.infer("no-such-model", [bad])
        assert "NOT_FOUND" in str(err.value.status())
        with pytest.raises(InferenceServerException) as err:
            await client.infer("mlp", [bad], model_version="abc")  # a version that is no number
        assert "INVALID_ARGUMENT" in str(err.value.status())
    finally:
        await client.close()

    mlp = {"model": "mlp"}

    def settled(after: dict) -> bool:
        # The executor counts a batch around writing its replies, so the scrape may run ahead of it.
        executed = delta(before, after, "batchline_execution_count_total", **mlp)
        return (
            delta(before, after, "batchline_request_success_total", **mlp) == N
            and delta(before, after, "batchline_inference_count_total", **mlp) == sum(ROWS)
            and delta(before, after, "batchline_batch_size_count", **mlp) == executed
            and delta(before, after, "batchline_batches_dispatched_total", **mlp) == executed
        )

    deadline = time.monotonic() + 30
    after = await asyncio.to_thread(scrape, metrics_port)
    while not settled(after) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        after = await asyncio.to_thread(scrape, metrics_port)

    def d(name: str, **labels: str) -> float:
        return delta(before, after, name, **labels)

    # Executor: the provider the model runs on (here the CPU, the only one this host offers).
    assert total(after, "batchline_model_provider", provider="CPUExecutionProvider", **mlp) >= 1
    assert not present(after, "batchline_model_provider", provider="CUDAExecutionProvider", **mlp)
    # Gateway: every request counted once, by outcome.
    assert d("batchline_request_success_total", **mlp) == N
    assert d("batchline_request_duration_seconds_count", **mlp) == N
    assert d("batchline_request_failure_total", reason="invalid_argument", **mlp) == 2
    assert d("batchline_request_failure_total", **mlp) == 2
    # The client named no version: its failure counts under the version that served the rest, so
    # a goodput panel dividing by (model, version) lines up; an unknown name adds no series of its own.
    served = {dict(lbls)["version"] for (n, lbls), v in after.items()
              if n == "batchline_request_success_total" and dict(lbls).get("model") == "mlp" and v}
    assert served and "" not in served
    assert sum(d("batchline_request_failure_total", model="mlp", version=v) for v in served) == 1
    assert d("batchline_request_failure_total", model="", version="", reason="not_found") == 1
    assert d("batchline_request_failure_total", model="mlp", version="", reason="invalid_argument") == 1
    assert not present(after, "batchline_request_failure_total", model="no-such-model")

    # Executor: rows and batches agree with each other and with the scheduler's view.
    inferences = d("batchline_inference_count_total", **mlp)
    executions = d("batchline_execution_count_total", **mlp)
    assert inferences == sum(ROWS)
    assert 1 <= executions <= N and executions <= inferences
    assert d("batchline_batch_size_count", **mlp) == executions
    assert d("batchline_batch_size_sum", **mlp) == inferences  # rows per batch add up to the rows executed
    assert d("batchline_batches_dispatched_total", **mlp) == executions
    assert d("batchline_queue_duration_seconds_count", **mlp) >= 1
    assert d("batchline_compute_infer_duration_seconds_count", **mlp) >= 1
    assert d("batchline_executor_busy_seconds_total") > 0

    # The service stages: one observation per request answered, each where its stage ends.
    stages = ("enqueue", "queue", "dispatch", "execute", "reply")
    for stage in stages:
        assert d(f"batchline_stage_{stage}_seconds_count", **mlp) == N, stage
        assert d(f"batchline_stage_{stage}_seconds_sum", **mlp) > 0, stage
    # From the enqueue stamp on, the stages follow one another inside the gateway's own time for
    # the request (one host, one clock here): in seconds, not a unit off, and nothing counted twice.
    # A microsecond per request and stage allows for the wall clock's truncation to µs.
    after_enqueue = sum(d(f"batchline_stage_{stage}_seconds_sum", **mlp) for stage in stages[1:])
    assert after_enqueue <= d("batchline_request_duration_seconds_sum", **mlp) + N * len(stages) * 1e-6
    assert d("batchline_stage_enqueue_seconds_sum", **mlp) <= d("batchline_request_duration_seconds_sum", **mlp)

    # Scheduler: the queue's depth is reported (drained by now, so never negative).
    assert present(after, "batchline_pending_requests", **mlp)
    assert total(after, "batchline_pending_requests", **mlp) >= 0

    for service in ("gateway", "scheduler", "executor"):
        assert d("batchline_redis_roundtrip_seconds_count", service=service) > 0, service
