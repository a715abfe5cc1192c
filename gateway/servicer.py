"""inference.GRPCInferenceService: protobuf and status codes in, Gateway calls out."""
from __future__ import annotations

import asyncio
import functools
import logging

import grpc

from batchline.errors import RETRY_AFTER_KEY, BatchlineError, InvalidArgument, ResourceExhausted, grpc_status
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import inference_pb2_grpc
from batchline.auth import Grant, Tokens, visible
from batchline.sequences import sequence_flags
from batchline.undecodable import Undecodable, tolerated
from gateway.convert import inputs_of, model_config, model_statistics
from gateway import inference
from gateway.core import EXTENSIONS, SERVER_NAME, SERVER_VERSION, Gateway
from gateway.replies import PartialSink
from gateway.sequences import MAX_WAITING, WAITING_RETRY_S
from gateway.shared_memory_calls import SharedMemoryCalls
from gateway.stream_backlog import StreamBacklog

log = logging.getLogger(__name__)
# Triton's response parameter that tells a stream's client a request is over, and the request
# parameter by which a client asks for an empty last response when a decoupled model ends a
# request without one (docs/reference/protocol.md).
FINAL_KEY = "triton_final_response"
EMPTY_FINAL_KEY = "triton_enable_empty_final_response"


def _retry_after_ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


async def _abort(context: grpc.aio.ServicerContext, exc: BatchlineError):
    # Answer with the status even at the client's deadline: cancelling instead would
    # reach a client whose clock is a little behind as CANCELLED.
    if exc.retry_after_s is not None:
        context.set_trailing_metadata(((RETRY_AFTER_KEY, str(_retry_after_ms(exc.retry_after_s))),))
    try:
        await context.abort(grpc_status(exc), str(exc))
    except grpc.aio.InternalError:
        # The call ended (its deadline passed) before the status could go out: the client
        # has its DEADLINE_EXCEEDED already, and there is nothing left to send.
        raise asyncio.CancelledError() from None


def _sequence_of(request: ipb.ModelInferRequest) -> tuple[str, str, str] | None:
    """A stream's key for the sequence a request belongs to (None: it names none): its id as the
    sequence's key reads it (INT64 -1 and UINT64 2^64 - 1 are one sequence)."""
    if "sequence_id" not in request.parameters:
        return None
    try:
        key = sequence_flags(request).key
    except InvalidArgument:
        key = ""  # flags of the wrong type: the request's own checks refuse it
    return request.model_name, request.model_version, key


def _done_in(after: dict, behind: dict, sequence: tuple, task: asyncio.Task) -> None:
    if after.get(sequence) is task:
        del after[sequence]
    left = behind[sequence] - 1
    if left:
        behind[sequence] = left
    else:
        del behind[sequence]


def stream_error(request: ipb.ModelInferRequest, exc: BatchlineError) -> ipb.ModelStreamInferResponse:
    """A failed request's answer on a ModelStreamInfer stream, which goes on: the status name in
    brackets, the message, the request's id, and a refusal's retry-after hint as a parameter
    (a stream message has no trailing metadata of its own)."""
    answer = ipb.ModelInferResponse(id=request.id, model_name=request.model_name, model_version=request.model_version)
    if exc.retry_after_s is not None:
        answer.parameters[RETRY_AFTER_KEY].int64_param = _retry_after_ms(exc.retry_after_s)
    return ipb.ModelStreamInferResponse(error_message=f"[{grpc_status(exc).name}] {exc}", infer_response=answer)


def streamed(response: ipb.ModelInferResponse, final: bool) -> ipb.ModelStreamInferResponse:
    """A response on ModelStreamInfer, flagged whether it is its request's last, as Triton flags them."""
    response.parameters[FINAL_KEY].bool_param = final
    return ipb.ModelStreamInferResponse(infer_response=response)


def _param_true(request: ipb.ModelInferRequest, key: str) -> bool:
    return key in request.parameters and request.parameters[key].bool_param


class InferenceServicer(SharedMemoryCalls, inference_pb2_grpc.GRPCInferenceServiceServicer):
    """ServerLive and ServerReady are open, as probes; with `tokens`, every other call needs a token,
    and a model call one whose scope holds the model (statistics: an admin token)."""

    def __init__(self, gateway: Gateway, tokens: Tokens | None = None):
        self.gateway = gateway
        self.tokens = tokens

    def _grant(self, context) -> Grant | None:
        """The caller's grant (None: the gateway is unauthenticated); raises Unauthenticated."""
        return self.tokens.grant(context.invocation_metadata()) if self.tokens is not None else None

    async def _abort_with(self, context, exc: BatchlineError):
        await _abort(context, exc)

    async def _allow(self, context, model: str | None = None, admin: str = "") -> Grant | None:
        """Abort the call unless its token may call `model` (and is an admin's, for `admin`); its grant.
        A call that names a model is judged by its name, an empty one too (no scope holds it)."""
        try:
            grant = self._grant(context)
            if grant is not None:
                if admin:
                    grant.check_admin(admin)
                if model is not None:
                    grant.check_model(model)
            return grant
        except BatchlineError as exc:
            await _abort(context, exc)

    async def ServerLive(self, request, context):
        return ipb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return ipb.ServerReadyResponse(ready=await self.gateway.catalog.ready())

    async def ModelReady(self, request, context):
        await self._allow(context, request.name)
        try:
            ready = await self.gateway.catalog.model_ready(request.name, request.version)
        except BatchlineError as exc:  # a version that is not a number: INVALID_ARGUMENT, as REST's 400
            await _abort(context, exc)
        return ipb.ModelReadyResponse(ready=ready)

    async def ServerMetadata(self, request, context):
        await self._allow(context)
        return ipb.ServerMetadataResponse(name=SERVER_NAME, version=SERVER_VERSION,
                                          extensions=[*EXTENSIONS, "system_shared_memory"])

    async def ModelMetadata(self, request, context):
        grant = await self._allow(context, request.name)
        try:
            info = await self.gateway.catalog.model(request.name, request.version, visible(grant))
        except BatchlineError as exc:
            await _abort(context, exc)
        tensor = ipb.ModelMetadataResponse.TensorMetadata
        return ipb.ModelMetadataResponse(
            name=info.name,
            versions=self.gateway.catalog.registry.versions(info.name),
            platform=info.platform,
            inputs=[tensor(name=s.name, datatype=s.datatype, shape=list(s.shape)) for s in inputs_of(info)],
            outputs=[tensor(name=s.name, datatype=s.datatype, shape=list(s.shape)) for s in info.outputs],
        )

    async def ModelConfig(self, request, context):
        grant = await self._allow(context, request.name)
        try:
            info = await self.gateway.catalog.model(request.name, request.version, visible(grant))
        except BatchlineError as exc:
            await _abort(context, exc)
        return ipb.ModelConfigResponse(config=model_config(info))

    async def _infer(self, request, context, name: str = "ModelInfer", grant: Grant | None = None,
                     on_partial: PartialSink | None = None) -> ipb.ModelInferResponse | None:
        return await inference.infer(self.gateway, request, context.time_remaining(), context.invocation_metadata(),
                                     name, grant, on_partial)

    async def ModelInfer(self, request, context):
        grant = await self._allow(context, request.model_name)
        try:
            return await self._infer(request, context, grant=grant)
        except BatchlineError as exc:
            await _abort(context, exc)

    @tolerated
    async def ModelStreamInfer(self, request_iterator, context):
        # Requests on a stream run concurrently and are answered as they
        # finish; clients match answers to requests by id.
        try:
            # The stream's token is read once; what it may do is judged for every message by the
            # auth file as it is then (a token revoked mid-stream is refused from its next message).
            digest = self.tokens.digest(context.invocation_metadata()) if self.tokens is not None else None
            if digest is not None:
                self.tokens.lookup(digest)  # an unknown token opens no stream (as a unary call is refused)
        except BatchlineError as exc:
            await _abort(context, exc)
        answers = StreamBacklog()
        tasks: set[asyncio.Task] = set()

        # A sequence's requests on this stream go through the gateway one after another, as they
        # came: concurrently, the round trips before a request takes its turn in its sequence (the
        # tenant's rate check, a model or tokenizer read) could let a later one take it first.
        after: dict[tuple[str, str, str], asyncio.Task] = {}
        behind: dict[tuple[str, str, str], int] = {}

        async def one(request: ipb.ModelInferRequest, before: asyncio.Task | None = None) -> None:
            if before is not None:
                await asyncio.wait([before])
            try:
                grant = None
                if digest is not None:
                    grant = self.tokens.lookup(digest)
                    grant.check_model(request.model_name)
                response = await self._infer(request, context, "ModelStreamInfer", grant,
                                             lambda partial: answers.put(streamed(partial, final=False)))
                if response is None:
                    # A decoupled model's end without a response: sent only to a client that asked.
                    if _param_true(request, EMPTY_FINAL_KEY):
                        answers.put(streamed(ipb.ModelInferResponse(
                            id=request.id, model_name=request.model_name, model_version=request.model_version),
                            final=True))
                else:
                    answers.put(streamed(response, final=True))
            except BatchlineError as exc:
                answers.put(stream_error(request, exc))

        def accept(request) -> None:
            if isinstance(request, Undecodable):
                # No id to match it by: its neighbours are answered all the same.
                answers.put(ipb.ModelStreamInferResponse(
                    error_message=f"[{grpc.StatusCode.INVALID_ARGUMENT.name}] {request}"))
                return
            sequence = _sequence_of(request)
            if sequence is None:
                task = asyncio.create_task(one(request))
            elif behind.get(sequence, 0) > MAX_WAITING:
                answers.put(stream_error(request, ResourceExhausted(
                    f"model '{request.model_name}': {behind[sequence]} requests of this sequence wait on this "
                    f"stream already (at most {MAX_WAITING}): send the next once one is answered",
                    retry_after_s=WAITING_RETRY_S)))
                return
            else:
                task = asyncio.create_task(one(request, after.get(sequence)))
                after[sequence] = task
                behind[sequence] = behind.get(sequence, 0) + 1
                task.add_done_callback(functools.partial(_done_in, after, behind, sequence))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        async def read() -> None:
            async for request in request_iterator:
                # A client that sends and does not read has its next request taken (and the one
                # after it read) once it has read enough of its answers (gateway/stream_backlog.py).
                await answers.room()
                accept(request)
            while tasks:
                await asyncio.gather(*list(tasks))
            answers.put(None)

        reader = asyncio.create_task(read())
        try:
            while (item := await answers.get()) is not None:
                yield item
        finally:
            reader.cancel()
            for t in list(tasks):
                t.cancel()

    async def ModelStatistics(self, request, context):
        # A named model is judged by the token's scope; every model means every one it may see.
        grant = await self._allow(context, request.name or None, admin="statistics")
        try:
            entries = await self.gateway.catalog.statistics(request.name, request.version, visible(grant))
        except BatchlineError as exc:
            await _abort(context, exc)
        return ipb.ModelStatisticsResponse(model_stats=[model_statistics(info, s) for info, s in entries])

    async def RepositoryIndex(self, request, context):
        grant = await self._allow(context)
        try:
            entries = await self.gateway.repository.index(request.ready)
        except BatchlineError as exc:
            await _abort(context, exc)
        index = ipb.RepositoryIndexResponse.ModelIndex
        # A token sees only the models it may call.
        return ipb.RepositoryIndexResponse(models=[
            index(name=e.name, version=e.version, state=e.state, reason=e.reason)
            for e in entries if grant is None or grant.allows(e.name)])

    async def RepositoryModelLoad(self, request, context):
        await self._allow(context, request.model_name, admin="loading a model")
        try:
            await self.gateway.load_model(request.model_name, dict(request.parameters), context.time_remaining())
        except BatchlineError as exc:
            await _abort(context, exc)
        return ipb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request, context):
        await self._allow(context, request.model_name, admin="unloading a model")
        try:
            await self.gateway.unload_model(request.model_name, context.time_remaining())
        except BatchlineError as exc:
            await _abort(context, exc)
        return ipb.RepositoryModelUnloadResponse()
