"""Prometheus metrics of every service, defined once in the default registry.

Each service serves them at http://HOST:PORT/metrics (`start_metrics_server`).
A service only ever touches its own metrics, so a process exposes every
family but fills in only its own (``batchline up`` itself: its supervisor's
and autoscaler's, in their section below); the in-process test mesh runs all
three services in one process and one endpoint shows everything.

Label values: ``model``/``version`` are the resolved model name and version
(a failed request's too: the version that would have served it; a name no
executor ever served counts under model "", an unknown version under version
""), ``reason`` on failures is the lower-case gRPC status name (`status_reason`).
Counters are declared without the ``_total`` suffix: prometheus_client adds it.

The ``batchline_stage_*_seconds`` histograms split a request's time at the mesh into the stages it
passes, each observed once per request by the service where the stage ends: enqueue (gateway),
queue (scheduler), dispatch and execute (executor), reply (gateway). From the enqueue stamp on they
follow one another without gaps; the queue stage starts as the request is handed to the group
commit, so it overlaps the end of the enqueue stage by the commit's wait and write. Stages that
cross services subtract wall clocks of different hosts (deadlines do too: NTP-synced hosts).
"""
from __future__ import annotations

import threading
import time
from types import TracebackType

import prometheus_client
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

# The *_created series double every counter's and histogram's output and no dashboard reads them.
prometheus_client.disable_created_metrics()

# 0.5 ms .. 30 s: an in-memory Redis round trip at the low end, a generous budget at the high end.
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
# Slack at dispatch can be negative (dispatched late): those land in the le="0" bucket.
SLACK_BUCKETS = (0.0,) + LATENCY_BUCKETS
# Finer than LATENCY_BUCKETS between 1 ms and 1 s, where a closed loop's p50 and p99 fall: quantiles
# interpolated within 20–50 ms or 50–100 ms buckets cannot tell a p99 of 2× the p50 from one of 1.4×.
STAGE_BUCKETS = (0.00025, 0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02,
                 0.025, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0,
                 5.0, 10.0, 30.0)
BATCH_SIZE_BUCKETS = tuple(float(2**i) for i in range(9))  # 1, 2, 4, ..., 256 rows

_MV = ("model", "version")

# -- gateway ------------------------------------------------------------------------------------
REQUEST_SUCCESS = Counter("batchline_request_success", "Inference requests answered successfully.", _MV)
REQUEST_FAILURE = Counter(
    "batchline_request_failure", "Inference requests that failed, by lower-case gRPC status name.", _MV + ("reason",)
)
REQUEST_DURATION = Histogram(
    "batchline_request_duration_seconds", "End-to-end duration of successful requests at the gateway.", _MV,
    buckets=LATENCY_BUCKETS,
)
REJECTED = Counter(
    "batchline_rejected",
    "Requests refused before they were queued (reason: queue_full, overload, deadline; rate: the tenant's max_rate).",
    _MV + ("reason",),
)
AUTH_FILE_UNUSABLE = Gauge(
    "batchline_auth_file_unusable",
    "1 while the auth file on disk cannot be used (gone, unreadable, or no longer parses): the gateway keeps the "
    "tokens it read before, so a token removed in that change is still honoured; 0 once it reads the file again.",
)
REFUSALS_REUSED = Counter(
    "batchline_refusals_reused", "Overload refusals answered by an earlier refusal's verdict (the same model and "
    "priority, nothing it was judged on changed since) without playing the queue again; also counted in "
    "batchline_rejected.", _MV,
)
TENANT_REQUESTS = Counter(
    "batchline_tenant_requests", "Inference requests of each tenant (the tenant of the caller's token; counted when "
    "the gateway has an auth file), by lower-case gRPC status name (ok, resource_exhausted, ...).",
    ("model", "tenant", "status"),
)
TENANT_OVER_SHARE = Counter(
    "batchline_tenant_over_share",
    "Requests queued below the priority they asked for because their tenant was over its "
    "weighted share of the model (gateway/fairness.py).", ("model", "tenant"),
)
ADMISSION_HEADROOM = Gauge(
    "batchline_admission_headroom",
    "Share of a request's budget its predicted finish may fill to be admitted "
    "(learned from answers: admission_target).",
    _MV,
)
STAGE_ENQUEUE = Histogram(
    "batchline_stage_enqueue_seconds", "Service stage 1 of a queued request: from its arrival at the gateway to Redis "
    "confirming its enqueue (parsing, admission control, the group commit's wait for company and its write).", _MV,
    buckets=STAGE_BUCKETS,
)
STAGE_REPLY = Histogram(
    "batchline_stage_reply_seconds", "Service stage 5 of a request that ran: from the end of its batch's run at the "
    "executor to the gateway resuming the request with its answer (encoding, the write to Redis, the gateway's read, "
    "its event loop).", _MV, buckets=STAGE_BUCKETS,
)
FAILOVER_LOST = Counter(
    "batchline_redis_failover_lost_requests",
    "Queued requests the gateway answered UNAVAILABLE because a new Redis primary lacked them.",
)

TEXT_TRUNCATED = Counter(
    "batchline_text_truncated",
    "Texts cut to their model's [tokenizer] max_length (truncate = true) before they were tokenized.", _MV)
# -- scheduler ----------------------------------------------------------------------------------
PENDING_REQUESTS = Gauge(
    "batchline_pending_requests",
    "Requests waiting in a queue, by priority level, as the leading scheduler last saw it (a standby reports none).",
    _MV + ("priority",),
)
BATCHES_DISPATCHED = Counter(
    "batchline_batches_dispatched",
    "Batches dispatched, by why they left (full, preferred, deadline, delay, no_company).",
    _MV + ("reason",),
)
BATCH_SIZE = Histogram("batchline_batch_size", "Rows per dispatched batch, as planned (members that left the queue "
                       "meanwhile, e.g. answered by a former leader, still count).", _MV, buckets=BATCH_SIZE_BUCKETS)
DISPATCH_SLACK = Histogram(
    "batchline_dispatch_slack_seconds",
    "Time left at dispatch before the batch's earliest deadline, less its expected execution time "
    "(negative when it went out too late to make it).", _MV,
    buckets=SLACK_BUCKETS,
)
STAGE_QUEUE = Histogram(
    "batchline_stage_queue_seconds", "Service stage 2 of a dispatched request: from its enqueue at the gateway (as it "
    "was handed to the group commit) to the dispatch of its batch.", _MV, buckets=STAGE_BUCKETS,
)
SHED = Counter(
    "batchline_shed", "Requests the scheduler answered DEADLINE_EXCEEDED: past, or unable to make, their deadline.", _MV
)
REDISPATCHED = Counter("batchline_redispatched", "Requests requeued because their executor was lost.", _MV)
EXECUTORS_WANTED = Gauge(
    "batchline_executors_wanted",
    "Executors the mesh wants, by the leader's forecast of each model's arrivals over the "
    "horizon at the target utilisation, never below what finishes the queues within their budgets "
    "(scheduler/demand.py): what `batchline up --autoscale` and KEDA scale executors on.",
)
ARRIVAL_RATE_FORECAST = Gauge(
    "batchline_arrival_rate_forecast", "Requests per second the gateways are expected to receive for the model over "
    "the forecast horizon (refused ones included), by the leader scheduler.", _MV,
)
EXECUTOR_CAPACITY = Gauge(
    "batchline_executor_capacity", "Requests per second one executor answers within the model's default budget, of "
    "the length its executors ran lately, by the learned latency profile and the planning model "
    "(batchline/planning/capacity.py).", _MV,
)
EXECUTOR_START = Gauge(
    "batchline_executor_start_seconds", "Median start-to-serving time (process start, sessions loaded, warm-up) the "
    "live executors reported: the forecast horizon unless one is configured.",
)
SCHEDULER_LEADER = Gauge("batchline_scheduler_leader", "1 while this scheduler holds the scheduling lease.")

# -- executor -----------------------------------------------------------------------------------
MODEL_PROVIDER = Gauge(
    "batchline_model_provider", "1 for the ONNX Runtime execution provider each model version loaded in this executor "
    "runs on (its session's first provider: what it fell back to when a GPU provider could not be created).",
    _MV + ("provider",),
)
REQUESTS_DROPPED = Counter(
    "batchline_requests_dropped",
    "Requests an executor took in a batch and dropped unread, as nobody waited for them (reason: payload_gone, "
    "answered elsewhere, cancelled or timed out; gateway_gone, its gateway's heartbeat lapsed).",
    _MV + ("reason",),
)
INFERENCE_COUNT = Counter("batchline_inference_count", "Rows executed.", _MV)
EXECUTION_COUNT = Counter("batchline_execution_count", "Batches executed (rows/batches = mean batch size).", _MV)
PADDING_EFFICIENCY = Histogram(
    "batchline_padding_efficiency", "Per batch run: the tokens (elements at the model's variable dims) of its requests "
    "over what it ran once padded to its longest member; 1 = no padding.", _MV,
    buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0),
)
QUEUE_DURATION = Histogram(
    "batchline_queue_duration_seconds", "Time from enqueue to the start of execution.", _MV, buckets=LATENCY_BUCKETS
)
STAGE_DISPATCH = Histogram(
    "batchline_stage_dispatch_seconds", "Service stage 3 of a request that ran: from its batch's dispatch to the start "
    "of the batch's run (the executor taking it, fetching and decoding its inputs, the batch ahead finishing).", _MV,
    buckets=STAGE_BUCKETS,
)
STAGE_EXECUTE = Histogram(
    "batchline_stage_execute_seconds", "Service stage 4 of a request that ran: its batch's model runs, counted once "
    "per request (batchline_compute_infer_duration_seconds counts them once per batch).", _MV, buckets=STAGE_BUCKETS,
)
COMPUTE_INPUT_DURATION = Histogram(
    "batchline_compute_input_duration_seconds", "Fetching and decoding a batch's inputs.", _MV, buckets=LATENCY_BUCKETS
)
COMPUTE_INFER_DURATION = Histogram(
    "batchline_compute_infer_duration_seconds", "Running the model on a batch.", _MV, buckets=LATENCY_BUCKETS
)
COMPUTE_OUTPUT_DURATION = Histogram(
    "batchline_compute_output_duration_seconds", "Splitting, encoding and writing a batch's outputs.", _MV,
    buckets=LATENCY_BUCKETS,
)
EXECUTOR_BUSY = Counter(
    "batchline_executor_busy_seconds", "Seconds spent executing batches (its rate is the busy fraction).", ("executor",)
)
GENERATION_TTFT = Histogram(
    "batchline_generation_time_to_first_token_seconds", "A generation request's time from its enqueue at the gateway "
    "to its first token's sampling on the executor (a request continued after a failure is not counted again).", _MV,
    buckets=LATENCY_BUCKETS,
)
GENERATION_TPOT = Histogram(
    "batchline_generation_time_per_output_token_seconds", "A generation request's time per output token after the "
    "first: from its first token to its last, over the tokens between.", _MV, buckets=LATENCY_BUCKETS,
)
GENERATION_TOKENS = Counter(
    "batchline_generation_tokens", "Output tokens generated (its rate is tokens per second).", _MV,
)
GENERATION_RUNNING = Gauge(
    "batchline_generation_running_sequences", "Sequences in the generation engine's running batch.", _MV,
)
GENERATION_WAITING = Gauge(
    "batchline_generation_waiting_sequences", "Sequences waiting in the generation engine for a cache slot.", _MV,
)
GENERATION_CACHE_USE = Gauge(
    "batchline_generation_cache_use", "Share of the generation engine's key/value cache slots held by sequences.", _MV,
)
GENERATION_PREEMPTIONS = Counter(
    "batchline_generation_preemptions", "Running sequences preempted by one of better priority (recomputed when "
    "readmitted).", _MV,
)
BATCHES_REWRITTEN = Counter(
    "batchline_redis_failover_rewritten_batches",
    "Finished batches an executor wrote again because a new Redis primary lacked their answers.",
)

# -- every service ------------------------------------------------------------------------------
REDIS_ROUNDTRIP = Histogram(
    "batchline_redis_roundtrip_seconds", "Duration of a Redis round trip (command or pipeline), failed ones included.",
    ("service", "op"), buckets=LATENCY_BUCKETS,
)
REDIS_FAILOVERS = Counter(
    "batchline_redis_failovers",
    "Times this service found Redis answering from a new primary (a Sentinel failover, or a restarted Redis).",
)

# -- batchline up -------------------------------------------------------------------------------
RESTARTS = Counter(
    "batchline_restarts", "Services `batchline up` restarted after they exited (redis: the embedded Redis).",
    ("service",)
)
SCALE_EVENTS = Counter(
    "batchline_scale_events", "Decisions of `batchline up --autoscale` to start executors (direction up) or stop them "
    "(down), by reason: forecast, queue or backlog (what the leader's demand asked for: its forecast, the rate a queue "
    "shows arriving above it, the queue to finish), cool_down (fewer wanted for the "
    "cool-down), bounds (outside MIN:MAX).", ("direction", "reason"),
)
DEMAND_READS = Counter(
    "batchline_demand_reads", "Times `batchline up --autoscale` read the leader's demand and decided (a decision to "
    "change nothing included): flat while it runs means the autoscaler is stuck.",
)

def _exposed_name(metric: MetricWrapperBase) -> str:
    family = metric.describe()[0]
    return family.name + "_total" if family.type == "counter" else family.name


# Every metric this module defines, by the name it is scraped under.
METRIC_NAMES = tuple(_exposed_name(m) for m in list(globals().values()) if isinstance(m, MetricWrapperBase))


def status_reason(code) -> str:
    """The `reason` label of a failure: a grpc.StatusCode (or its name) in lower case."""
    return (code.name if hasattr(code, "name") else str(code)).lower()


# -- endpoint -----------------------------------------------------------------------------------

_servers: dict[int, object] = {}
_servers_lock = threading.Lock()


def start_metrics_server(host: str, port: int) -> int:
    """Serve the default registry at http://host:port/metrics from a daemon thread.

    port 0 binds any free port; -1 (or any negative) starts nothing. Returns the
    bound port, or -1 when nothing was started.
    """
    if port < 0:
        return -1
    server, _thread = prometheus_client.start_http_server(port, addr=host)
    bound = server.server_port
    with _servers_lock:
        _servers[bound] = server
    return bound


def stop_metrics_server(port: int) -> None:
    """Stop an endpoint `start_metrics_server` started (a no-op for -1 or an unknown port)."""
    with _servers_lock:
        server = _servers.pop(port, None)
    if server is not None:
        server.shutdown()
        server.server_close()


class redis_rtt:
    """Times a Redis round trip into batchline_redis_roundtrip_seconds{service,op}.

    Works as ``with`` and ``async with`` around the awaited call:

        async with redis_rtt("gateway", "enqueue"):
            await pipe.execute()
    """

    __slots__ = ("_child", "_start", "_since")

    def __init__(self, service: str, op: str, since: float | None = None):
        """`since`: when the command went out (time.perf_counter), where it went out before the `with`."""
        self._child = REDIS_ROUNDTRIP.labels(service, op)
        self._start = 0.0
        self._since = since

    def __enter__(self) -> "redis_rtt":
        self._start = time.perf_counter() if self._since is None else self._since
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._child.observe(time.perf_counter() - self._start)

    async def __aenter__(self) -> "redis_rtt":
        return self.__enter__()

    async def __aexit__(self, exc_type, exc, tb) -> None:
        self.__exit__(exc_type, exc, tb)
