"""Wiring of the scheduler service: gRPC control server and the scheduling loop."""
from __future__ import annotations

from batchline.grpc_server import ServerHandle, start_server
from batchline.protocol import internal_pb2, internal_pb2_grpc
from scheduler.service import Scheduler, SchedulerControl
from scheduler.settings import SchedulerSettings


class SchedulerApp:
    def __init__(self, settings: SchedulerSettings):
        self.settings = settings
        self.scheduler = Scheduler(settings)
        self.server: ServerHandle | None = None

    @property
    def port(self) -> int:
        return self.server.port

    async def start(self) -> "SchedulerApp":
        def register(server):
            internal_pb2_grpc.add_SchedulerServicer_to_server(SchedulerControl(self.scheduler), server)
            return [internal_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name]

        self.server = await start_server(self.settings.host, self.settings.port, register)
        await self.scheduler.start()
        await self.server.set_serving(True)
        return self

    async def stop(self, grace: float = 2.0) -> None:
        await self.server.set_serving(False)
        await self.scheduler.stop()
        await self.server.stop(grace)
