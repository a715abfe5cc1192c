"""Tracing: an OpenTelemetry TracerProvider configured from the standard OTEL_* env vars.

Off by default. Unless OTEL_TRACES_EXPORTER or an OTLP endpoint variable is
set, nothing is installed and the API's no-op tracer stays in place, so the
spans the services open cost next to nothing and the W3C context they carry
through Redis falls back to `batchline.tracecontext`.

Read by this module: OTEL_SDK_DISABLED, OTEL_TRACES_EXPORTER (``otlp``,
``console``, ``none``; comma-separated), OTEL_EXPORTER_OTLP_ENDPOINT and
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT. Read by the SDK itself: OTEL_SERVICE_NAME,
OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER(_ARG), OTEL_BSP_*, and the rest
of OTEL_EXPORTER_OTLP_* (insecure, headers, timeout, compression, certificates).

Context crosses the Redis hop as the ``traceparent``/``tracestate`` strings of
the queue entries and batches: `inject` turns a span into them, `extract` and
`link` turn them back into a parent context or a span link.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Any, Iterator, Mapping, Sequence

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()
_lock = threading.Lock()
_configured: bool | None = None  # None: setup_tracing not called yet in this process
_provider: Any = None  # the SDK TracerProvider this module installed, if any
# Whether the environment names a provider for OpenTelemetry to load (read once: see enabled()).
_ENVIRONMENT_PROVIDER = "OTEL_PYTHON_TRACER_PROVIDER" in os.environ

_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def _service_name(default: str) -> str:
    return default if default.startswith("batchline-") else f"batchline-{default}"


def _exporter_names(environ: Mapping[str, str]) -> list[str]:
    raw = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if raw:
        return [n.strip() for n in raw.split(",") if n.strip() and n.strip() != "none"]
    # No exporter named: an OTLP endpoint alone is enough to mean "export there".
    return ["otlp"] if any(environ.get(v, "").strip() for v in _ENDPOINT_VARS) else []


def build_provider(default_service_name: str, environ: Mapping[str, str] | None = None):
    """A configured SDK TracerProvider, or None when the environment leaves tracing off.

    Touches no global state, so tests can build several in one process (the
    SDK's own pieces still read os.environ for their settings).
    """
    environ = os.environ if environ is None else environ
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    names = _exporter_names(environ)
    if not names:
        return None

    # Imported only when tracing is on: the SDK and the exporter are not free to import.
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    resource = Resource.create()  # OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: _service_name(default_service_name)}))
    provider = TracerProvider(resource=resource)  # the sampler comes from OTEL_TRACES_SAMPLER(_ARG)
    exporters = []
    for name in names:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporters.append(OTLPSpanExporter())
        elif name == "console":
            exporters.append(ConsoleSpanExporter())
        else:
            log.warning("OTEL_TRACES_EXPORTER=%s is not supported (use otlp, console or none); ignored", name)
    if not exporters:
        provider.shutdown()
        return None
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))  # OTEL_BSP_* apply
    return provider


def setup_tracing(default_service_name: str) -> bool:
    """Install the global TracerProvider from the environment; True when tracing is on.

    `default_service_name` ("gateway" or "batchline-gateway") is used when
    neither OTEL_SERVICE_NAME nor OTEL_RESOURCE_ATTRIBUTES names the service.
    Only the first call in a process decides; later calls return its answer.
    """
    global _configured, _provider
    with _lock:
        if _configured is not None:
            return _configured
        provider = build_provider(default_service_name)
        if provider is not None:
            trace.set_tracer_provider(provider)
            _provider = provider
            log.info("tracing on: %s", provider.resource.attributes.get("service.name"))
        _configured = provider is not None
        return _configured


def shutdown_tracing() -> None:
    """Flush the spans still queued and stop the exporters (call once, on exit)."""
    global _provider
    with _lock:
        provider, _provider = _provider, None
    if provider is not None:
        provider.shutdown()


def enabled() -> bool:
    """Whether a real TracerProvider (ours or anyone's) is the global one."""
    # Checked without importing the SDK, which tracing-off processes never load. Asked several
    # times a request: while nobody has set a global provider, OpenTelemetry's getter looks the
    # environment up on every call, so the provider it holds is read first.
    if _provider is not None:
        return True
    provider = getattr(trace, "_TRACER_PROVIDER", None)
    if provider is None:
        if not _ENVIRONMENT_PROVIDER:
            return False
        provider = trace.get_tracer_provider()
    return not isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider))


def tracer(name: str) -> Tracer:
    return trace.get_tracer(name)


def current_span() -> Span:
    return trace.get_current_span()


# -- W3C context through Redis messages ---------------------------------------------------------


def extract(traceparent: str, tracestate: str = "") -> Context:
    """A parent Context from a message's traceparent/tracestate (empty -> a new trace)."""
    carrier = {"traceparent": traceparent} if traceparent else {}
    if traceparent and tracestate:
        carrier["tracestate"] = tracestate
    return _PROPAGATOR.extract(carrier, context=Context())


def span_context(traceparent: str, tracestate: str = "") -> SpanContext | None:
    ctx = trace.get_current_span(extract(traceparent, tracestate)).get_span_context()
    return ctx if ctx.is_valid else None


def link(traceparent: str, tracestate: str = "", attributes: Mapping[str, Any] | None = None) -> Link | None:
    """A Link to the span a message's traceparent names, or None when there is none."""
    ctx = span_context(traceparent, tracestate)
    return Link(ctx, attributes=dict(attributes) if attributes else None) if ctx else None


def inject(span_or_context: Span | SpanContext | Context | None = None) -> tuple[str, str]:
    """(traceparent, tracestate) of a span (default: the current one), or ("", "") when tracing is off.

    The no-op tracer hands back the parent's context unchanged, so with tracing
    off this returns ("", "") rather than the caller's own parent; the caller
    then mints a child with `batchline.tracecontext`.
    """
    if isinstance(span_or_context, SpanContext):
        ctx, from_noop = span_or_context, False
    else:
        if span_or_context is None:
            span = trace.get_current_span()
        elif isinstance(span_or_context, Span):
            span = span_or_context
        else:
            span = trace.get_current_span(span_or_context)
        ctx = span.get_span_context()
        # The no-op tracer's spans are NonRecordingSpans; so are an SDK's sampled-out
        # spans, whose context must travel on (downstream honours the decision).
        from_noop = isinstance(span, trace.NonRecordingSpan) and not enabled()
    if not ctx.is_valid or from_noop:
        return "", ""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(trace.NonRecordingSpan(ctx), Context()))
    return carrier.get("traceparent", ""), carrier.get("tracestate", "")


# -- spans --------------------------------------------------------------------------------------


def record_span(
    tracer: Tracer,
    name: str,
    start_us: int,
    end_us: int,
    *,
    context: Context | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Mapping[str, Any] | None = None,
    links: Sequence[Link] | None = None,
) -> Span:
    """A span recorded after the fact, with timestamps in epoch microseconds; returned ended.

    For intervals only known once they are over (e.g. queue_wait: enqueue -> dispatch).
    """
    span = tracer.start_span(
        name, context=context, kind=kind, attributes=dict(attributes or {}), links=links, start_time=start_us * 1000
    )
    span.end(end_time=max(end_us, start_us) * 1000)
    return span


def _metadata_carrier(metadata: Sequence[tuple[str, Any]] | None) -> dict[str, str]:
    carrier: dict[str, str] = {}
    for key, value in metadata or ():
        key = key.lower()
        if key in ("traceparent", "tracestate"):
            carrier[key] = value.decode("latin-1") if isinstance(value, bytes) else str(value)
    return carrier


@contextlib.contextmanager
def server_span(
    tracer: Tracer,
    name: str,
    metadata: Sequence[tuple[str, Any]] | None,
    attributes: Mapping[str, Any] | None = None,
) -> Iterator[Span]:
    """A SERVER span made current, continuing the client's traceparent from gRPC invocation metadata.

    An exception leaving the block is recorded and sets the status to ERROR.
    """
    parent = _PROPAGATOR.extract(_metadata_carrier(metadata), context=Context())
    with tracer.start_as_current_span(
        name, context=parent, kind=SpanKind.SERVER, attributes=dict(attributes or {})
    ) as span:
        yield span


def set_error(span: Span, description: str) -> None:
    """Mark a span failed (e.g. with the gRPC status name and message a request ended with)."""
    span.set_status(Status(StatusCode.ERROR, description))
