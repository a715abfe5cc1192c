"""What the gateway does, in domain terms: admit, queue, await, answer.

The gRPC servicer converts protobuf and status codes; everything else lives
here. A request is validated once into a Call (gateway/request.py), admitted
or refused by its predicted finish (gateway/ledger.py, gateway/admission.py),
written to Redis with the next group commit (gateway/commit.py), and
answered when its Reply arrives on this gateway's reply list.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import replace
from typing import Callable

from batchline import metrics, regions, telemetry
from batchline.contract.keys import ModelKey
from batchline.contract.gateway_store import GatewayStore
from batchline.clock import now_us
from batchline.errors import (DeadlineExceeded, InvalidArgument, ResourceExhausted, Unavailable, from_status_value)
from batchline.sequences import sequence_flags, sequence_key
from batchline.lifecycle import stop_tasks
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import internal_pb2 as pb
from batchline.redis_client import REDIS_ERRORS, connect, connect_blocking, unreachable
from batchline.sampling import sampling_params
from batchline.cluster import is_cluster_url
from batchline.sentinel import is_sentinel
from gateway.admission import Calibration
from gateway import classification, generation
from gateway.arrivals import Arrivals
from gateway.catalog import Catalog
from gateway.commit import GroupCommit
from gateway.fairness import FairShares
from gateway.ledger import AdmissionLedger, Ticket, usable
from gateway import presence
from gateway.queueing import Queueing
from gateway.replies import PartialSink, Replies
from gateway.sequences import SequenceOrder
from gateway.repository import RepositoryControl
from gateway.request import Call, parse
from gateway.settings import GatewaySettings
from gateway.shared_memory import SharedMemory
from gateway.text import TRUNCATED_KEY, Tokenizers
from gateway.validation import CheckedLayouts
from gateway.views import LoadViews

log = logging.getLogger(__name__)

SERVER_NAME = "batchline"
SERVER_VERSION = "0.1.0"
# Triton's extensions both protocols serve (each adds its own: gRPC shared memory, REST binary data).
EXTENSIONS = ["classification", "statistics", "model_configuration", "model_repository", "sequence"]
# How often drain() looks whether every admitted request has been answered.
DRAIN_POLL_S = 0.05


class Gateway:
    def __init__(self, settings: GatewaySettings):
        self.settings = settings
        self.gateway_id = settings.gateway_id or f"gw-{uuid.uuid4().hex[:12]}"
        self.store = GatewayStore(connect(settings.redis_url, settings.redis_timeout_s),
                                  connect_blocking(settings.redis_url, settings.redis_timeout_s))
        self.catalog = Catalog(self.store)  # the models served, from the executors' registrations
        self.address = ""
        self.replies = Replies(self.store, self.gateway_id)
        self._tasks: list[asyncio.Task] = []
        self.draining = False
        self._heartbeat_ttl_ms = presence.heartbeat_ttl_ms(settings.heartbeat_interval_s)
        self.commit = GroupCommit(self.store, self.gateway_id, self._heartbeat_ttl_ms, settings.commit_linger_ms / 1000,
                                  lambda: len(self.replies.waiting), settings.commit_max_group)
        self.views = LoadViews(self.store, lambda: sorted(self.catalog.registry.models), settings.load_refresh_s)
        self.ledger = AdmissionLedger(self.gateway_id, settings.admission_headroom, settings.admission_target)
        self.gateways = 1  # live gateways (from the heartbeats): each spaces only the refusals it gives itself
        self.repository = RepositoryControl(self.store, settings.model_control_mode, settings.load_files_max_bytes)
        self.fair = FairShares()  # tenants' shares of each model (tokens' weights)
        self.tokenizers = Tokenizers(self.store)  # of the models that take text
        # The regions clients registered with this gateway.
        self.shared_memory = SharedMemory(settings.max_message_bytes)
        # Behind Sentinel or on a cluster, a Redis (a shard's primary) lost is most likely replaced by a replica.
        self.replicated = is_sentinel(settings.redis_url) or is_cluster_url(settings.redis_url)
        self._reconciling: set[asyncio.Task] = set()
        self.arrivals = Arrivals(self.store)  # what the scheduler's demand forecast reads
        self.sequences = SequenceOrder()  # each sequence's requests, one after another
        self.queueing = Queueing(self.gateway_id, self.commit, self.replies, self.store)
        self.layouts = CheckedLayouts()  # of the requests found valid: one laid out alike is not checked again

    @property
    def loads(self) -> dict[ModelKey, pb.ModelLoad]:
        return self.views.loads

    def calibration(self, key: ModelKey) -> Calibration | None:
        """Admission's learned headroom for a model (name, version); None unless it learns."""
        return self.ledger.calibration(key)

    async def start(self, address: str) -> None:
        self.address = self.commit.address = address
        try:
            await self.catalog.refresh()
        except REDIS_ERRORS as exc:
            log.warning("Redis not reachable at start (%s); will keep trying", exc)
        self._tasks = [
            asyncio.create_task(self.replies.read(), name="replies"),
            asyncio.create_task(self._refresh_loop(), name="registry"),
            asyncio.create_task(self._heartbeat(), name="heartbeat"),
            asyncio.create_task(self.arrivals.run(), name="arrivals"),
        ]
        if self.settings.admission_control:
            self._tasks.append(asyncio.create_task(self.views.keep_fresh(), name="load"))

    async def drain(self, timeout: float) -> None:
        """Refuse new requests; wait (up to `timeout`) for the admitted ones to be answered."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.replies.waiting and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if self.replies.waiting:
            log.warning("drain: %d requests still unanswered after %.1f s; answering them UNAVAILABLE",
                        len(self.replies.waiting), timeout)

    def give_up(self) -> None:
        """Answer whatever is still waiting (for its reply, or to be queued) UNAVAILABLE: shutting down."""
        error = Unavailable("the gateway is shutting down; the request may or may not have run")
        self.replies.fail(error)
        self.commit.fail(error)

    async def stop(self) -> None:
        await stop_tasks(self._tasks)
        # Sequence turns held for requests given up on: nothing follows them once the gateway stops.
        await stop_tasks([*self.queueing.settling, *self.sequences.releasing])
        self.give_up()
        self.shared_memory.close()
        try:
            await self.arrivals.flush()
            await self.store.leave(self.gateway_id)
        except REDIS_ERRORS:
            pass
        await self.store.aclose()

    # -- background --------------------------------------------------------

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.registry_refresh_s)
            try:
                await self.catalog.refresh()
            except REDIS_ERRORS as exc:
                log.warning("registry refresh failed: %s", exc)
            except Exception:  # a background loop must outlive what Redis answers
                log.exception("registry refresh failed")

    async def _heartbeat(self) -> None:
        while True:
            try:
                self.gateways = await self.store.beat(self.gateway_id, self.address, self._heartbeat_ttl_ms)
            except REDIS_ERRORS as exc:
                log.warning("heartbeat failed: %s", exc)
            except Exception:  # e.g. Redis out of memory: beat again later
                log.exception("heartbeat failed")
            await asyncio.sleep(self.settings.heartbeat_interval_s)

    def on_redis(self, up: bool) -> None:
        # Behind Sentinel or on a cluster an outage is most likely a failover, and what the promoted
        # replica holds is still served (on_redis_restart finds what it lacks). A lone Redis that
        # went away may not come back with anything.
        if not up and not self.replicated:
            self.replies.fail(Unavailable(
                "lost contact with Redis while the request was queued; it may or may not have run: retry"
            ))

    def on_redis_restart(self) -> None:
        """Redis answers from a new primary (a failover, or a restart): answer at once the queued
        requests it lost; the rest are served."""
        task = asyncio.create_task(self._reconcile(), name="reconcile")
        self._reconciling.add(task)
        task.add_done_callback(self._reconciling.discard)

    async def _reconcile(self) -> None:
        lost = await self.replies.reconcile(Unavailable(
            "Redis changed primary (a failover or a restart) and the new one lacks this queued request; "
            "it may or may not have run: retry"))
        metrics.FAILOVER_LOST.inc(lost)
        if lost:
            log.warning("the new Redis primary lacks %d queued requests: answered UNAVAILABLE", lost)

    # -- requests ----------------------------------------------------------

    async def take_rate(self, tenant: str, max_rate: float, model: str) -> None:
        """Let one more request of `tenant` through its `max_rate` cap, shared with every gateway
        (a token bucket in Redis, one second's worth deep), or refuse it with when to come back."""
        try:
            taken, wait_ms = await self.store.take_token(tenant, max_rate, max(1.0, max_rate))
        except REDIS_ERRORS as exc:
            raise Unavailable(unreachable(exc)) from None
        if not taken:
            metrics.REJECTED.labels(*self.catalog.labels(model), "rate").inc()
            raise ResourceExhausted(f"tenant '{tenant}' is over its rate of {max_rate:g} requests/s: "
                                    f"retry in {wait_ms} ms", retry_after_s=wait_ms / 1000)

    async def infer(
        self,
        request: ipb.ModelInferRequest,
        grpc_remaining: float | None,
        traceparent: str = "",
        tracestate: str = "",
        tenant: str = "",
        weight: float = 1.0,
        on_partial: PartialSink | None = None,
        visible: Callable[[str], bool] | None = None,
    ) -> ipb.ModelInferResponse | None:
        """The request's answer. A decoupled model's responses go to `on_partial` as they arrive
        and the answer is None, unless its last response came with the end. `visible`: the model
        names a refusal may list (the caller's scope)."""
        started = time.perf_counter()
        model = await self.catalog.model(request.model_name, request.model_version, visible)
        collected: list[ipb.ModelInferResponse] | None = None
        if model.generation and on_partial is None:
            collected = []  # a generative model's tokens, answered joined
            on_partial = collected.append
        call, targets, classes = await self._parse(request, model, grpc_remaining, tenant, on_partial is not None)
        if self.draining:
            raise Unavailable("this gateway is shutting down: retry on another instance")
        arrived_us = now_us()
        call, ticket = self._admit(call, model, tenant, weight, arrived_us)
        flags = sequence_flags(call.request) if model.HasField("sequence") else None
        if flags is not None and tenant:
            call = replace(call, tenant=tenant)
        queued = self.queueing
        try:
            if flags is None:
                reply = await queued.queue_and_wait(call, ticket, traceparent, tracestate, started, on_partial)
                if reply.region_unreadable and call.copied is not None:
                    reply = await queued.copied_and_queued(call, ticket, traceparent, tracestate, started)
            else:
                async with self.sequences.turn(model.name, model.version, sequence_key(flags, tenant)) as turn:
                    reply = await queued.queue_and_wait(call, ticket, traceparent, tracestate, started, on_partial,
                                                        turn)
        except BaseException:
            if ticket is not None:
                ticket.over()
            raise
        error = from_status_value(reply.code, reply.message) if reply.code != 0 else None
        if ticket is not None:
            # In time: answered with room left for the way back (shed or not run: not in time).
            judged = error is None or isinstance(error, DeadlineExceeded)
            ticket.over(error is None and now_us() - arrived_us <= call.run_budget_s * 1e6 if judged else None)
        if error is not None:
            raise error
        response = reply.response if reply.HasField("response") else None
        if collected is not None:
            response = generation.joined(collected + ([response] if response is not None else []), model, request.id)
        if response is not None and call.truncated:
            response.parameters[TRUNCATED_KEY].int64_param = call.truncated
        if response is not None and classes:
            classification.classify(response, model, classes)
        if response is not None and targets:
            self.shared_memory.write_outputs(response, targets)
        return response

    def _placed(self, model: pb.ModelInfo) -> list[pb.ModelInfo]:
        """The model as each executor serving it registered it (its load and learned costs there)."""
        registry = self.catalog.registry
        return [m for e in registry.holders.get((model.name, model.version), [])
                for m in registry.executors[e].models if (m.name, m.version) == (model.name, model.version)]

    async def _parse(self, request: ipb.ModelInferRequest, model: pb.ModelInfo, grpc_remaining: float | None,
                     tenant: str, streamed: bool) -> tuple[Call, dict, dict]:
        """The request checked and converted for the queue (text tokenized, inputs read from shared
        memory), counted as an arrival; with the outputs it wants in shared memory and as classes."""
        if model.decoupled and not streamed:
            raise InvalidArgument(f"ModelInfer RPC doesn't support models with decoupled transaction policy: model "
                                  f"'{model.name}' answers with any number of responses; call ModelStreamInfer")
        truncated = 0
        if model.text.name:
            request, truncated = await self.tokenizers.convert(request, model)
        # Triton's extensions that change a request's tensors on their way in and out.
        targets = self.shared_memory.output_targets(request, tenant)
        classes = classification.requested(request, model)
        if model.decoupled and (targets or classes):
            # Its responses go to the stream as they come, past the answer these would rewrite.
            raise InvalidArgument(f"model '{model.name}' is decoupled: its outputs cannot be asked for in shared "
                                  f"memory or as classifications; ask for them in the responses")
        regions = self.shared_memory.in_regions(request)
        by_reference = not classes and (bool(targets) or regions) and self._local(model)
        request, payload, copied = self.shared_memory.read_inputs(request, tenant, targets, by_reference, regions)
        call = parse(request, model, grpc_remaining, self.settings.answer_margin_ms / 1000, payload, self.layouts)
        if copied is not None:
            call = replace(call, copied=copied)
        if truncated:
            call = replace(call, truncated=truncated)
        if model.generation:
            sampling_params(call.request, "")  # a bad one refused here, not after it was queued
            generation.admit(call.request, model, self._placed(model))
        self.arrivals.count(call.key)
        return call, targets, classes

    def _local(self, model: pb.ModelInfo) -> bool:
        """Whether every executor serving `model` shares this gateway's /dev/shm (batchline/regions.py),
        so that regions go to them by reference. A generative, decoupled or stateful model's
        requests take paths of their own on the executor: their tensors are always copied."""
        host = regions.host_id()
        if not host or not self.settings.shared_memory_by_reference:
            return False
        if model.generation or model.decoupled or model.HasField("sequence"):
            return False
        registry = self.catalog.registry
        holders = registry.holders.get((model.name, model.version))
        return bool(holders) and all(registry.executors[e].host == host for e in holders)

    def _admit(self, call: Call, model: pb.ModelInfo, tenant: str, weight: float,
               arrived_us: int) -> tuple[Call, Ticket | None]:
        """The call at its tenant's fair priority, and admission's ticket (None: admission did not
        judge it); raises ResourceExhausted for a call that cannot be served within its budget."""
        asked = call.priority
        # Shares of the work, not of the rows: a row of 512 tokens costs the executor 32 of 16.
        units = call.rows * max(1, call.length)
        if tenant:
            call = replace(call, priority=self.fair.level(call.key, tenant, weight, asked, units, arrived_us / 1e6))
            if call.priority != asked:
                metrics.TENANT_OVER_SHARE.labels(model.name, tenant).inc()
            if telemetry.enabled():
                telemetry.current_span().set_attribute("batchline.tenant", tenant)
        ticket = None
        load = self.views.get(call.key, call.budget_s) if self.settings.admission_control else None
        if usable(load, arrived_us):
            try:
                ticket = self.ledger.check(load, call, arrived_us, self.gateways)
            except ResourceExhausted as exc:
                if call.priority == asked:
                    raise
                raise ResourceExhausted(f"tenant '{tenant}' is over its weighted share of model '{model.name}', "
                                        f"and {exc}",
                                        retry_after_s=exc.retry_after_s) from None
        if tenant:
            self.fair.admitted(call.key, tenant, units, arrived_us / 1e6)
        return call, ticket

    # -- the model repository ---------------------------------------------

    async def load_model(self, name: str, parameters: dict, timeout_s: float | None) -> None:
        await self.repository.load(name, parameters, timeout_s)
        await self.catalog.refresh_or_unavailable()  # this gateway's next request finds it

    async def unload_model(self, name: str, timeout_s: float | None) -> None:
        await self.repository.unload(name, timeout_s)
        await self.catalog.refresh_or_unavailable()
