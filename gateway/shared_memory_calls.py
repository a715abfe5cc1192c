"""The shared-memory extension's calls, as InferenceServicer serves them: system regions are this
gateway's (gateway/shared_memory.py); CUDA regions are refused, and with none ever registered
their status is empty and unregistering them does nothing (clients unregister all at start)."""
from __future__ import annotations

from batchline.errors import BatchlineError, Unimplemented
from batchline.protocol import inference_pb2 as ipb

CUDA_REFUSAL = ("CUDA shared memory is not supported: batchline's gateway hands tensors to executors that may run "
                "on other hosts; use system shared memory (SystemSharedMemoryRegister) or send the data in the request")


def _tenant(grant) -> str:
    """Whose regions a call sees: its token's tenant ('' on a gateway without tokens)."""
    return grant.tenant if grant is not None else ""


class SharedMemoryCalls:
    """Mixed into InferenceServicer, whose _allow and _abort_with these use."""

    async def SystemSharedMemoryStatus(self, request, context):
        grant = await self._allow(context)
        try:
            regions = self.gateway.shared_memory.status(request.name, _tenant(grant))
        except BatchlineError as exc:
            await self._abort_with(context, exc)
        status = ipb.SystemSharedMemoryStatusResponse.RegionStatus
        return ipb.SystemSharedMemoryStatusResponse(regions={
            r.name: status(name=r.name, key=r.key, offset=r.offset, byte_size=r.byte_size) for r in regions})

    async def SystemSharedMemoryRegister(self, request, context):
        grant = await self._allow(context)
        try:
            self.gateway.shared_memory.register(request.name, request.key, request.offset, request.byte_size,
                                                _tenant(grant))
        except BatchlineError as exc:
            await self._abort_with(context, exc)
        return ipb.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request, context):
        grant = await self._allow(context)
        self.gateway.shared_memory.unregister(request.name, _tenant(grant))
        return ipb.SystemSharedMemoryUnregisterResponse()

    async def CudaSharedMemoryStatus(self, request, context):
        await self._allow(context)
        if request.name:
            await self._abort_with(context,
                                   Unimplemented(f"no CUDA shared memory region '{request.name}': {CUDA_REFUSAL}"))
        return ipb.CudaSharedMemoryStatusResponse()

    async def CudaSharedMemoryRegister(self, request, context):
        await self._allow(context)
        await self._abort_with(context, Unimplemented(f"CUDA shared memory region '{request.name}': {CUDA_REFUSAL}"))

    async def CudaSharedMemoryUnregister(self, request, context):
        await self._allow(context)
        return ipb.CudaSharedMemoryUnregisterResponse()
