"""What the gateway does, in domain terms: admit, queue, await, answer.

The gRPC servicer converts protobuf and status codes; everything else lives
here. A request is validated against the model's metadata, stamped with its
deadline and priority, written to Redis in one pipelined round trip (payload
+ queue entry + scheduler wake-up), and answered when its Reply arrives on
this gateway's reply list.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid


from batchline import contract, tracecontext
from batchline.clock import now_us
from batchline.errors import DeadlineExceeded, NotFound, Unavailable, from_status_value
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import internal_pb2 as pb
from batchline.redis_client import REDIS_ERRORS, connect, connect_blocking
from batchline.registry import Registry
from gateway.settings import GatewaySettings
from gateway.validation import request_priority, request_timeout_us, validate

log = logging.getLogger(__name__)

_DRAIN = 10_000
SERVER_NAME = "batchline"
SERVER_VERSION = "0.1.0"
EXTENSIONS = ["statistics"]
# Budgets are capped so that an absurd `timeout` (Triton's is a 64-bit µs
# count) cannot overflow a deadline; nothing is served after a day anyway.
MAX_BUDGET_S = 24 * 3600.0


def _ms(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} µs" if seconds < 1e-3 else f"{seconds * 1e3:.0f} ms"


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
        ]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(Unavailable("the gateway is shutting down"))
        try:
            await self.redis.delete(contract.gateway(self.gateway_id))
        except REDIS_ERRORS:
            pass
        await self.redis.aclose()
        await self.blocking.aclose()

    # -- background --------------------------------------------------------

    async def refresh_registry(self) -> None:
        self.registry = await Registry.load(self.redis)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.registry_refresh_s)
            try:
                await self.refresh_registry()
            except REDIS_ERRORS as exc:
                log.warning("registry refresh failed: %s", exc)

    async def _heartbeat(self) -> None:
        ttl_ms = int(self.settings.heartbeat_interval_s * 3000)
        while True:
            try:
                await self.redis.set(contract.gateway(self.gateway_id), self.address, px=ttl_ms)
            except REDIS_ERRORS as exc:
                log.warning("heartbeat failed: %s", exc)
            await asyncio.sleep(self.settings.heartbeat_interval_s)

    async def _read_replies(self) -> None:
        key = contract.reply(self.gateway_id)
        while True:
            try:
                first = await self.blocking.blpop([key], timeout=1)
                if first is None:
                    continue
                rest = await self.redis.lpop(key, _DRAIN) or []
            except REDIS_ERRORS as exc:
                log.warning("reading replies failed: %s", exc)
                await asyncio.sleep(0.2)
                continue
            for blob in [first[1], *rest]:
                reply = pb.Reply.FromString(blob)
                fut = self._pending.pop(reply.request_id, None)
                # A second answer to the same request (a batch re-dispatched
                # while the first executor was only slow) finds no future.
                if fut is not None and not fut.done():
                    fut.set_result(reply)

    # -- requests ----------------------------------------------------------

    async def model(self, name: str, version: str = "") -> pb.ModelInfo:
        try:
            return self.registry.resolve(name, version)
        except NotFound:
            # An executor may have registered since the last refresh.
            await self._refresh_or_unavailable()
            return self.registry.resolve(name, version)

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
        priority = request_priority(request, model)
        budget = self.budget_s(request, model, grpc_remaining)
        if budget <= 0:
            raise DeadlineExceeded(f"the request's deadline had already passed when it reached the gateway (budget {_ms(budget)})")
        enqueued = now_us()
        deadline = enqueued + int(budget * 1e6)
        request_id = uuid.uuid4().hex
        entry = pb.QueueEntry(
            request_id=request_id,
            gateway_id=self.gateway_id,
            model_version=model.version,
            rows=rows,
            deadline_us=deadline,
            enqueued_us=enqueued,
            priority=priority,
            # Continues the client's trace when it sent one.
            traceparent=tracecontext.child(traceparent),
            tracestate=tracestate if tracecontext.parse(traceparent) else "",
        )
        member = entry.SerializeToString()
        queue = contract.queue(model.name, model.version)
        fut = asyncio.get_running_loop().create_future()
        self._pending[request_id] = fut
        try:
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.set(contract.payload(request_id), request.SerializeToString(), px=contract.payload_ttl_ms(deadline, enqueued))
                    pipe.zadd(queue, {member: contract.queue_score(priority, deadline)})
                    pipe.expire(queue, contract.QUEUE_TTL)
                    pipe.rpush(contract.NOTIFY, queue)
                    pipe.ltrim(contract.NOTIFY, -contract.NOTIFY_CAP, -1)
                    pipe.expire(contract.NOTIFY, contract.QUEUE_TTL)
                    await pipe.execute()
            except REDIS_ERRORS as exc:
                raise Unavailable(f"cannot queue the request: Redis is unreachable ({exc})") from None
            try:
                reply: pb.Reply = await asyncio.wait_for(fut, timeout=max(0.0, deadline / 1e6 - time.time()))
            except asyncio.TimeoutError:
                raise DeadlineExceeded(
                    f"no answer from model '{model.name}' within the {_ms(budget)} budget"
                ) from None
        except BaseException:
            # Timed out, cancelled by the client, or Redis failed: make sure no
            # executor spends time on a request nobody waits for.
            self._pending.pop(request_id, None)
            asyncio.get_running_loop().create_task(self._abandon(queue, member, request_id))
            raise
        if reply.code != 0:
            raise from_status_value(reply.code, reply.message)
        return reply.response

    async def _abandon(self, queue: str, member: bytes, request_id: str) -> None:
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.zrem(queue, member)
                pipe.delete(contract.payload(request_id))
                await pipe.execute()
        except REDIS_ERRORS:
            pass  # the keys expire on their own

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

