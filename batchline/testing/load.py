"""mlp load for the process mesh's fault tests and benchmarks/soak.py (one copy for both).

`LoadClient` keeps mlp requests in flight and records how each one ended, checking every answer
against a local ONNX Runtime run of the same model on the same input (a crossed or duplicated
answer fails the check); `summarize` and `format_summary` reduce the records.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable

import grpc
import numpy as np
import onnxruntime as ort

from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import inference_pb2_grpc
from batchline.testing.polling import MeshError, poll

MLP_FEATURES = 32


@dataclass
class Record:
    """How one request ended. Times are time.monotonic() seconds."""

    seq: int
    rows: int
    sent: float
    end: float
    code: str  # grpc.StatusCode name, "OK" on success
    correct: bool | None = None  # OK only: the output matched the local reference run
    message: str = ""
    version: str = ""  # OK only: the model version that answered

    @property
    def latency(self) -> float:
        return self.end - self.sent


class LoadClient:
    """mlp requests against a gateway, closed loop (`concurrency` in flight) or open loop
    (`rate` per second, as many in flight as it takes).

    Each request gets a fresh random input and a budget of `budget_s` (the `timeout`
    parameter); the gRPC deadline is `budget_s + client_slack_s`, so a call the server
    left hanging past its budget shows up as a latency over budget_s + 2 s instead of
    being cut off at the budget by the client itself.
    """

    def __init__(self, address: str, model_path: str | os.PathLike, *, concurrency: int = 8, rate: float | None = None,
                 budget_s: float = 10.0, client_slack_s: float = 5.0, max_rows: int = 4, seed: int = 0,
                 error_pause_s: float = 0.02):
        self.address = address
        self.concurrency = concurrency
        self.rate = rate
        self.budget_s = budget_s
        self.client_slack_s = client_slack_s
        self.max_rows = max_rows
        self.seed = seed
        # A fast-failing mesh (gateway or Redis down) would otherwise be hammered in a busy loop.
        self.error_pause_s = error_pause_s
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        self.session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
        self.channel = grpc.insecure_channel(address)
        self.stub = inference_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self.records: list[Record] = []
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.in_flight = 0

    # -- one request ---------------------------------------------------------

    def one(self, rng: np.random.Generator) -> Record:
        seq = next(self._seq)
        rows = int(rng.integers(1, self.max_rows + 1))
        x = rng.standard_normal((rows, MLP_FEATURES)).astype(np.float32)
        (expected,) = self.session.run(["probability"], {"features": x})
        request = ipb.ModelInferRequest(model_name="mlp", id=str(seq))
        request.parameters["timeout"].int64_param = int(self.budget_s * 1e6)
        request.inputs.add(name="features", datatype="FP32", shape=[rows, MLP_FEATURES])
        request.raw_input_contents.append(x.tobytes())
        with self._lock:
            self.in_flight += 1
        sent = time.monotonic()
        try:
            response = self.stub.ModelInfer(request, timeout=self.budget_s + self.client_slack_s)
        except grpc.RpcError as exc:
            record = Record(seq, rows, sent, time.monotonic(), exc.code().name, None, exc.details() or "")
        else:
            end = time.monotonic()
            record = Record(seq, rows, sent, end, "OK", self._correct(response, str(seq), expected),
                            version=response.model_version)
        with self._lock:
            self.in_flight -= 1
            self.records.append(record)
        return record

    @staticmethod
    def _correct(response: ipb.ModelInferResponse, request_id: str, expected: np.ndarray) -> bool:
        if response.id != request_id or len(response.outputs) != 1 or response.outputs[0].name != "probability":
            return False
        out = response.outputs[0]
        got = np.frombuffer(response.raw_output_contents[0], np.float32)
        if list(out.shape) != list(expected.shape) or got.size != expected.size:
            return False
        return bool(np.allclose(got.reshape(expected.shape), expected, rtol=1e-4, atol=1e-5))

    # -- driving --------------------------------------------------------------

    def _closed_worker(self, k: int) -> None:
        rng = np.random.default_rng((self.seed, k))
        while not self._stop.is_set():
            if self.one(rng).code != "OK":
                self._stop.wait(self.error_pause_s)

    def _open_driver(self) -> None:
        rng = np.random.default_rng((self.seed, 1 << 20))
        local = threading.local()

        def task():
            if not hasattr(local, "rng"):
                local.rng = np.random.default_rng((self.seed, threading.get_ident()))
            self.one(local.rng)

        interval = 1.0 / self.rate
        next_at = time.monotonic()
        while not self._stop.is_set():
            # Poisson arrivals: the mean rate is `rate`, bursts included.
            next_at += rng.exponential(interval)
            delay = next_at - time.monotonic()
            if delay > 0 and self._stop.wait(delay):
                break
            self._pool.submit(task)

    def start(self) -> "LoadClient":
        if self.rate:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(256, self.concurrency),
                                                               thread_name_prefix="load")
            self._threads = [threading.Thread(target=self._open_driver, name="load-driver", daemon=True)]
        else:
            self._threads = [threading.Thread(target=self._closed_worker, args=(k,), name=f"load-{k}", daemon=True)
                             for k in range(self.concurrency)]
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout: float | None = None) -> list[Record]:
        """Stop sending and wait for every request in flight to end (at most its deadline)."""
        self._stop.set()
        timeout = timeout if timeout is not None else self.budget_s + self.client_slack_s + 5
        for t in self._threads:
            t.join(timeout)
            if t.is_alive():
                raise MeshError(f"load thread {t.name} still running {timeout} s after stop")
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.channel.close()
        return self.snapshot()

    def snapshot(self) -> list[Record]:
        with self._lock:
            return list(self.records)

    def count(self, code: str | None = None, since: float = 0.0) -> int:
        """Requests ended so far (with `code`, and sent at or after `since`)."""
        with self._lock:
            return sum(1 for r in self.records if r.sent >= since and (code is None or r.code == code))

    def wait_ok(self, n: int, since: float, timeout: float, check: Callable[[], None] | None = None) -> None:
        """Until n requests sent at or after `since` have succeeded."""
        poll(lambda: self.count("OK", since) >= n, timeout, f"{n} successful requests sent after t={since:.1f}",
             check=check)

    def __enter__(self) -> "LoadClient":
        return self.start()

    def __exit__(self, *exc) -> None:
        if not self._stop.is_set():
            self.stop()


def summarize(records: Iterable[Record]) -> dict:
    records = list(records)
    by_code = Counter(r.code for r in records)
    lat = sorted(r.latency for r in records)
    ok_lat = sorted(r.latency for r in records if r.code == "OK")

    def pct(values: list[float], q: float) -> float | None:
        return round(values[min(len(values) - 1, int(q * len(values)))] * 1e3, 1) if values else None

    return {
        "sent": len(records),
        "ok": by_code.get("OK", 0),
        "wrong_output": sum(1 for r in records if r.code == "OK" and not r.correct),
        "by_status": dict(sorted(by_code.items())),
        "ok_p50_ms": pct(ok_lat, 0.5),
        "ok_p99_ms": pct(ok_lat, 0.99),
        "max_ms": round(lat[-1] * 1e3, 1) if lat else None,
    }


def format_summary(label: str, records: Iterable[Record]) -> str:
    s = summarize(records)
    return (f"{label:<28} sent={s['sent']:<5} ok={s['ok']:<5} wrong={s['wrong_output']} "
            f"by_status={s['by_status']} ok_p50={s['ok_p50_ms']}ms ok_p99={s['ok_p99_ms']}ms max={s['max_ms']}ms")
