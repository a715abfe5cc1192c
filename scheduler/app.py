"""Wiring of the scheduler service: gRPC control server and the scheduling loop."""
from __future__ import annotations

import asyncio

from batchline import metrics
from batchline.lifecycle import stop_tasks
from batchline.grpc_server import ServerHandle, start_server
from batchline.protocol import internal_pb2, internal_pb2_grpc
from scheduler.service import Scheduler, SchedulerControl
from scheduler.settings import SchedulerSettings


class SchedulerApp:
    def __init__(self, settings: SchedulerSettings):
        self.settings = settings
        self.scheduler = Scheduler(settings)
        self.server: ServerHandle | None = None
        self._health: asyncio.Task | None = None
        self.metrics_port = -1

    @property
    def port(self) -> int:
        return self.server.port

    async def start(self) -> "SchedulerApp":
        def register(server):
            internal_pb2_grpc.add_SchedulerServicer_to_server(SchedulerControl(self.scheduler), server)
            return [internal_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name]

        self.metrics_port = metrics.start_metrics_server(self.settings.host, self.settings.metrics_port)
        self.server = await start_server(self.settings.host, self.settings.port, register)
        await self.scheduler.start()
        wakeups, heartbeats = self.scheduler.wakeups, self.scheduler.fleet.heartbeats

        def on_change(up: bool) -> None:
            heartbeats.redis_trouble()
            if up:
                wakeups.after_outage()

        # A new primary is Redis back, as far as the scheduler is concerned.
        self._health = asyncio.create_task(self.server.watch_redis(
            self.scheduler.store, on_change=on_change, on_restart=lambda: on_change(True)))
        return self

    async def stop(self, grace: float = 2.0) -> None:
        await self.server.start_draining()
        if self._health:
            await stop_tasks([self._health])
        await self.scheduler.stop()  # gives the lease up: a standby takes over at once
        await self.server.stop(grace)
        metrics.stop_metrics_server(self.metrics_port)
