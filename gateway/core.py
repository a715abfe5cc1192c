"""What the gateway does, in domain terms: admit, queue, await, answer.

The gRPC servicer converts protobuf and status codes; everything else lives
here. A request is validated against the model's metadata, stamped with its
deadline and priority, admitted or refused by the predicted finish time
(gateway/admission.py), written to Redis (payload + queue entry), and
answered when its Reply arrives on this gateway's reply list.

Writes are group-committed: the requests that arrive while one pipeline is
in flight go out together in the next, with a single scheduler wake-up, so
Redis round trips grow with time, not with the request rate.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import defaultdict, deque
from dataclasses import dataclass

from batchline import contract, metrics, telemetry, tracecontext
from batchline.clock import now_us
from batchline.lifecycle import stop_tasks
from batchline.errors import (
    BatchlineError,
    DeadlineExceeded,
    Internal,
    NotFound,
    ResourceExhausted,
    Unavailable,
    duration_text,
    from_status_value,
)
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import internal_pb2 as pb
from batchline.redis_client import REDIS_ERRORS, REDIS_REFUSALS, ListPop, connect, connect_blocking
from batchline.planning import Pending
from batchline.registry import Registry
from batchline.sizing import row_length
from gateway.admission import Calibration, Candidate, admit, retry_spacing_s
from gateway.linger import Linger
from gateway.settings import GatewaySettings
from gateway.validation import request_priority, request_timeout_us, validate

log = logging.getLogger(__name__)

_DRAIN = 10_000
SERVER_NAME = "batchline"
SERVER_VERSION = "0.1.0"
EXTENSIONS = ["statistics", "model_configuration"]
# A request wants the load views no older than this share of its budget (and
# never fresher than load_refresh_s): the error a stale view brings to
# admission is its age, which only matters relative to the budget.
LOAD_AGE_SHARE = 0.1
# The views are read at least this often, even when no request asks.
LOAD_IDLE_REFRESH_S = 0.5
# Budgets are capped so that an absurd `timeout` (Triton's is a 64-bit µs
# count) cannot overflow a deadline; nothing is served after a day anyway.
MAX_BUDGET_S = float(contract.MAX_BUDGET_S)


@dataclass
class _Write:
    """One request's share of a group-committed pipeline."""
    request_id: str
    payload: bytes
    payload_ttl_ms: int
    queue: str
    notify: str
    member: bytes
    score: int
    max_queue_size: int
    done: asyncio.Future
    deadline_us: int


@dataclass(slots=True)
class _Admitted:
    """A request this gateway admitted, counted ahead of later arrivals until a load view
    counts it (its seen_us for this gateway, or taken after the enqueue was confirmed), or it is over."""
    item: Pending          # as admission plays it: queued, so any batch may take it
    enqueued_us: int = 0   # its QueueEntry's: a view whose seen_us for this gateway reaches it counts it
    confirmed_us: int = 0  # when Redis confirmed the enqueue (0: not yet)
    # Answered or given up: ahead of nobody. An idle scheduler publishes no view after its
    # answer, so waiting for one would count it ahead of every arrival until the view expires.
    over: bool = False


def _end_wait(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class Gateway:
    def __init__(self, settings: GatewaySettings):
        self.settings = settings
        self.gateway_id = settings.gateway_id or f"gw-{uuid.uuid4().hex[:12]}"
        self.redis = connect(settings.redis_url, settings.redis_timeout_s)
        self.blocking = connect_blocking(settings.redis_url, settings.redis_timeout_s)
        self.registry = Registry()
        self.address = ""
        self._pending: dict[str, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []
        self._outbox: list[_Write] = []
        self._abandoned: list[tuple[str, bytes, str]] = []
        self._flusher: asyncio.Task | None = None
        self._linger = Linger(settings.commit_linger_ms / 1000)
        self._lingering: asyncio.Future | None = None  # a commit's wait for company, while it lasts
        self._linger_until = 0.0  # when that wait ends (loop time)
        self.draining = False
        self._heartbeat_ttl_ms = int(settings.heartbeat_interval_s * 3000)
        self._served: set[str] = set()  # model names ever served: their absence is UNAVAILABLE, not NOT_FOUND
        # Admission control: the scheduler's load view per model, and what this
        # gateway admitted since (which that view does not show yet).
        self.loads: dict[tuple[str, str], pb.ModelLoad] = {}
        self._admitted: dict[tuple[str, str], deque[_Admitted]] = defaultdict(deque)
        self._calibrations: dict[tuple[str, str], Calibration] = {}
        # When the requests refused so far are expected back (time.time()), per model and
        # priority level: later refusals are told to come after them (admission.retry_spacing_s).
        self._retries_at: dict[tuple[str, str, int], float] = {}
        # Live gateways (from the heartbeats): each spaces only the refusals it gives itself.
        self.gateways = 1
        self._loads_read_at = 0.0  # time.monotonic() of the last read of the load views
        self._stale = asyncio.Event()  # a request wants fresher views than these

    async def start(self, address: str) -> None:
        self.address = address
        try:
            await self.refresh_registry()
        except REDIS_ERRORS as exc:
            log.warning("Redis not reachable at start (%s); will keep trying", exc)
        self._tasks = [
            asyncio.create_task(self._read_replies(), name="replies"),
            asyncio.create_task(self._refresh_loop(), name="registry"),
            asyncio.create_task(self._heartbeat(), name="heartbeat"),
            asyncio.create_task(self._load_loop(), name="load"),
        ]

    async def drain(self, timeout: float) -> None:
        """Refuse new requests; wait (up to `timeout`) for the admitted ones to be answered."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self._pending and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._pending:
            log.warning("drain: %d requests still unanswered after %.1f s; answering them UNAVAILABLE",
                        len(self._pending), timeout)

    def give_up(self) -> None:
        """Answer whatever is still waiting (for its reply, or to be queued) UNAVAILABLE: shutting down."""
        error = Unavailable("the gateway is shutting down; the request may or may not have run")
        self.fail_pending(error)
        for w in self._outbox:
            if not w.done.done():
                w.done.set_exception(error)

    async def stop(self) -> None:
        await stop_tasks(self._tasks)
        self.give_up()
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.delete(contract.gateway(self.gateway_id))
                pipe.zrem(contract.GATEWAYS, self.gateway_id)
                await pipe.execute()
        except REDIS_ERRORS:
            pass
        await self.redis.aclose()
        await self.blocking.aclose()

    # -- background --------------------------------------------------------

    async def refresh_registry(self) -> None:
        self.registry = await Registry.load(self.redis)
        self._served.update(self.registry.model_names())

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.registry_refresh_s)
            try:
                await self.refresh_registry()
            except REDIS_ERRORS as exc:
                log.warning("registry refresh failed: %s", exc)
            except Exception:  # noqa: BLE001 - a background loop must outlive what Redis answers
                log.exception("registry refresh failed")

    async def _heartbeat(self) -> None:
        while True:
            try:
                self.gateways = await self._register()
            except REDIS_ERRORS as exc:
                log.warning("heartbeat failed: %s", exc)
            except Exception:  # noqa: BLE001 - e.g. Redis out of memory: beat again later
                log.exception("heartbeat failed")
            await asyncio.sleep(self.settings.heartbeat_interval_s)

    async def _register(self) -> int:
        """Renew this gateway's heartbeat; how many gateways are live, this one included.

        Each gateway scores itself in the set by when its heartbeat expires, so that gateways
        with different heartbeat intervals prune only those that are really gone.
        """
        now_ms = int(time.time() * 1000)
        async with self.redis.pipeline(transaction=True) as pipe:  # (never seen without its TTL)
            pipe.set(contract.gateway(self.gateway_id), self.address, px=self._heartbeat_ttl_ms)
            pipe.zadd(contract.GATEWAYS, {self.gateway_id: now_ms + self._heartbeat_ttl_ms})
            pipe.zremrangebyscore(contract.GATEWAYS, "-inf", now_ms)
            pipe.zcard(contract.GATEWAYS)
            pipe.expire(contract.GATEWAYS, contract.GATEWAYS_TTL)
            results = await pipe.execute()
        return max(1, int(results[3]))

    def fail_pending(self, error: BatchlineError) -> None:
        """Answer every waiting request with `error` (shutdown, or Redis lost: its replies may never come)."""
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(error)

    def on_redis(self, up: bool) -> None:
        if not up:
            self.fail_pending(Unavailable(
                "lost contact with Redis while the request was queued; it may or may not have run: retry"
            ))

    def on_redis_restart(self) -> None:
        self.fail_pending(Unavailable("Redis restarted and lost the queued request: retry"))

    async def _load_loop(self) -> None:
        """Keep the scheduler's load views fresh for admission control (one MGET per read).

        Read when a request finds them older than LOAD_AGE_SHARE of its budget, at
        most every load_refresh_s and at least every LOAD_IDLE_REFRESH_S. With 200 ms
        budgets that is every 20 ms, as long as requests arrive; with budgets of
        seconds, or none arriving, every 0.5 s (reading at 50 Hz regardless cost the
        gateway a third of its CPU when serving minilm at 128 tokens).
        """
        while True:
            try:
                await asyncio.wait_for(self._stale.wait(), LOAD_IDLE_REFRESH_S)
            except asyncio.TimeoutError:
                pass
            self._stale.clear()
            keys = sorted(self.registry.models)
            if keys and self.settings.admission_control:
                try:
                    blobs = await self.redis.mget([contract.load(*k) for k in keys])
                    self.loads = {k: pb.ModelLoad.FromString(b) for k, b in zip(keys, blobs) if b}
                except REDIS_ERRORS:
                    self.loads = {}
                except Exception:  # noqa: BLE001 - admit without views rather than on stale ones forever
                    log.exception("reading the load views failed")
                    self.loads = {}
                self._loads_read_at = time.monotonic()
            await asyncio.sleep(self.settings.load_refresh_s)

    async def _read_replies(self) -> None:
        key = contract.reply(self.gateway_id)
        pop = ListPop(self.blocking)
        while True:
            try:
                item = await pop([key], _DRAIN)
            except REDIS_ERRORS as exc:
                log.warning("reading replies failed: %s", exc)
                await asyncio.sleep(0.2)
                continue
            if item is None:
                continue
            blobs = item[1]
            if not pop.all_at_once:
                try:
                    blobs += await self.redis.lpop(key, _DRAIN) or []
                except REDIS_ERRORS as exc:
                    # The first is already off the list: answer it whatever happens to the rest.
                    log.warning("reading replies failed: %s", exc)
            for blob in blobs:
                try:
                    reply = pb.Reply.FromString(blob)
                except Exception:  # noqa: BLE001 - one unreadable reply must not stop the reader
                    log.exception("an unreadable reply (%d bytes) was dropped", len(blob))
                    continue
                fut = self._pending.pop(reply.request_id, None)
                # A second answer to the same request (a batch re-dispatched
                # while the first executor was only slow) finds no future.
                if fut is not None and not fut.done():
                    fut.set_result(reply)

    # -- requests ----------------------------------------------------------

    def metric_labels(self, name: str, version: str = "") -> tuple[str, str]:
        """The (model, version) labels of a request's metrics: resolved as its answer's would be.

        A client that names no version is counted under the version that serves it, so that
        failures and successes of one model line up; a name never served counts under "" so that
        unknown names do not add series without bound.
        """
        try:
            info = self.registry.resolve(name, version)
            return info.name, info.version
        except NotFound:
            return (name, "") if name in self._served else ("", "")

    async def model(self, name: str, version: str = "") -> pb.ModelInfo:
        try:
            return self.registry.resolve(name, version)
        except NotFound:
            # An executor may have registered since the last refresh.
            await self._refresh_or_unavailable()
            try:
                return self.registry.resolve(name, version)
            except NotFound:
                if name in self._served and not self.registry.versions(name):
                    # Served before: its executors are restarting or re-registering (e.g. Redis restarted).
                    raise Unavailable(f"no live executor serves model '{name}' right now (it was served before): retry") from None
                raise

    async def _refresh_or_unavailable(self) -> None:
        try:
            await self.refresh_registry()
        except REDIS_ERRORS as exc:
            raise Unavailable(f"Redis is unreachable: {exc}") from None

    def budget_s(self, request: ipb.ModelInferRequest, model: pb.ModelInfo, grpc_remaining: float | None) -> float:
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

    async def infer(
        self,
        request: ipb.ModelInferRequest,
        grpc_remaining: float | None,
        traceparent: str = "",
        tracestate: str = "",
    ) -> ipb.ModelInferResponse:
        model = await self.model(request.model_name, request.model_version)
        rows = validate(request, model)
        length = row_length(model, {t.name: t.shape for t in request.inputs})
        priority = request_priority(request, model)
        budget = self.budget_s(request, model, grpc_remaining)
        if budget <= 0:
            raise DeadlineExceeded(f"the request's deadline had passed {duration_text(-budget)} before it reached the gateway")
        key = (model.name, model.version)
        if self.draining:
            raise Unavailable("this gateway is shutting down: retry on another instance")
        # The scheduler plans to finish a little before the client's deadline,
        # keeping time for the answer's way back.
        plan_budget = budget - min(self.settings.answer_margin_ms / 1000, budget / 2)
        load = self.loads.get(key)
        arrived_us = now_us()
        if time.monotonic() - self._loads_read_at > budget * LOAD_AGE_SHARE:
            self._stale.set()  # this request uses the views as they are; those behind it get fresher ones
        admitted = None
        calibration = None
        if load is not None and load.policy == "deadline" and arrived_us - load.updated_us < contract.LOAD_TTL_MS * 1000:
            admitted = self._admitted[key]
            seen_us = load.seen_us.get(self.gateway_id, 0)
            while admitted and (admitted[0].over or 0 < admitted[0].confirmed_us <= load.updated_us
                                or admitted[0].enqueued_us <= seen_us):
                # The scheduler's view already counts these, or they are over. (A view taken after
                # Redis had a request may still predate its confirmation here: seen_us says which
                # it read. This gateway's requests reach Redis in the order they were stamped.)
                admitted.popleft()
            since = [a.item for a in admitted if a.item.priority <= priority and not a.over]
            calibration = self.calibration(key) if self.settings.admission_target > 0 else None
            headroom = calibration.headroom if calibration else self.settings.admission_headroom
            candidate = Candidate(rows, priority, plan_budget, length, stated_budget_s=budget)
            refusal = admit(load, model, candidate, arrived_us / 1e6, since, headroom,
                            self._retries_at.get((*key, priority), 0.0))
            if refusal is not None:
                if refusal.retry_after_s is not None:
                    self._retries_at[(*key, priority)] = (arrived_us / 1e6 + refusal.retry_after_s
                                                          + retry_spacing_s(load, rows * max(1, length), self.gateways))
                reason = "deadline" if isinstance(refusal, DeadlineExceeded) else "overload"
                metrics.REJECTED.labels(model.name, model.version, reason).inc()
                raise refusal
        enqueued = now_us()
        deadline = enqueued + int(plan_budget * 1e6)
        request_id = uuid.uuid4().hex
        # The queue entry carries the gateway's ModelInfer span (or, with
        # tracing off, a child of the client's traceparent) to the others.
        traced = telemetry.enabled()
        span_parent = span_state = ""
        if traced:
            span = telemetry.current_span()
            span.set_attribute("batchline.model_version", model.version)
            span.set_attribute("batchline.request_id", request_id)
            span_parent, span_state = telemetry.inject(span)
        entry = pb.QueueEntry(
            request_id=request_id,
            gateway_id=self.gateway_id,
            model_version=model.version,
            rows=rows,
            length=length,
            deadline_us=deadline,
            enqueued_us=enqueued,
            priority=priority,
            traceparent=span_parent or tracecontext.child(traceparent),
            tracestate=span_state if span_parent else (tracestate if tracecontext.parse(traceparent) else ""),
        )
        member = entry.SerializeToString()
        queue = contract.queue(model.name, model.version)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._pending[request_id] = fut
        mine = None
        if admitted is not None:
            mine = _Admitted(Pending(request_id, rows, priority, deadline / 1e6, float("-inf"), length=length), enqueued)
            admitted.append(mine)
        try:
            write = _Write(request_id, request.SerializeToString(), contract.payload_ttl_ms(deadline, enqueued), queue,
                           contract.notify(model.name, model.version), member, contract.queue_score(priority, deadline),
                           model.max_queue_size, loop.create_future(), deadline)
            self._linger.arrived(enqueued / 1e6)
            self._outbox.append(write)
            if self._lingering is not None and loop.time() + plan_budget / 10 < self._linger_until:
                # A waiting commit must not spend more than a tenth of this budget: it goes now.
                _end_wait(self._lingering)
            if self._flusher is None or self._flusher.done():
                self._flusher = loop.create_task(self._flush())
            if traced:
                with telemetry.tracer("batchline.gateway").start_as_current_span("enqueue"):
                    await write.done
            else:
                await write.done
            if mine is not None:
                mine.confirmed_us = now_us()
            try:
                reply: pb.Reply = await asyncio.wait_for(fut, timeout=max(0.0, enqueued / 1e6 + budget - time.time()))
            except asyncio.TimeoutError:
                raise DeadlineExceeded(
                    f"no answer from model '{model.name}' within the {duration_text(budget)} budget"
                ) from None
        except BaseException:
            # Timed out, cancelled by the client, refused, or Redis failed: make
            # sure no executor spends time on a request nobody waits for.
            if calibration and now_us() >= deadline:
                # Unanswered at its deadline, whether our timer or the client's (a cancellation) fired first.
                calibration.observe(in_time=False)
            self._pending.pop(request_id, None)
            if fut.done() and not fut.cancelled():
                fut.exception()  # failed by an outage while we were still queueing: already answered
            self._abandon(queue, member, request_id)
            raise
        finally:
            if mine is not None:
                mine.over = True
        error = from_status_value(reply.code, reply.message) if reply.code != 0 else None
        if calibration and (error is None or isinstance(error, DeadlineExceeded)):
            # In time: answered with room left for the way back (shed or not run: not in time).
            calibration.observe(in_time=error is None and now_us() - arrived_us <= plan_budget * 1e6)
        if error is not None:
            raise error
        return reply.response

    def calibration(self, key: tuple[str, str]) -> Calibration:
        """Admission's learned headroom for a model (name, version)."""
        calibration = self._calibrations.get(key)
        if calibration is None:
            calibration = self._calibrations[key] = Calibration(
                self.settings.admission_target, self.settings.admission_headroom)
            metrics.ADMISSION_HEADROOM.labels(*key).set_function(lambda: calibration.headroom)
        return calibration

    async def _flush(self) -> None:
        """Group commit: write everything queued for Redis in one command, until nothing is left."""
        while self._outbox or self._abandoned:
            if self._outbox:
                wait = self._linger.wait_s(len(self._pending))
                if wait:
                    await self._wait_for_company(wait)
            writes, self._outbox = self._outbox, []
            abandoned, self._abandoned = self._abandoned, []
            keys: list = [contract.gateway(self.gateway_id)]
            args: list = [len(writes), len(abandoned), self.address, self._heartbeat_ttl_ms, contract.QUEUE_TTL]
            for w in writes:
                keys += (contract.payload(w.request_id), w.queue, w.notify)
                args += (w.payload, w.payload_ttl_ms, w.score, w.member, w.max_queue_size)
            for queue, member, request_id in abandoned:
                keys += (queue, contract.payload(request_id))
                args.append(member)
            try:
                async with metrics.redis_rtt("gateway", "enqueue"):
                    queued = await self.redis.eval(contract.ENQUEUE_LUA, len(keys), *keys, *args)
            except Exception as exc:  # noqa: BLE001 - every writer must hear how its write ended
                if isinstance(exc, REDIS_ERRORS):
                    error: BatchlineError = Unavailable(f"cannot queue the request: Redis is unreachable ({exc})")
                elif isinstance(exc, REDIS_REFUSALS):
                    # Out of memory (maxmemory) or a replica mid-failover: the server's state, and passing.
                    error = Unavailable(f"cannot queue the request: Redis refuses writes right now ({exc}): retry")
                else:
                    error = Internal(f"cannot queue the request: {exc}")
                if not isinstance(exc, REDIS_ERRORS + REDIS_REFUSALS):
                    log.exception("group commit failed")
                for w in writes:
                    if not w.done.done():
                        w.done.set_exception(error)
                continue
            for w, ok in zip(writes, queued):
                if w.done.done():
                    continue
                if not ok:
                    metrics.REJECTED.labels(w.queue.split(":")[2], w.queue.split(":")[3], "queue_full").inc()
                    w.done.set_exception(ResourceExhausted(
                        f"the queue of model '{w.queue.split(':')[2]}' is full ({w.max_queue_size} requests, its "
                        "max_queue_size): retry later", retry_after_s=0.1))
                else:
                    w.done.set_result(None)

    async def _wait_for_company(self, wait: float) -> None:
        """Let more requests join the next commit for `wait` s, or a tenth of the tightest waiting
        budget; a request whose budget is tighter still cuts the wait short (see `infer`)."""
        tightest_s = (min(w.deadline_us for w in self._outbox) - now_us()) / 1e6
        wait = min(wait, tightest_s / 10)
        if wait <= 0:
            return
        loop = asyncio.get_running_loop()
        self._lingering = loop.create_future()
        self._linger_until = loop.time() + wait
        timer = loop.call_later(wait, _end_wait, self._lingering)
        try:
            await self._lingering
        finally:
            timer.cancel()
            self._lingering = None

    def _abandon(self, queue: str, member: bytes, request_id: str) -> None:
        # Written with the next group commit; if Redis is gone the keys expire on their own.
        self._abandoned.append((queue, member, request_id))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush())

    # -- metadata and statistics ------------------------------------------

    async def ready(self) -> bool:
        """Ready when Redis answers and at least one live executor serves a model."""
        try:
            if not self.registry.models:
                await self.refresh_registry()
            else:
                await self.redis.ping()
        except REDIS_ERRORS:
            return False
        return bool(self.registry.models)

    async def model_ready(self, name: str, version: str) -> bool:
        try:
            await self.model(name, version)
        except (NotFound, Unavailable):
            return False
        return True

    async def statistics(self, name: str, version: str) -> list[tuple[pb.ModelInfo, dict[str, int]]]:
        if name:
            first = await self.model(name, version)
            # Like Triton: no version means every served version.
            versions = [version] if version else self.registry.versions(name)
            models = [first] if version else [self.registry.models[(name, v)] for v in versions]
        else:
            await self._refresh_or_unavailable()
            models = [self.registry.models[k] for k in sorted(self.registry.models)]
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for m in models:
                    pipe.hgetall(contract.stats(m.name, m.version))
                raw = await pipe.execute()
        except REDIS_ERRORS as exc:
            raise Unavailable(f"Redis is unreachable: {exc}") from None
        return [(m, {k.decode(): int(v) for k, v in h.items()}) for m, h in zip(models, raw)]

