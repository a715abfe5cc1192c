"""What an executor writes when a batch is done: the replies, the execution report for the
scheduler, Triton's statistics counters and the Prometheus metrics, in one Redis command
(contract.batch_done)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

from redis.asyncio import Redis

from batchline import contract, metrics
from batchline.clock import now_us
from batchline.errors import BatchlineError
from batchline.protocol import internal_pb2 as pb
from executor.repository import LoadedModel


class Member(Protocol):
    entry: pb.QueueEntry
    outputs: object | None
    error: BatchlineError | None


@dataclass(slots=True)
class Timing:
    start_us: int          # when the executor took the batch (epoch µs)
    input_ns: int          # fetching and decoding its payloads
    infer_ns: int          # its model runs
    output_ns: int         # encoding its replies
    ran_until_us: int = 0  # when its runs released the model (0: nothing ran)
    units: int = 0         # the work run, in the latency profile's units (batchline.sizing)


async def write(redis: Redis, executor_id: str, batch: pb.Batch, model: LoadedModel | None,
                members: Sequence[Member], replies: Mapping[str, Sequence[bytes]], timing: Timing) -> None:
    """Write a finished batch: `replies` per gateway id, for `members` (those still awaited)."""
    done_us = now_us()
    ok = [m for m in members if m.error is None and m.outputs is not None]
    rows = sum(m.entry.rows for m in ok)
    report = pb.ExecutionReport(
        executor_id=executor_id, batch_id=batch.batch_id, model_name=batch.model_name,
        model_version=batch.model_version, rows=rows, requests=len(members),
        compute_input_ns=timing.input_ns, compute_infer_ns=timing.infer_ns, compute_output_ns=timing.output_ns,
        failed=len(members) - len(ok), ran_until_us=timing.ran_until_us, units=timing.units,
    )
    succeeded = model is not None and bool(ok)
    stats: list = _statistics(ok, rows, timing, done_us) if succeeded else []
    if len(ok) < len(members):
        failed = [m for m in members if m not in ok]
        stats += ("fail_count", len(failed), "fail_ns", sum((done_us - m.entry.enqueued_us) * 1000 for m in failed))
    async with metrics.redis_rtt("executor", "write"):
        await contract.batch_done(redis, batch, report, replies, stats, done_us // 1000 if succeeded else 0)
    metrics.EXECUTOR_BUSY.labels(executor_id).inc((now_us() - timing.start_us) / 1e6)
    if succeeded:
        labels = (model.name, model.version)
        metrics.INFERENCE_COUNT.labels(*labels).inc(rows)
        metrics.EXECUTION_COUNT.labels(*labels).inc()
        metrics.COMPUTE_INPUT_DURATION.labels(*labels).observe(timing.input_ns / 1e9)
        metrics.COMPUTE_INFER_DURATION.labels(*labels).observe(timing.infer_ns / 1e9)
        metrics.COMPUTE_OUTPUT_DURATION.labels(*labels).observe(timing.output_ns / 1e9)
        queue = metrics.QUEUE_DURATION.labels(*labels)
        for m in ok:
            queue.observe(max(0, timing.start_us - m.entry.enqueued_us) / 1e6)


def _statistics(ok: Sequence[Member], rows: int, timing: Timing, done_us: int) -> list:
    """The statistics counters a batch adds to (field, increment, ...), Triton's per model and per batch size."""
    n = len(ok)
    return [
        "success_count", n,
        "success_ns", sum((done_us - m.entry.enqueued_us) * 1000 for m in ok),
        "queue_count", n,
        "queue_ns", sum(max(0, timing.start_us - m.entry.enqueued_us) * 1000 for m in ok),
        "compute_input_count", n,
        "compute_input_ns", timing.input_ns * n,
        "compute_infer_count", n,
        "compute_infer_ns", timing.infer_ns * n,
        "compute_output_count", n,
        "compute_output_ns", timing.output_ns * n,
        "inference_count", rows,
        "execution_count", 1,
        contract.batch_stat(rows, "count"), 1,
        contract.batch_stat(rows, "compute_input_ns"), timing.input_ns,
        contract.batch_stat(rows, "compute_infer_ns"), timing.infer_ns,
        contract.batch_stat(rows, "compute_output_ns"), timing.output_ns,
    ]
