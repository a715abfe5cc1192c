"""The load generator's own accounting, against an endpoint played in code (its latency and the
client's stalls are what the test sets): rates over the window the requests were sent in, and
open-loop latencies from when each request was due."""
from __future__ import annotations

import asyncio
import time

from batchline.bench.inputs import RequestPool
from batchline.bench.loadgen import closed_step, open_step


class _Endpoint:
    """Answers every call after `latency_s`; counts what it was sent."""

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s
        self.calls = 0

    async def infer(self, payload: bytes, timeout_s: float | None) -> tuple[str, float]:
        t = time.perf_counter()
        self.calls += 1
        await asyncio.sleep(self.latency_s)
        return "OK", time.perf_counter() - t

    async def infer_hinted(self, payload: bytes, timeout_s: float | None) -> tuple[str, float, None]:
        code, latency = await self.infer(payload, timeout_s)
        return code, latency, None

    async def counts(self) -> None:
        return None


POOL = RequestPool([b"x"], {}, 1)


def test_a_closed_loop_rate_is_over_the_window_its_requests_were_sent_in():
    """With answers that take a while, the last ones come well after the window: a rate over the
    window plus that drain would read low, the more so the longer the server's tail."""
    step = asyncio.run(closed_step(_Endpoint(0.2), POOL, concurrency=8, duration=1.0, warmup=0.0))
    assert step.duration_s == 1.0
    assert step.throughput_rps == step.status_counts["OK"] / 1.0


def test_open_loop_latency_counts_from_when_a_request_was_due():
    """A client whose event loop stalls for 0.3 s sends what fell due meanwhile late: those
    requests waited, in the client, as surely as in a server's queue."""
    async def run():
        loop = asyncio.get_running_loop()
        loop.call_later(1.0, time.sleep, 0.3)  # the client's loop blocked: nothing goes out
        return await open_step(_Endpoint(0.005), POOL, rate=200, duration=2.0, warmup=0.0, budget_ms=100)

    step = asyncio.run(run())
    late = step.status_counts["OK"] - step.good  # answered past the 100 ms budget, counted from when due
    assert late >= 20, (late, step.latency_ms)
    assert step.latency_ms["p99"] >= 100 and step.send_lag_p99_ms >= 100
