"""A real OTLP/gRPC trace receiver for tests: what a collector or Jaeger would be sent.

    with OtlpReceiver() as receiver:
        ... OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint ...
        spans = receiver.wait_for(lambda spans: any(s.name == "x" for s in spans), timeout=30)
"""
from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2


def any_value(v: common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind)


def attributes(kvs) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in kvs}


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str  # hex, as in a traceparent
    span_id: str
    parent_span_id: str  # "" for a root span
    kind: str  # SERVER, CLIENT, INTERNAL, ...
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    links: tuple[tuple[str, str], ...]  # (trace_id, span_id) of each link
    status: str  # UNSET, OK, ERROR
    status_message: str = ""
    resource: dict[str, Any] = field(default_factory=dict)
    events: tuple[tuple[str, int, dict[str, Any]], ...] = ()  # (name, time in ns, attributes) of each

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _flatten(request: trace_service_pb2.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    out = []
    for rs in request.resource_spans:
        resource = attributes(rs.resource.attributes)
        service = str(resource.get("service.name", ""))
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(ReceivedSpan(
                    service=service,
                    name=s.name,
                    trace_id=s.trace_id.hex(),
                    span_id=s.span_id.hex(),
                    parent_span_id=s.parent_span_id.hex(),
                    kind=trace_pb2.Span.SpanKind.Name(s.kind).removeprefix("SPAN_KIND_"),
                    start_ns=s.start_time_unix_nano,
                    end_ns=s.end_time_unix_nano,
                    attributes=attributes(s.attributes),
                    links=tuple((lk.trace_id.hex(), lk.span_id.hex()) for lk in s.links),
                    status=trace_pb2.Status.StatusCode.Name(s.status.code).removeprefix("STATUS_CODE_"),
                    status_message=s.status.message,
                    resource=resource,
                    events=tuple((e.name, e.time_unix_nano, attributes(e.attributes)) for e in s.events),
                ))
    return out


class _Servicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: "OtlpReceiver"):
        self.receiver = receiver

    def Export(self, request, context):
        self.receiver._add(_flatten(request))
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """An OTLP trace service on 127.0.0.1, port chosen by the OS, keeping every span it is sent."""

    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._cond = threading.Condition()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Servicer(self), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "OtlpReceiver":
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None)

    def __enter__(self) -> "OtlpReceiver":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _add(self, spans: list[ReceivedSpan]) -> None:
        with self._cond:
            self._spans.extend(spans)
            self._cond.notify_all()

    @property
    def spans(self) -> list[ReceivedSpan]:
        with self._cond:
            return list(self._spans)

    def wait_for(self, predicate: Callable[[list[ReceivedSpan]], bool], timeout: float = 30.0) -> list[ReceivedSpan]:
        """The spans received so far once `predicate(spans)` holds; AssertionError (listing them) at the deadline."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(list(self._spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"spans not received within {timeout} s; got {len(self._spans)}:\n" + format_tree(self._spans)
                    )
                # Woken by every export; the cap re-checks predicates that depend on more than the spans.
                self._cond.wait(min(left, 0.5))
            return list(self._spans)


def format_tree(spans: list[ReceivedSpan]) -> str:
    """Spans as indented trees, one per trace, children under parents, in start order."""
    by_id = {(s.trace_id, s.span_id): s for s in spans}
    children: dict[tuple[str, str], list[ReceivedSpan]] = {}
    roots = []
    for s in spans:
        key = (s.trace_id, s.parent_span_id)
        if s.parent_span_id and key in by_id:
            children.setdefault(key, []).append(s)
        else:
            roots.append(s)
    lines: list[str] = []

    def emit(s: ReceivedSpan, depth: int, root: bool = False) -> None:
        extra = []
        if root and s.parent_span_id:
            extra.append(f"parent={s.parent_span_id} (not received)")
        if s.links:
            extra.append("links=" + ",".join(f"{t[:8]}../{sp}" for t, sp in s.links))
        if s.status == "ERROR":
            extra.append(f"ERROR {s.status_message}")
        attrs = " ".join(f"{k}={v}" for k, v in sorted(s.attributes.items()) if k.startswith("batchline."))
        words = [f"{s.name} [{s.service}] {s.kind.lower()} {s.duration_ms:.3f} ms span={s.span_id}", *extra, attrs]
        lines.append("  " * depth + " ".join(w for w in words if w))
        for c in sorted(children.get((s.trace_id, s.span_id), []), key=lambda x: x.start_ns):
            emit(c, depth + 1)

    for trace_id in dict.fromkeys(r.trace_id for r in sorted(roots, key=lambda x: x.start_ns)):
        lines.append(f"trace {trace_id}")
        for r in sorted((r for r in roots if r.trace_id == trace_id), key=lambda x: x.start_ns):
            emit(r, 1, root=True)
    return "\n".join(lines)
