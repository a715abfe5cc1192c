"""A span per generated sequence on its executor, its steps as events.

The span `generate` continues the request's trace (a child of the gateway's request span, as
`execute` is for a batched model) and lasts from the sequence's arrival at the executor to its final
reply. Each engine step that gave it tokens is an event `step` (the tokens' count and the index
of the first in the output), the first of them also `first_token`; each push to the gateway an
event `flush` (the responses and tokens pushed). Its end says why it ended (`batchline.finish_reason`:
eos, length, stop, cancelled) and how many tokens this executor made. With tracing off every
call is a no-op, so serving pays nothing for it.
"""
from __future__ import annotations

from batchline import telemetry
from batchline.protocol import internal_pb2 as pb
from executor.generation_engine import Output

_tracer = telemetry.tracer("batchline.executor")


class SequenceTrace:
    def __init__(self, entry: pb.QueueEntry, model: str, version: str, prompt_tokens: int, resumed: int):
        """`resumed`: the tokens another executor sent before it died (recomputed here, not sent again)."""
        self.span = None
        self.made = 0
        if not telemetry.enabled():
            return
        self.span = _tracer.start_span(
            "generate", context=telemetry.extract(entry.traceparent, entry.tracestate), attributes={
                "batchline.model": model, "batchline.model_version": version,
                "batchline.request_id": entry.request_id, "batchline.prompt_tokens": prompt_tokens,
                "batchline.resumed_tokens": resumed})

    def step(self, out: Output, index: int) -> None:
        if self.span is None or not out.token_ids:
            return
        attributes = {"batchline.tokens": len(out.token_ids), "batchline.index": index}
        if not self.made:
            self.span.add_event("first_token", attributes)
        self.made += len(out.token_ids)
        self.span.add_event("step", attributes)

    def flush(self, responses: int, tokens: int) -> None:
        if self.span is not None and tokens:
            self.span.add_event("flush", {"batchline.responses": responses, "batchline.tokens": tokens})

    def end(self, finish_reason: str, error: str = "") -> None:
        if self.span is None:
            return
        self.span.set_attribute("batchline.finish_reason", finish_reason)
        self.span.set_attribute("batchline.generated_tokens", self.made)
        if error:
            telemetry.set_error(self.span, error)
        self.span.end()
        self.span = None
