"""One inference as both ports serve it: traced (continuing the client's trace), counted, and
every failure a BatchlineError. The gRPC servicer and the REST app differ only in how they read
the request and write the answer."""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Sequence

from batchline import metrics, telemetry
from batchline.auth import Grant, visible
from batchline.errors import BatchlineError, Internal, grpc_status
from batchline.protocol import inference_pb2 as ipb
from gateway.core import Gateway
from gateway.replies import PartialSink

log = logging.getLogger(__name__)
_tracer = telemetry.tracer("batchline.gateway")


# The longest `tracestate` carried on: W3C Trace Context asks that 512 characters pass, and a
# client's list rides in every queue entry of its request, so a longer one is dropped whole.
MAX_TRACESTATE = 512


def trace_headers(metadata: Sequence[tuple[str, Any]] | None) -> tuple[str, str]:
    md = dict(metadata or ())
    state = md.get("tracestate", "")
    return md.get("traceparent", ""), state if len(state) <= MAX_TRACESTATE else ""


def count_failure(gateway: Gateway, model: str, version: str, grant: Grant | None, error: BatchlineError) -> None:
    """A refused or failed request in the failure counters (and its tenant's), as either port counts it."""
    labels = gateway.catalog.labels(model, version)
    reason = metrics.status_reason(grpc_status(error))
    metrics.REQUEST_FAILURE.labels(*labels, reason).inc()
    if grant is not None:
        metrics.TENANT_REQUESTS.labels(labels[0], grant.tenant, reason).inc()


async def infer(gateway: Gateway, request: ipb.ModelInferRequest, remaining_s: float | None,
                metadata: Sequence[tuple[str, Any]] | None, name: str = "ModelInfer",
                grant: Grant | None = None, on_partial: PartialSink | None = None,
                rate_taken: bool = False) -> ipb.ModelInferResponse | None:
    """`metadata`: the call's gRPC metadata or HTTP headers (lowercase names), for the trace
    context; `remaining_s`: the client's deadline, if it set one. A decoupled model's responses go
    to `on_partial` (ModelStreamInfer), and its answer is None unless its end came with one.
    `rate_taken`: the tenant's rate was charged already (the REST port charges it before it reads
    the body, as gRPC charges it before the model is looked up). Raises BatchlineError."""
    started = time.perf_counter()
    traced = telemetry.enabled()
    with (telemetry.server_span(_tracer, name, metadata, {"batchline.model": request.model_name})
          if traced else contextlib.nullcontext()) as span:
        def failed(error: BatchlineError) -> None:
            count_failure(gateway, request.model_name, request.model_version, grant, error)
            if traced:
                telemetry.set_error(span, f"{grpc_status(error).name}: {error}")

        try:
            if grant is not None and grant.max_rate > 0 and not rate_taken:
                await gateway.take_rate(grant.tenant, grant.max_rate, request.model_name)
            response = await gateway.infer(
                request, remaining_s, *trace_headers(metadata), on_partial=on_partial, visible=visible(grant),
                **({"tenant": grant.tenant, "weight": grant.weight} if grant is not None else {}))
        except BatchlineError as exc:
            failed(exc)
            raise
        except Exception as exc:
            # A bug or a failure nobody foresaw: INTERNAL with what happened, not gRPC's UNKNOWN,
            # and on a stream an answer rather than a request left hanging.
            log.exception("request %r to model %r failed unexpectedly", request.id, request.model_name)
            error = Internal(f"the gateway failed on this request unexpectedly ({type(exc).__name__}: {exc})")
            failed(error)
            raise error from exc
    model_name, model_version = ((response.model_name, response.model_version) if response is not None else
                                 gateway.catalog.labels(request.model_name, request.model_version))
    metrics.REQUEST_SUCCESS.labels(model_name, model_version).inc()
    if grant is not None:
        metrics.TENANT_REQUESTS.labels(model_name, grant.tenant, "ok").inc()
    metrics.REQUEST_DURATION.labels(model_name, model_version).observe(time.perf_counter() - started)
    return response
