"""Wiring of the executor service: repository, gRPC control server, work loop."""
from __future__ import annotations

import asyncio
import logging

from batchline import metrics
from batchline.lifecycle import stop_tasks
from batchline.grpc_server import ServerHandle, start_server
from batchline.protocol import internal_pb2, internal_pb2_grpc
from executor.repository import load_repository
from executor.service import Executor, ExecutorControl
from executor.settings import ExecutorSettings

log = logging.getLogger(__name__)


class ExecutorApp:
    def __init__(self, settings: ExecutorSettings):
        self.settings = settings
        self.executor: Executor | None = None
        self.server: ServerHandle | None = None
        self._health: asyncio.Task | None = None
        self.metrics_port = -1

    @property
    def port(self) -> int:
        return self.server.port

    async def start(self) -> "ExecutorApp":
        s = self.settings
        models = await asyncio.to_thread(
            load_repository, s.model_repository, s.models or None, s.providers, s.trt_engine_cache_dir, s.intra_op_threads,
            s.allow_spinning,
        )
        self.executor = Executor(s, models)
        if s.warmup:
            await asyncio.to_thread(self.executor.warmup)

        def register(server):
            internal_pb2_grpc.add_ExecutorServicer_to_server(ExecutorControl(self.executor), server)
            return [internal_pb2.DESCRIPTOR.services_by_name["Executor"].full_name]

        self.metrics_port = metrics.start_metrics_server(self.settings.host, self.settings.metrics_port)
        self.server = await start_server(s.host, s.port, register)
        await self.executor.start(f"{s.host}:{self.server.port}")
        self._health = asyncio.create_task(self.server.watch_redis(self.executor.redis))
        return self

    async def stop(self, grace: float = 2.0) -> None:
        """Drain (finish or hand back the batches sent here), then deregister and stop."""
        if self.server:
            await self.server.start_draining()
        if self._health:
            await stop_tasks([self._health])
        if self.executor:
            await self.executor.drain(self.settings.drain_timeout_s)
            await self.executor.stop()
        if self.server:
            await self.server.stop(grace)
        metrics.stop_metrics_server(self.metrics_port)
