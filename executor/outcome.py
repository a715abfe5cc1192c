"""What an executor writes when a batch is done: the replies, the execution report for the
scheduler, Triton's statistics counters and the Prometheus metrics, in one Redis command
(the store's batch_done)."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Mapping, Sequence

from batchline import contract, metrics
from batchline.contract import FinishedBatch
from batchline.contract.executor_store import ExecutorStore
from batchline.clock import now_us
from batchline.histograms import observe_each, observe_times
from batchline.protocol import internal_pb2 as pb
from executor.repository import LoadedModel
from executor.running import Member

# A new Redis primary (a Sentinel failover) may lack the last writes the old one acknowledged:
# replication is asynchronous, so only the final moments before the old primary died are at
# risk. The executor keeps its last finished batches' writes, up to this age, count and size of
# their replies, to write again those whose batch key the new primary still holds.
REWRITE_WINDOW_S = 60.0
REWRITE_KEEP = 1_024
REWRITE_KEEP_BYTES = 16 << 20


class Written:
    """The writes of the last finished batches, kept so that a new primary can be given the ones it lacks."""

    def __init__(self) -> None:
        self._recent: deque[tuple[float, int, FinishedBatch]] = deque()  # (when, reply bytes, the write)
        self._bytes = 0

    def add(self, done: FinishedBatch) -> None:
        size = done.reply_bytes
        self._recent.append((time.monotonic(), size, done))
        self._bytes += size
        while len(self._recent) > REWRITE_KEEP or (self._bytes > REWRITE_KEEP_BYTES and len(self._recent) > 1):
            self._bytes -= self._recent.popleft()[1]

    def batches(self) -> list[pb.Batch]:
        """The batches kept, oldest first."""
        return [done.batch for _, _, done in self._recent]

    async def rewrite_lost(self, store: ExecutorStore, resend_answers: bool = False) -> int:
        """Write again each kept batch whose batch key Redis still holds: the batch's answers never
        reached this primary, and without them its requests would wait out their deadlines.

        With `resend_answers` (a Redis Cluster), first send again, in one write, the answers of the
        kept batches whose key is gone: a cluster keeps a batch's key and its answers on different
        shards, so the shard that failed over may have lost the answers alone, and when it stopped
        acknowledging is not known here (a primary cut off from the rest answers until the cluster
        demotes it). A gateway ignores an answer it has had. Returns how many batches were written
        or answered again."""
        since = time.monotonic() - REWRITE_WINDOW_S
        kept = [done for at, _, done in self._recent if at >= since]
        if not kept:
            return 0
        held = await store.still_dispatched(kept)
        answered = [done for done, h in zip(kept, held) if not h and done.replies] if resend_answers else []
        if answered:
            answers: dict[str, list[bytes]] = {}
            for done in answered:
                for gateway_id, blobs in done.replies.items():
                    answers.setdefault(gateway_id, []).extend(blobs)
            await store.send_replies(answers)
        lost = [done for done, h in zip(kept, held) if h]
        for done in lost:
            await store.batch_done(done)
        return len(lost) + len(answered)


@dataclass(slots=True)
class Timing:
    start_us: int          # when the executor took the batch (epoch µs)
    input_ns: int          # fetching and decoding its payloads
    infer_ns: int          # its model runs
    output_ns: int         # encoding its replies
    ran_until_us: int = 0  # when its runs released the model (0: nothing ran)
    units: int = 0         # the work run, in the latency profile's units (batchline.sizing)


async def write(store: ExecutorStore, executor_id: str, batch: pb.Batch, model: LoadedModel | None,
                members: Sequence[Member], replies: Mapping[str, Sequence[bytes]], timing: Timing,
                written: Written | None = None, generated: bool = False) -> None:
    """Write a finished batch: `replies` per gateway id, for `members` (those still awaited); kept in
    `written` once Redis acknowledged it. `generated`: a generation batch (its records of tokens sent
    go with it)."""
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
        failed = [m for m in members if m.error is not None or m.outputs is None]
        stats += ("fail_count", len(failed), "fail_ns", sum((done_us - m.entry.enqueued_us) * 1000 for m in failed))
    done = FinishedBatch(batch, report, replies, stats, done_us // 1000 if succeeded else 0, generated)
    async with metrics.redis_rtt("executor", "write"):
        await store.batch_done(done)
    if written is not None:
        written.add(done)
    # On the wall clock (the start is an epoch time): one stepped back must not make the counter
    # raise, after the batch's answers are written.
    metrics.EXECUTOR_BUSY.labels(executor_id).inc(max(0, now_us() - timing.start_us) / 1e6)
    if succeeded:
        labels = (model.name, model.version)
        metrics.INFERENCE_COUNT.labels(*labels).inc(rows)
        metrics.EXECUTION_COUNT.labels(*labels).inc()
        metrics.COMPUTE_INPUT_DURATION.labels(*labels).observe(timing.input_ns / 1e9)
        metrics.COMPUTE_INFER_DURATION.labels(*labels).observe(timing.infer_ns / 1e9)
        metrics.COMPUTE_OUTPUT_DURATION.labels(*labels).observe(timing.output_ns / 1e9)
        start_us = timing.start_us
        observe_each(metrics.QUEUE_DURATION.labels(*labels),
                     [max(0, start_us - m.entry.enqueued_us) / 1e6 for m in ok])
        if timing.ran_until_us:
            run_s = timing.infer_ns / 1e9
            waited_s = max(0, timing.ran_until_us - timing.infer_ns // 1000 - batch.dispatched_us) / 1e6
            # Once per request, not per batch: the stages' quantiles are then the requests' own.
            observe_times(metrics.STAGE_DISPATCH.labels(*labels), waited_s, len(ok))
            observe_times(metrics.STAGE_EXECUTE.labels(*labels), run_s, len(ok))


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
