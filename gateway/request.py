"""One inference request as the gateway handles it: validated once, on entry, into the facts that
admission, queueing and answering need, and the queue entry that carries them through Redis."""
from __future__ import annotations

from dataclasses import dataclass

from batchline import contract, telemetry, tracecontext
from batchline.contract.keys import ModelKey
from batchline.errors import DeadlineExceeded, duration_text
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import internal_pb2 as pb
from gateway.shared_memory import Copied
from gateway.validation import CheckedLayouts, checked, request_priority, request_timeout_us

# Budgets are capped so that an absurd `timeout` (Triton's is a 64-bit µs
# count) cannot overflow a deadline; nothing is served after a day anyway.
MAX_BUDGET_S = float(contract.MAX_BUDGET_S)


@dataclass(frozen=True, slots=True)
class Call:
    request: ipb.ModelInferRequest
    model: pb.ModelInfo
    rows: int            # its batch size
    length: int          # elements per row at the model's variable dims (batchline.sizing)
    priority: int        # 1 is the highest
    budget_s: float      # the client's: the tighter of its gRPC deadline and `timeout`, else the model's default
    run_budget_s: float  # what the mesh plans by: the budget less the time kept for the answer's way back
    payload: bytes = b""  # the request serialized, when it came so (inputs read from shared memory)
    # Its inputs' bytes copied in place of the shared-memory regions it references: what is queued
    # again when an executor cannot read them (gateway/shared_memory.py); None: it references none.
    copied: Copied | None = None
    tenant: str = ""      # a sequence request's tenant (its sequence is that tenant's)
    truncated: int = 0    # its texts cut to the model's max_length (said in the answer's parameters)

    @property
    def key(self) -> ModelKey:
        return self.model.name, self.model.version


def budget_s(request: ipb.ModelInferRequest, model: pb.ModelInfo, grpc_remaining: float | None) -> float:
    """The latency budget: the tighter of the gRPC deadline and `timeout`, else the model default."""
    candidates = []
    if grpc_remaining is not None:
        candidates.append(grpc_remaining)
    timeout_us = request_timeout_us(request)
    if timeout_us is not None:
        candidates.append(timeout_us / 1e6)
    if not candidates:
        return min(model.default_timeout_ms / 1000, MAX_BUDGET_S)
    return min(*candidates, MAX_BUDGET_S)


def parse(request: ipb.ModelInferRequest, model: pb.ModelInfo, grpc_remaining: float | None,
          answer_margin_s: float, payload: bytes = b"", layouts: CheckedLayouts | None = None) -> Call:
    """Validate `request` against `model` (InvalidArgument naming what is wrong) and take its facts;
    `layouts`: the gateway's, which a request laid out like one found valid passes at once.

    The mesh plans to finish a little before the client's deadline, keeping `answer_margin_s`
    (at most half the budget) for the answer's way back.
    """
    rows, length = checked(request, model) if layouts is None else layouts.facts(request, model)
    budget = budget_s(request, model, grpc_remaining)
    if budget <= 0:
        raise DeadlineExceeded(f"the request's deadline had passed {duration_text(-budget)} "
                               "before it reached the gateway")
    return Call(request, model, rows, length, request_priority(request, model), budget,
                budget - min(answer_margin_s, budget / 2), payload)


def queue_entry(call: Call, gateway_id: str, enqueued_us: int, deadline_us: int, traceparent: str,
                tracestate: str) -> pb.QueueEntry:
    """The request's queue entry. It carries the gateway's ModelInfer span (or, with tracing off, a
    child of the client's traceparent) to the other services."""
    request_id = f"{tracecontext.random_id(128):032x}"
    span_parent = span_state = ""
    if telemetry.enabled():
        span = telemetry.current_span()
        span.set_attribute("batchline.model_version", call.model.version)
        span.set_attribute("batchline.request_id", request_id)
        span_parent, span_state = telemetry.inject(span)
    return pb.QueueEntry(
        request_id=request_id,
        gateway_id=gateway_id,
        model_version=call.model.version,
        rows=call.rows,
        length=call.length,
        deadline_us=deadline_us,
        enqueued_us=enqueued_us,
        priority=call.priority,
        tenant=call.tenant,
        traceparent=span_parent or tracecontext.child(traceparent),
        tracestate=span_state if span_parent else (tracestate if tracecontext.parse(traceparent) else ""),
    )
