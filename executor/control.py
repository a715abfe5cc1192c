"""The executor process's gRPC status service."""
from __future__ import annotations

from batchline.protocol import internal_pb2_grpc
from executor.service import Executor


class ExecutorControl(internal_pb2_grpc.ExecutorServicer):
    """The process's status: its first lane's (which holds every model), with the batch counts of all lanes."""

    def __init__(self, lanes: list[Executor]):
        self.lanes = lanes

    async def Status(self, request, context):
        info = self.lanes[0].info()
        info.busy_batches = sum(lane.busy_batches for lane in self.lanes)
        info.executed_batches = sum(lane.executed_batches for lane in self.lanes)
        return info
