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


def test_http_a_kept_alive_connection_the_server_closed_is_sent_again_not_failed():
    """A server that closes idle kept-alive connections (uvicorn after 5 s; this one after every
    answer): the next request on that connection fails before any byte, and goes again on a new
    one, as HTTP clients do, rather than counting as the server's failure."""
    from batchline.bench.http import HttpEndpoint
    from batchline.protocol import inference_pb2 as ipb

    async def answer_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()
        writer.close()  # kept alive, as far as the client knows: closed here

    request = ipb.ModelInferRequest(model_name="m")
    request.inputs.add(name="x", datatype="FP32", shape=[1])
    request.raw_input_contents.append(b"\0\0\0\0")

    async def run() -> list[str]:
        server = await asyncio.start_server(answer_once, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        ep = HttpEndpoint(f"127.0.0.1:{port}", "m")
        try:
            codes = []
            for _ in range(3):
                codes.append((await ep.infer(request.SerializeToString(), 5.0))[0])
                await asyncio.sleep(0.05)  # the server's close lands while the connection is idle
            return codes
        finally:
            for _, writer in ep._idle:
                writer.close()
            server.close()
            await server.wait_closed()

    assert asyncio.run(run()) == ["OK", "OK", "OK"]
