"""Closed- and open-loop load against a KServe v2 gRPC endpoint.

Control calls (liveness, metadata, statistics) go through
``tritonclient.grpc.aio``; ModelInfer goes through a raw grpc.aio method on
its own channel that takes the pool's pre-serialized bytes and returns the
response bytes unparsed. tritonclient's ``infer()`` would rebuild, serialize
and parse every request, CPU that on a shared 2-core machine the server under
test needs; only the status code and the latency matter here.

With ``streaming``, requests travel on ModelStreamInfer streams instead
(batchline/bench/streams.py).
"""
from __future__ import annotations

import asyncio
import functools
import math
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc
import numpy as np
import tritonclient.grpc.aio as tca
from tritonclient.utils import InferenceServerException

from batchline.bench.inputs import RequestPool, TensorInfo
from batchline.bench.streams import OPEN_LOOP_STREAMS, InferStream, StreamMux
from batchline.errors import RETRY_AFTER_KEY

MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
MODEL_STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"
_MAX_MESSAGE = 2**31 - 1
# Open loop: requests due while this many are outstanding are counted as not
# sent rather than queued in the client, which would hide the server's behaviour.
DEFAULT_MAX_OUTSTANDING = 10_000
# Outcomes of requests that never got an answer from gRPC itself.
NOT_SENT = "NOT_SENT"
UNFINISHED = "UNFINISHED"


class BenchError(Exception):
    """The endpoint cannot be benchmarked (unreachable, unknown model, bad options)."""


@dataclass
class StepResult:
    """One step of a sweep: a concurrency (closed loop) or an offered rate (open loop)."""

    mode: str
    concurrency: int | None = None
    rate: float | None = None            # nominal Poisson rate, req/s (open loop)
    burst: tuple[int, float] | None = None
    budget_ms: float | None = None
    duration_s: float = 0.0              # measured window
    sent: int = 0                        # requests sent in the window
    offered_rps: float | None = None     # scheduled arrivals (incl. bursts) / window (open loop)
    throughput_rps: float = 0.0          # OK answers / s
    goodput_rps: float = 0.0             # OK answers within the budget / s
    good: int = 0                        # OK answers within the budget
    latency_ms: dict[str, float] | None = None  # p50/p95/p99/max/mean of OK answers
    # p50/p99/max of every answer except refusals at admission (RESOURCE_EXHAUSTED): what an
    # admitted request experienced, including the ones that ran out of budget.
    admitted_latency_ms: dict[str, float] | None = None
    status_counts: dict[str, int] = field(default_factory=dict)
    mean_batch_size: float | None = None  # ModelStatistics inference_count / execution_count deltas
    inference_count: int | None = None
    execution_count: int | None = None
    send_lag_p99_ms: float | None = None  # open loop: how late sends left vs schedule (client health)
    rows_per_request: int = 1
    streaming: bool = False              # over ModelStreamInfer streams instead of unary calls

    @property
    def label(self) -> str:
        if self.mode == "closed":
            return f"concurrency {self.concurrency}" + (" (stream)" if self.streaming else "")
        burst = f" + burst {self.burst[0]}/{self.burst[1]:g}s" if self.burst else ""
        return f"rate {self.rate:g}/s{burst}" + (" (stream)" if self.streaming else "")


class _Recorder:
    def __init__(self) -> None:
        self.ok: list[float] = []
        self.admitted: list[float] = []
        self.codes: Counter[str] = Counter()
        self.lags: list[float] = []

    def add(self, code: str, latency: float) -> None:
        self.codes[code] += 1
        if code == "OK":
            self.ok.append(latency)
        if code != "RESOURCE_EXHAUSTED":
            self.admitted.append(latency)

    @property
    def done(self) -> int:
        return sum(self.codes.values())


class Progress:
    """A per-step progress callback: (step label, seconds elapsed, total seconds, answers so far)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._bar = None

    def start(self, label: str, total_s: float) -> None:
        if not self.enabled:
            return
        from tqdm import tqdm

        self.close()
        self._bar = tqdm(total=round(total_s, 1), desc=label, unit="s", leave=False,
                         bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total:.1f} s{postfix}")

    def update(self, elapsed: float, rec: _Recorder) -> None:
        if self._bar is not None:
            self._bar.n = round(min(elapsed, self._bar.total), 1)
            self._bar.set_postfix_str(f"ok={len(rec.ok)} other={rec.done - len(rec.ok)}", refresh=False)
            self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class Endpoint:
    """A connection to one model of a KServe v2 gRPC server."""

    def __init__(self, url: str, model: str, version: str = "", connections: int = 1,
                 headers: dict[str, str] | None = None):
        self.url, self.model, self.version = url, model, version
        self.connections = max(1, connections)
        self.headers = dict(headers or {})  # sent with every call (e.g. authorization)
        self.metadata = tuple((k.lower(), v) for k, v in self.headers.items()) or None
        self.client: tca.InferenceServerClient | None = None
        self.channels: list[grpc.aio.Channel] = []
        self._next = 0

    async def __aenter__(self) -> "Endpoint":
        self.client = tca.InferenceServerClient(self.url)
        options = [("grpc.max_send_message_length", _MAX_MESSAGE), ("grpc.max_receive_message_length", _MAX_MESSAGE)]
        if self.connections > 1:
            # A channel of its own TCP connection each: channels to one target share one otherwise.
            options.append(("grpc.use_local_subchannel_pool", 1))
        self.channels = [grpc.aio.insecure_channel(self.url, options=options) for _ in range(self.connections)]
        # No serializers: requests go out as the pool's bytes, replies stay bytes.
        self._infers = [c.unary_unary(MODEL_INFER) for c in self.channels]
        streams = [c.stream_stream(MODEL_STREAM_INFER) for c in self.channels]
        self._streams = [functools.partial(m, metadata=self.metadata) for m in streams] if self.metadata else streams
        self._infer, self._stream = self._infers[0], self._streams[0]
        return self

    async def __aexit__(self, *exc) -> None:
        for channel in self.channels:
            await channel.close()
        await self.client.close()

    def _turn(self) -> int:
        """The connection the next call or stream takes: round robin."""
        self._next = (self._next + 1) % self.connections
        return self._next

    async def inputs(self, timeout_s: float = 10.0) -> list[TensorInfo]:
        """Check the endpoint is live and serves the model; return the model's inputs."""
        try:
            await self.client.is_server_live(headers=self.headers, client_timeout=timeout_s)
        except InferenceServerException as exc:
            raise BenchError(f"cannot reach a KServe v2 gRPC server at {self.url}: {exc.message()}") from None
        try:
            meta = await self.client.get_model_metadata(self.model, self.version, headers=self.headers,
                                                        client_timeout=timeout_s)
        except InferenceServerException as exc:
            what = f"model {self.model!r}" + (f" version {self.version!r}" if self.version else "")
            raise BenchError(f"{what} is not served by {self.url}: {exc.message()}") from None
        inputs = [TensorInfo(t.name, t.datatype, tuple(t.shape)) for t in meta.inputs]
        text = await self.text_input(timeout_s)
        # A model that takes text besides token ids (batchline's [tokenizer]): send one or the other.
        return [t for t in inputs if t.name != text] if text else inputs

    async def text_input(self, timeout_s: float = 10.0) -> str:
        """The model's text input, which it tokenizes into its other inputs ("": none)."""
        try:
            config = await self.client.get_model_config(self.model, self.version, headers=self.headers,
                                                        client_timeout=timeout_s)
        except InferenceServerException:
            return ""  # a server without ModelConfig
        param = config.config.parameters.get("text_input")
        return param.string_value if param is not None else ""

    async def counts(self) -> tuple[int, int] | None:
        """(inference_count, execution_count) summed over the model's versions; None if not served."""
        try:
            stats = await self.client.get_inference_statistics(self.model, self.version, headers=self.headers,
                                                               client_timeout=10)
        except InferenceServerException:
            return None
        entries = [s for s in stats.model_stats if s.name == self.model]
        return sum(s.inference_count for s in entries), sum(s.execution_count for s in entries)

    async def infer(self, payload: bytes, timeout_s: float | None) -> tuple[str, float]:
        """Send one pre-serialized request; (status code name, latency in s)."""
        code, latency, _ = await self.infer_hinted(payload, timeout_s)
        return code, latency

    async def infer_hinted(self, payload: bytes, timeout_s: float | None) -> tuple[str, float, float | None]:
        """`infer`, plus the server's retry-after hint in seconds (batchline's `retry-after-ms`
        trailing metadata on a refusal), if any."""
        infer = self._infers[self._turn()] if self.connections > 1 else self._infer
        t = time.perf_counter()
        try:
            await infer(payload, timeout=timeout_s, metadata=self.metadata)
            return "OK", time.perf_counter() - t, None
        except grpc.aio.AioRpcError as exc:
            latency = time.perf_counter() - t
            hint = dict(exc.trailing_metadata() or ()).get(RETRY_AFTER_KEY)
            try:
                retry_after = int(hint) / 1e3 if hint is not None else None
            except ValueError:
                retry_after = None
            return exc.code().name, latency, retry_after


    def stream(self) -> "InferStream":
        return InferStream(self._streams[self._turn()])

    def stream_mux(self, streams: int = OPEN_LOOP_STREAMS) -> "StreamMux":
        return StreamMux(self._stream, streams)


def _summarize(step: StepResult, rec: _Recorder, window: float, before, after, budget_ms: float | None) -> StepResult:
    step.duration_s = window
    step.status_counts = dict(sorted(rec.codes.items()))
    step.sent = sum(n for c, n in rec.codes.items() if c != NOT_SENT)
    ok = np.asarray(rec.ok) * 1e3
    step.throughput_rps = len(ok) / window if window > 0 else 0.0
    step.good = len(ok) if budget_ms is None else int(np.count_nonzero(ok <= budget_ms))
    step.goodput_rps = step.good / window if window > 0 else 0.0
    if len(ok):
        p50, p95, p99 = np.percentile(ok, [50, 95, 99])
        step.latency_ms = {"p50": float(p50), "p95": float(p95), "p99": float(p99),
                           "max": float(ok.max()), "mean": float(ok.mean())}
    if rec.admitted:
        admitted = np.asarray(rec.admitted) * 1e3
        p50, p99 = np.percentile(admitted, [50, 99])
        step.admitted_latency_ms = {"p50": float(p50), "p99": float(p99), "max": float(admitted.max())}
    if rec.lags:
        step.send_lag_p99_ms = float(np.percentile(np.asarray(rec.lags), 99) * 1e3)
    if before is not None and after is not None:
        step.inference_count = after[0] - before[0]
        step.execution_count = after[1] - before[1]
        if step.execution_count > 0:
            step.mean_batch_size = step.inference_count / step.execution_count
    return step


def _drain_timeout(given: float | None, budget_ms: float | None) -> float:
    """How long a step waits for its last answers before counting them UNFINISHED."""
    return given if given is not None else max(30.0, 2 * (budget_ms or 0) / 1e3)


async def _ticker(progress: Progress, start: float, rec: _Recorder) -> None:
    while True:
        progress.update(time.perf_counter() - start, rec)
        await asyncio.sleep(0.25)


async def _counts_at(ep: Endpoint, when: float):
    await asyncio.sleep(max(0.0, when - time.perf_counter()))
    return await ep.counts()


async def closed_step(
    ep: Endpoint,
    pool: RequestPool,
    concurrency: int,
    duration: float,
    warmup: float = 1.0,
    budget_ms: float | None = None,
    progress: Progress | None = None,
    drain_timeout_s: float | None = None,
    streaming: bool = False,
    retry_after: bool = True,
) -> StepResult:
    """`concurrency` workers each keep one request in flight (on a stream of their own with
    `streaming`); answers to requests sent in the `duration` window after `warmup` are measured
    (waited for after it, and counted over the window's length). With `retry_after`, a worker whose request
    was refused with a retry-after hint (trailing metadata of a unary call, a parameter of a stream's
    error answer) waits that long before it sends again, as a well-behaved client would; else it
    resends at once, as perf_analyzer does."""
    if concurrency < 1:
        raise BenchError("concurrency must be >= 1")
    timeout = budget_ms / 1e3 if budget_ms is not None else None
    rec = _Recorder()
    start = time.perf_counter()
    t0, t_end = start + warmup, start + warmup + duration
    n = len(pool.requests)
    progress = progress or Progress(False)
    progress.start(f"closed c={concurrency}", warmup + duration)
    ticker = asyncio.create_task(_ticker(progress, start, rec))
    before = asyncio.create_task(_counts_at(ep, t0))

    async def worker(k: int) -> None:
        i = k * max(1, n // concurrency)
        stream = ep.stream() if streaming else None
        try:
            while (sent_at := time.perf_counter()) < t_end:
                wait = None
                try:
                    if stream:
                        code, latency, wait = await stream.infer(pool.requests[i % n], timeout)
                    else:
                        code, latency, wait = await ep.infer_hinted(pool.requests[i % n], timeout)
                except asyncio.CancelledError:
                    if sent_at >= t0:
                        rec.codes[UNFINISHED] += 1
                    raise
                if sent_at >= t0:
                    rec.add(code, latency)
                i += 1
                if wait and retry_after:
                    if time.perf_counter() + wait >= t_end:
                        break  # nothing more to send in this window
                    await asyncio.sleep(wait)
        finally:
            if stream:
                stream.close()

    workers = [asyncio.create_task(worker(k)) for k in range(concurrency)]
    try:
        # A server that never answers (and no budget to stop waiting) must not hang the run.
        _, stuck = await asyncio.wait(workers, timeout=warmup + duration + _drain_timeout(drain_timeout_s, budget_ms))
        for task in stuck:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        # The requests counted are those sent in the window: a rate over its length, not over the
        # time their last answers took to come (which would favour the server with the shorter tail).
        window = duration
        after = await ep.counts()
    finally:
        ticker.cancel()
        progress.close()
    step = StepResult(mode="closed", concurrency=concurrency, budget_ms=budget_ms, rows_per_request=pool.rows,
                      streaming=streaming)
    return _summarize(step, rec, window, await before, after, budget_ms)


def arrival_times(rate: float, total_s: float, burst: tuple[int, float] | None, rng: np.random.Generator) -> np.ndarray:
    """Sorted send offsets (s) in [0, total_s): Poisson at `rate`, plus `burst` = (size, period)
    requests at once every period seconds."""
    times = np.empty(0)
    if rate > 0:
        # Draw a few sigma more gaps than expected, then cut at total_s.
        expected = rate * total_s
        n = int(expected + 6 * math.sqrt(expected) + 16)
        times = np.cumsum(rng.exponential(1.0 / rate, size=n))
        while times[-1] < total_s:  # pragma: no cover - astronomically unlikely
            times = np.concatenate([times, times[-1] + np.cumsum(rng.exponential(1.0 / rate, size=n))])
        times = times[times < total_s]
    if burst:
        size, period = burst
        ticks = np.arange(period, total_s, period)
        times = np.concatenate([times, np.repeat(ticks, size)])
    return np.sort(times)


async def open_step(
    ep: Endpoint,
    pool: RequestPool,
    rate: float,
    duration: float,
    warmup: float = 1.0,
    budget_ms: float | None = None,
    burst: tuple[int, float] | None = None,
    max_outstanding: int = DEFAULT_MAX_OUTSTANDING,
    drain_timeout_s: float | None = None,
    seed: int = 0,
    progress: Progress | None = None,
    streaming: bool = False,
) -> StepResult:
    """Send on a pre-drawn schedule without waiting for answers (as unary calls, or with
    `streaming` spread over a few ModelStreamInfer streams); requests scheduled in the
    `duration` window after `warmup` are measured, and the step waits for all their answers."""
    if rate <= 0 and not burst:
        raise BenchError("an open-loop step needs a rate > 0 or a burst")
    timeout = budget_ms / 1e3 if budget_ms is not None else None
    schedule = arrival_times(rate, warmup + duration, burst, np.random.default_rng(seed))
    measured_from = int(np.searchsorted(schedule, warmup))
    rec = _Recorder()
    n = len(pool.requests)
    pending: set[asyncio.Task] = set()
    measured: set[asyncio.Task] = set()
    progress = progress or Progress(False)
    progress.start(f"open {rate:g}/s", warmup + duration)
    start = time.perf_counter()
    ticker = asyncio.create_task(_ticker(progress, start, rec))
    before = asyncio.create_task(_counts_at(ep, start + warmup))

    mux = ep.stream_mux() if streaming else None
    infer = mux.infer if mux else ep.infer

    async def one(payload: bytes, record: bool, due: float) -> None:
        # Timed from when it was due, not from when this client got to send it: a client that falls
        # behind (its event loop stalled) must not hide the wait in its own queue (coordinated
        # omission); and its budget, the deadline it carries, counts from then too.
        late = max(0.0, time.perf_counter() - due)
        remaining = None if timeout is None else max(0.001, timeout - late)
        code, latency = await infer(payload, remaining)
        if record:
            rec.add(code, latency + late)
            rec.lags.append(late)

    try:
        i = 0
        while i < len(schedule):
            now = time.perf_counter() - start
            # Everything already due goes out now, so a late wake-up does not lower the rate.
            while i < len(schedule) and schedule[i] <= now:
                record = i >= measured_from
                if len(pending) >= max_outstanding:
                    if record:
                        rec.codes[NOT_SENT] += 1
                else:
                    task = asyncio.create_task(one(pool.requests[i % n], record, start + schedule[i]))
                    pending.add(task)
                    task.add_done_callback(pending.discard)
                    if record:
                        measured.add(task)
                i += 1
            if i < len(schedule):
                await asyncio.sleep(max(0.0, schedule[i] - (time.perf_counter() - start)))
        window = max(duration, time.perf_counter() - start - warmup)
        if measured:
            _, stuck = await asyncio.wait(measured, timeout=_drain_timeout(drain_timeout_s, budget_ms))
            for task in stuck:
                task.cancel()
            if stuck:
                rec.codes[UNFINISHED] += len(stuck)
                await asyncio.gather(*stuck, return_exceptions=True)
        after = await ep.counts()
    finally:
        ticker.cancel()
        progress.close()
        for task in pending:
            task.cancel()
        if mux:
            mux.close()
    step = StepResult(mode="open", rate=rate, burst=burst, budget_ms=budget_ms, rows_per_request=pool.rows,
                      streaming=streaming)
    step = _summarize(step, rec, window, await before, after, budget_ms)
    step.offered_rps = (len(schedule) - measured_from) / window
    return step
