"""The telemetry building blocks: tracing setup and W3C context helpers, and the metrics endpoint.

The global TracerProvider can be set once per process, so whatever installs it
runs in a subprocess; everything else uses a local SDK provider.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import urllib.request

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client.parser import text_string_to_metric_families

from batchline import metrics, telemetry, tracecontext
from batchline.testing.checkout import ROOT
from batchline.testing.otlp_receiver import OtlpReceiver

CLIENT_TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(extra)
    return env


def _run(script: str, env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.fixture
def local():
    """A private SDK provider whose finished spans land in memory (the global one is never touched)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("test"), exporter
    provider.shutdown()


@pytest.fixture
def no_otel_env(monkeypatch):
    for key in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(key)


# -- setup_tracing ------------------------------------------------------------------------------


def test_setup_tracing_exports_over_otlp_with_the_service_name():
    with OtlpReceiver() as receiver:
        out = _run(
            """
            from opentelemetry import trace
            from batchline import telemetry
            assert telemetry.setup_tracing("gateway") is True
            provider = trace.get_tracer_provider()
            assert telemetry.setup_tracing("other") is True and trace.get_tracer_provider() is provider  # idempotent
            with trace.get_tracer("t").start_as_current_span("hello") as span:
                span.set_attribute("batchline.model", "mlp")
                print(telemetry.inject(span)[0])
            telemetry.shutdown_tracing()  # flushes
            """,
            _clean_env(OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
                       OTEL_EXPORTER_OTLP_INSECURE="true", OTEL_BSP_SCHEDULE_DELAY="100"),
        )
        spans = receiver.wait_for(lambda spans: any(s.name == "hello" for s in spans), timeout=30)
    (hello,) = [s for s in spans if s.name == "hello"]
    assert hello.service == "batchline-gateway"
    assert hello.attributes == {"batchline.model": "mlp"}
    version, trace_id, span_id, flags = out.strip().split("-")
    assert (version, trace_id, span_id) == ("00", hello.trace_id, hello.span_id)
    assert int(flags, 16) & 1  # sampled (newer SDKs also set W3C's "random trace id" bit)


def test_endpoint_alone_turns_tracing_on_and_env_names_the_service():
    with OtlpReceiver() as receiver:
        _run(
            """
            from opentelemetry import trace
            from batchline import telemetry
            assert telemetry.setup_tracing("batchline-scheduler") is True
            with trace.get_tracer("t").start_as_current_span("named"):
                pass
            telemetry.shutdown_tracing()
            """,
            _clean_env(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=receiver.endpoint, OTEL_SERVICE_NAME="custom",
                       OTEL_RESOURCE_ATTRIBUTES="deployment.environment=test"),
        )
        spans = receiver.wait_for(lambda spans: any(s.name == "named" for s in spans), timeout=30)
    (named,) = [s for s in spans if s.name == "named"]
    assert named.service == "custom"
    assert named.resource["deployment.environment"] == "test"


def test_tracing_is_off_by_default():
    out = _run(
        f"""
        from opentelemetry import trace
        from batchline import telemetry
        import sys
        assert telemetry.setup_tracing("gateway") is False
        assert not telemetry.enabled()
        tracer = trace.get_tracer("t")
        with telemetry.server_span(tracer, "ModelInfer", [("traceparent", "{CLIENT_TRACEPARENT}")]) as span:
            assert not span.is_recording()
            # The no-op span carries the client's context; inject must not hand that back as ours.
            assert telemetry.inject(span) == ("", "")
            assert telemetry.inject() == ("", "")
        assert "opentelemetry.sdk.trace" not in sys.modules  # the SDK is never even imported
        telemetry.shutdown_tracing()
        print("off")
        """,
        _clean_env(),
    )
    assert out.strip() == "off"


@pytest.mark.parametrize("env", [
    {},
    {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"},
    {"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"},
])
def test_build_provider_is_none_unless_asked(no_otel_env, monkeypatch, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert telemetry.build_provider("gateway") is None


def test_build_provider_reads_the_sampler_from_env(no_otel_env, monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    provider = telemetry.build_provider("executor")
    try:
        assert provider.resource.attributes["service.name"] == "batchline-executor"
        span = provider.get_tracer("t").start_span("dropped")
        assert not span.is_recording() and not span.get_span_context().trace_flags.sampled
        # A sampled-out span still propagates its context, so downstream honours the decision.
        traceparent, _ = telemetry.inject(span.get_span_context())
        assert tracecontext.parse(traceparent) and not int(traceparent[-2:], 16) & 1
    finally:
        provider.shutdown()


# -- context through Redis messages -------------------------------------------------------------


def test_inject_extract_round_trip_keeps_trace_and_parent(local):
    tracer, exporter = local
    parent = tracer.start_span("ModelInfer", context=telemetry.extract(CLIENT_TRACEPARENT, "vendor=abc"))
    traceparent, tracestate = telemetry.inject(parent)
    pctx = parent.get_span_context()
    assert traceparent == f"00-{pctx.trace_id:032x}-{pctx.span_id:016x}-{int(pctx.trace_flags):02x}"
    assert pctx.trace_flags.sampled
    assert tracestate == "vendor=abc"  # the client's tracestate travels on
    assert traceparent.split("-")[1] == CLIENT_TRACEPARENT.split("-")[1]

    child = tracer.start_span("execute", context=telemetry.extract(traceparent, tracestate))
    child.end()
    parent.end()
    finished = {s.name: s for s in exporter.get_finished_spans()}
    assert finished["execute"].context.trace_id == pctx.trace_id
    assert finished["execute"].parent.span_id == pctx.span_id
    assert finished["ModelInfer"].parent.span_id == int(CLIENT_TRACEPARENT.split("-")[2], 16)

    # A context (or the current span) injects the same way.
    assert telemetry.inject(trace.set_span_in_context(parent)) == (traceparent, tracestate)
    with trace.use_span(parent):
        assert telemetry.inject() == (traceparent, tracestate)


def test_extract_of_nothing_starts_a_new_trace(local):
    tracer, _ = local
    for bad in ("", "garbage", "00-" + "0" * 32 + "-b7ad6b7169203331-01"):
        span = tracer.start_span("root", context=telemetry.extract(bad))
        assert span.parent is None
        span.end()


def test_link_points_to_the_traceparent(local):
    tracer, exporter = local
    link = telemetry.link(CLIENT_TRACEPARENT, "vendor=abc", {"batchline.request_id": "r1"})
    _, trace_id, span_id, _ = CLIENT_TRACEPARENT.split("-")
    assert link is not None
    assert (link.context.trace_id, link.context.span_id) == (int(trace_id, 16), int(span_id, 16))
    assert link.context.is_remote and link.attributes["batchline.request_id"] == "r1"
    assert telemetry.link("", "") is None and telemetry.link("not-a-traceparent") is None

    with tracer.start_as_current_span("batch", context=telemetry.extract(""), links=[link]):
        pass
    (batch,) = exporter.get_finished_spans()
    assert batch.parent is None
    assert [(lk.context.trace_id, lk.context.span_id) for lk in batch.links] == [(int(trace_id, 16), int(span_id, 16))]


def test_record_span_has_the_given_timestamps(local):
    tracer, exporter = local
    start_us, end_us = 1_700_000_000_000_000, 1_700_000_000_012_345
    span = telemetry.record_span(tracer, "queue_wait", start_us, end_us, context=telemetry.extract(CLIENT_TRACEPARENT),
                                 attributes={"batchline.batch_id": "b1", "batchline.slack_ms": 3.5})
    assert not span.is_recording()  # returned ended
    (got,) = exporter.get_finished_spans()
    assert (got.start_time, got.end_time) == (start_us * 1000, end_us * 1000)
    assert got.parent.span_id == int(CLIENT_TRACEPARENT.split("-")[2], 16)
    assert dict(got.attributes) == {"batchline.batch_id": "b1", "batchline.slack_ms": 3.5}


def test_server_span_continues_the_client_traceparent(local):
    tracer, exporter = local
    metadata = (("user-agent", "grpc-python"), ("traceparent", CLIENT_TRACEPARENT), ("tracestate", "vendor=abc"))
    with telemetry.server_span(tracer, "ModelInfer", metadata, {"batchline.model": "mlp"}) as span:
        assert trace.get_current_span() is span
        with tracer.start_as_current_span("enqueue"):
            pass
    with pytest.raises(ValueError):
        with telemetry.server_span(tracer, "ModelInfer", [("traceparent", b"ignored-garbage")]):
            raise ValueError("boom")
    ok, failed = [s for s in exporter.get_finished_spans() if s.name == "ModelInfer"]
    enqueue = next(s for s in exporter.get_finished_spans() if s.name == "enqueue")
    assert ok.kind == SpanKind.SERVER and ok.attributes["batchline.model"] == "mlp"
    assert f"{ok.context.trace_id:032x}" == CLIENT_TRACEPARENT.split("-")[1]
    assert ok.parent.span_id == int(CLIENT_TRACEPARENT.split("-")[2], 16) and ok.parent.is_remote
    assert str(ok.context.trace_state) and ok.context.trace_state.get("vendor") == "abc"
    assert enqueue.parent.span_id == ok.context.span_id
    assert failed.parent is None and failed.status.status_code == StatusCode.ERROR


def test_set_error(local):
    tracer, exporter = local
    with tracer.start_as_current_span("ModelInfer") as span:
        telemetry.set_error(span, "invalid_argument: bad shape")
    (got,) = exporter.get_finished_spans()
    assert got.status.status_code == StatusCode.ERROR and got.status.description == "invalid_argument: bad shape"


# -- metrics ------------------------------------------------------------------------------------


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        return resp.read().decode()


def _sample(text: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


async def test_metrics_server_serves_every_metric():
    assert metrics.start_metrics_server("127.0.0.1", -1) == -1
    port = metrics.start_metrics_server("127.0.0.1", 0)
    try:
        assert port > 0
        before = _sample(_scrape(port), "batchline_redis_roundtrip_seconds_count", service="test", op="unit") or 0.0
        with metrics.redis_rtt("test", "unit"):
            pass
        async with metrics.redis_rtt("test", "unit"):
            pass
        with pytest.raises(ConnectionError):
            with metrics.redis_rtt("test", "unit"):  # a failed round trip is still timed
                raise ConnectionError
        metrics.BATCH_SIZE.labels("unit-model", "1").observe(3)
        text = _scrape(port)
        families = {f.name for f in text_string_to_metric_families(text)}
        for name in metrics.METRIC_NAMES:
            assert f"# TYPE {name.removesuffix('_total')} " in text or f"# TYPE {name} " in text, name
            assert name.removesuffix("_total") in families, name
        assert "_created" not in text
        assert _sample(text, "batchline_redis_roundtrip_seconds_count", service="test", op="unit") == before + 3
        assert _sample(text, "batchline_batch_size_bucket", model="unit-model", version="1", le="2.0") == 0
        assert _sample(text, "batchline_batch_size_bucket", model="unit-model", version="1", le="4.0") == 1
        assert _sample(text, "batchline_batch_size_bucket", model="unit-model", version="1", le="256.0") == 1
    finally:
        metrics.stop_metrics_server(port)
    with pytest.raises(OSError):
        _scrape(port)


def test_status_reason_is_the_lower_case_grpc_name():
    assert metrics.status_reason(grpc.StatusCode.INVALID_ARGUMENT) == "invalid_argument"
    assert metrics.status_reason(grpc.StatusCode.DEADLINE_EXCEEDED) == "deadline_exceeded"
    assert metrics.status_reason("NOT_FOUND") == "not_found"


def test_a_tracestate_past_w3cs_length_is_not_carried_into_the_queue():
    """A client's tracestate rides in every queue entry of its request: one past the 512 characters
    W3C Trace Context asks to pass is dropped whole, the traceparent kept."""
    from gateway.inference import MAX_TRACESTATE, trace_headers

    fits = "vendor=" + "a" * (MAX_TRACESTATE - 7)
    assert trace_headers([("traceparent", CLIENT_TRACEPARENT), ("tracestate", fits)]) == (CLIENT_TRACEPARENT, fits)
    assert trace_headers([("traceparent", CLIENT_TRACEPARENT), ("tracestate", fits + "a")]) == (CLIENT_TRACEPARENT, "")
