"""Warm-up runs of a model before it serves: the first pays for allocations and kernel selection;
the timed ones become the scheduler's first latency samples for that version, so its first
requests are not scheduled blind."""
from __future__ import annotations

import logging
import time

from batchline.protocol import internal_pb2 as pb
from batchline.sizing import row_length
from executor.repository import LoadedModel, warmup_inputs

log = logging.getLogger(__name__)


def batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, ... up to the model's largest batch."""
    sizes = [1]
    while sizes[-1] * 2 <= max_batch_size:
        sizes.append(sizes[-1] * 2)
    return sizes


def warm_up(model: LoadedModel, executor_id: str) -> list[pb.ExecutionReport]:
    """Run the model once, then twice per batch size, timed; the reports of the timed runs (blocking)."""
    t = time.perf_counter()
    model.session.run(None, warmup_inputs(model))
    log.info("warmed up %s:%s in %.1f ms", model.name, model.version, (time.perf_counter() - t) * 1e3)
    ran_on = list(model.session.get_providers())
    if ran_on != list(model.info.providers):
        # A provider that failed in the run (TensorRT's engine build) made ONNX Runtime fall back:
        # what the status, the provider gauge and the latency profiles say follows where it runs.
        log.warning("model %s:%s: %s failed in its first run; it runs on %s", model.name, model.version,
                    model.info.providers[0] if model.info.providers else "its provider", ran_on[0])
        del model.info.providers[:]
        model.info.providers.extend(ran_on)
    reports = []
    for rows in batch_sizes(model.info.max_batch_size):
        feeds = warmup_inputs(model, rows)
        units = rows * row_length(model.info, {name: arr.shape for name, arr in feeds.items()})
        for _ in range(2):
            t0 = time.perf_counter_ns()
            model.session.run(None, feeds)
            reports.append(pb.ExecutionReport(
                executor_id=executor_id, batch_id="warmup", model_name=model.name, model_version=model.version,
                rows=rows, requests=rows, units=units, compute_infer_ns=time.perf_counter_ns() - t0, warmup=True,
            ))
    return reports
