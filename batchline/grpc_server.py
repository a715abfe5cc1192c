"""gRPC server bootstrap shared by the services: health and reflection on every one."""
from __future__ import annotations

import asyncio
import logging
from typing import Callable, Iterable

import grpc
from grpc._cython import cygrpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from batchline import metrics, ports, undecodable
from batchline.protocol._pool import POOL
from batchline.redis_client import REDIS_ERRORS

log = logging.getLogger(__name__)


class _AnswerAfterTheEnd(logging.Filter):
    """grpc.aio logs an ERROR with a traceback when a handler's answer finds its call already over
    (the client's deadline passed, or it cancelled, while the answer was on its way: seen under
    overload). The client has its status by then and nothing is lost: a DEBUG line, not an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, cygrpc.ExecuteBatchError):
            log.debug("an answer found its call already over: %s", record.getMessage())
            return False
        return True


logging.getLogger("grpc._cython.cygrpc").addFilter(_AnswerAfterTheEnd())


# The health service name for liveness probes: SERVING while the process answers, whatever Redis
# does. Readiness ("" and each service) follows Redis; a liveness probe on it would restart every pod
# of the mesh during a Redis outage, which the services ride out by themselves.
LIVENESS = "liveness"
# How often watch_redis looks while Redis does not answer.
DOWN_INTERVAL_S = 0.1


class ServerHandle:
    def __init__(self, server: grpc.aio.Server, port: int, health_servicer: health.aio.HealthServicer,
                 services: list[str]):
        self.server = server
        self.port = port
        self.health = health_servicer
        self.services = services
        self.draining = False  # set at shutdown: NOT_SERVING from then on, whatever Redis does

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.services]:
            await self.health.set(name, status)

    async def watch_redis(
        self,
        store,
        interval: float = 0.5,
        on_change: Callable[[bool], None] | None = None,
        on_restart: Callable[[], None] | None = None,
    ) -> None:
        """Report NOT_SERVING while Redis does not answer (a service without Redis can do nothing useful).

        Run as a task for the service's lifetime; `on_change(up)` is told of each
        transition after the first check (whose verdict is no change), `on_restart()` when Redis came back as a new
        process (its run_id changed: whatever it held is gone), even if no check saw it down.
        """
        up: bool | None = None
        run_id = None
        # Every run id answered so far. Only one never seen before is a new primary: just after a
        # Sentinel failover a connection kept to the demoted primary (now resyncing as a replica)
        # can still answer once, and reconciling against it would fail requests the new one holds.
        seen: set[str | None] = set()
        while True:
            try:
                current = await store.run_id()
                now_up = True
                if run_id is not None and current not in seen:
                    log.warning("Redis answers from a new primary (run_id %s -> %s): a failover or a restart",
                                run_id, current)
                    metrics.REDIS_FAILOVERS.inc()
                    if on_restart:
                        on_restart()
                run_id = current
                seen.add(current)
            except REDIS_ERRORS:
                now_up = False
            if now_up != up:
                changed = up is not None  # the first check's verdict is no change
                if changed:
                    log.warning("Redis %s", "is reachable again: serving" if now_up else "is unreachable: NOT_SERVING")
                up = now_up
                await self.set_serving(up and not self.draining)
                if on_change and changed:
                    on_change(up)
            # While Redis is away, look more often: what the services do when it is back (the
            # scheduler's look at every queue, the gateway's reconciling) waits on this check.
            await asyncio.sleep(interval if up else min(interval, DOWN_INTERVAL_S))

    async def start_draining(self) -> None:
        self.draining = True
        await self.set_serving(False)

    async def stop(self, grace: float | None) -> None:
        await self.health.enter_graceful_shutdown()
        try:
            # Calls still running after `grace` are cancelled; never wait on them forever.
            await asyncio.wait_for(self.server.stop(grace), (grace or 0) + 5)
        except asyncio.TimeoutError:
            log.warning("gRPC server did not stop within %.1f s of its grace period", 5.0)


async def start_server(
    host: str,
    port: int,
    register: Callable[[grpc.aio.Server], Iterable[str]],
    options: list[tuple[str, int]] | None = None,
    credentials: grpc.ServerCredentials | None = None,
) -> ServerHandle:
    """Start a grpc.aio server on host:port (0 = any free port) with health and reflection.

    `register` adds the service's servicers and returns their full service names. With
    `credentials` the port serves TLS only (health and reflection too).
    """
    server = grpc.aio.server(options=options or [])
    guarded = undecodable.guard(server)  # bytes that are no valid message: INVALID_ARGUMENT, on every method
    services = list(register(guarded))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, guarded)
    # Our stubs live in batchline's own descriptor pool, so reflection must be
    # pointed at it; it then describes exactly the services batchline defines.
    # (reflection's enable_server_reflection would take the guard for a synchronous server).
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
        reflection.aio.ReflectionServicer([*services, reflection.SERVICE_NAME], pool=POOL), guarded)
    target = f"{host}:{port}"
    try:
        bound = server.add_secure_port(target, credentials) if credentials else server.add_insecure_port(target)
    except RuntimeError:  # grpc's "Failed to bind"
        bound = 0
    if bound == 0:
        if port and ports.in_use(host, port):
            raise ports.PortInUse(port)
        raise OSError(f"cannot bind gRPC server to {host}:{port}")
    await server.start()
    handle = ServerHandle(server, bound, health_servicer, services)
    await handle.set_serving(False)
    await health_servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    return handle
