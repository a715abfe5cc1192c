"""Load generation against KServe v2 gRPC or HTTP endpoints (batchline or Triton): `batchline bench`.

Python API (what the benchmark scripts and tests use)::

    from batchline.bench import InputOptions, run_closed, run_open
    step = run_closed("127.0.0.1:8001", "minilm", concurrency=32, duration=10,
                      inputs=InputOptions(seq_len=128))
    print(step.throughput_rps, step.latency_ms["p99"], step.mean_batch_size)

    step = run_open("127.0.0.1:8001", "minilm", rate=400, duration=10, budget_ms=200)
    print(step.goodput_rps, step.status_counts)

`run_bench(BenchConfig(...))` runs a whole sweep and returns a `BenchResult`
(see `report` for the table, JSON and plot).
"""
from __future__ import annotations

import datetime
from typing import Any
from dataclasses import asdict, dataclass, field

from batchline import eventloop
from batchline.bench.inputs import InputError, InputOptions, RequestPool, TensorInfo, build_pool, build_text_pool
from batchline.bench.loadgen import (
    DEFAULT_MAX_OUTSTANDING,
    BenchError,
    Endpoint,
    Progress,
    StepResult,
    closed_step,
    open_step,
)
from batchline.bench.report import BenchResult, format_table, plot, read_json, write_json

__all__ = [
    "BenchConfig", "BenchError", "BenchResult", "InputError", "InputOptions", "RequestPool", "StepResult",
    "TensorInfo", "build_pool", "format_table", "plot", "read_json", "run_bench", "run_closed", "run_open",
    "write_json",
]


@dataclass
class BenchConfig:
    url: str
    model: str
    version: str = ""
    mode: str = "closed"                      # closed | open
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 32])
    rate: list[float] = field(default_factory=lambda: [100.0])
    burst: tuple[int, float] | None = None    # (size, period s), open loop
    duration: float = 10.0                    # measured seconds per step
    warmup: float = 2.0                       # unmeasured seconds before each step
    budget_ms: float | None = None
    priority: int = 0
    inputs: InputOptions = field(default_factory=InputOptions)
    max_outstanding: int = DEFAULT_MAX_OUTSTANDING
    progress: bool = False
    streaming: bool = False                   # ModelStreamInfer streams instead of unary calls
    retry_after: bool = True                  # closed loop: wait out a refusal's retry-after hint
    connections: int = 1                      # gRPC connections, calls spread over them round robin
    headers: dict[str, str] = field(default_factory=dict)  # metadata of every call (authorization: Bearer ...)
    protocol: str = "grpc"                    # grpc, or http: KServe v2 REST with binary tensors


async def _connect(config: BenchConfig, ep: Endpoint) -> RequestPool:
    tensors = await ep.inputs()
    if config.inputs.texts:
        text = await ep.text_input()
        if not text:
            raise BenchError(f"model {config.model!r} takes no text input (a [tokenizer] in its config.toml): "
                             "--texts needs one")
        return build_text_pool(config.model, text, config.inputs, version=config.version,
                               budget_ms=config.budget_ms, priority=config.priority)
    try:
        return build_pool(config.model, tensors, config.inputs, version=config.version,
                          budget_ms=config.budget_ms, priority=config.priority)
    except InputError as exc:
        raise BenchError(str(exc)) from None


async def run_bench_async(config: BenchConfig) -> BenchResult:
    if config.mode not in ("closed", "open"):
        raise BenchError(f"unknown mode {config.mode!r} (closed or open)")
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    progress = Progress(config.progress)
    if config.protocol not in ("grpc", "http"):
        raise BenchError(f"unknown protocol {config.protocol!r} (grpc or http)")
    if config.protocol == "http" and config.streaming:
        raise BenchError("--streaming is gRPC's ModelStreamInfer: HTTP has no streams")
    if config.protocol == "http":
        # tritonclient's HTTP client (and its gevent) only where the run asks for HTTP.
        from batchline.bench.http import HttpEndpoint

        endpoint: Any = HttpEndpoint
    else:
        endpoint = Endpoint
    async with endpoint(config.url, config.model, config.version, config.connections, config.headers) as ep:
        pool = await _connect(config, ep)
        cfg = asdict(config)
        cfg.pop("url"), cfg.pop("model"), cfg.pop("version"), cfg.pop("progress")
        cfg["headers"] = sorted(cfg.pop("headers"))  # names only: a token is a secret
        cfg["input_shapes"] = pool.shapes
        result = BenchResult(target={"url": config.url, "model": config.model, "version": config.version},
                             config=cfg, started_at=started)
        if config.mode == "closed":
            for c in config.concurrency:
                result.steps.append(await closed_step(ep, pool, c, config.duration, config.warmup,
                                                      config.budget_ms, progress, streaming=config.streaming,
                                                      retry_after=config.retry_after))
        else:
            for k, r in enumerate(config.rate):
                result.steps.append(await open_step(
                    ep, pool, r, config.duration, config.warmup, config.budget_ms, config.burst,
                    config.max_outstanding, seed=config.inputs.seed + k, progress=progress, streaming=config.streaming))
    return result


def run_bench(config: BenchConfig) -> BenchResult:
    """Run a whole sweep (one step per concurrency or rate) in a fresh event loop."""
    return eventloop.run(run_bench_async(config))


def run_closed(url: str, model: str, concurrency: int, duration: float, *, warmup: float = 1.0,
               version: str = "", budget_ms: float | None = None, priority: int = 0,
               inputs: InputOptions | None = None, progress: bool = False, streaming: bool = False,
               retry_after: bool = True, connections: int = 1, protocol: str = "grpc") -> StepResult:
    """One closed-loop step: `concurrency` requests kept in flight for `duration` s after `warmup` s
    (with `streaming`, each on a ModelStreamInfer stream of its own; with `retry_after`, a refused
    request's retry-after hint is waited out before the next; `protocol` "http": over KServe v2 REST
    with binary tensors, `url` its HOST:PORT)."""
    config = BenchConfig(url=url, model=model, version=version, mode="closed", concurrency=[concurrency],
                         duration=duration, warmup=warmup, budget_ms=budget_ms, priority=priority,
                         inputs=inputs or InputOptions(), progress=progress, streaming=streaming,
                         retry_after=retry_after, connections=connections, protocol=protocol)
    return run_bench(config).steps[0]


def run_open(url: str, model: str, rate: float, duration: float, *, warmup: float = 1.0,
             version: str = "", budget_ms: float | None = None, priority: int = 0,
             burst: tuple[int, float] | None = None, inputs: InputOptions | None = None,
             max_outstanding: int = DEFAULT_MAX_OUTSTANDING, progress: bool = False,
             streaming: bool = False) -> StepResult:
    """One open-loop step: Poisson arrivals at `rate`/s (plus bursts) for `duration` s after `warmup` s
    (with `streaming`, over a few ModelStreamInfer streams)."""
    config = BenchConfig(url=url, model=model, version=version, mode="open", rate=[rate], burst=burst,
                         duration=duration, warmup=warmup, budget_ms=budget_ms, priority=priority,
                         inputs=inputs or InputOptions(), max_outstanding=max_outstanding, progress=progress,
                         streaming=streaming)
    return run_bench(config).steps[0]
