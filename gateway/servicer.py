"""inference.GRPCInferenceService: protobuf and status codes in, Gateway calls out."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

from batchline import contract, metrics, telemetry
from batchline.errors import RETRY_AFTER_KEY, BatchlineError, Internal, grpc_status
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import inference_pb2_grpc
from batchline.auth import Grant, Tokens
from gateway.core import EXTENSIONS, SERVER_NAME, SERVER_VERSION, Gateway

log = logging.getLogger(__name__)
_tracer = telemetry.tracer("batchline.gateway")


def _trace_headers(context: grpc.aio.ServicerContext) -> tuple[str, str]:
    md = dict(context.invocation_metadata() or ())
    return md.get("traceparent", ""), md.get("tracestate", "")


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


def _duration(stats: dict[str, int], prefix: str) -> ipb.StatisticDuration:
    return ipb.StatisticDuration(count=stats.get(f"{prefix}_count", 0), ns=stats.get(f"{prefix}_ns", 0))


def _batch_duration(stats: dict[str, int], rows: int, field: str) -> ipb.StatisticDuration:
    return ipb.StatisticDuration(count=stats[contract.batch_stat(rows, "count")],
                                 ns=stats.get(contract.batch_stat(rows, field), 0))


def model_statistics(info, stats: dict[str, int]) -> ipb.ModelStatistics:
    batch_sizes = contract.batch_sizes(stats)
    return ipb.ModelStatistics(
        name=info.name,
        version=info.version,
        last_inference=stats.get("last_inference_ms", 0),
        inference_count=stats.get("inference_count", 0),
        execution_count=stats.get("execution_count", 0),
        inference_stats=ipb.InferStatistics(
            success=_duration(stats, "success"),
            fail=_duration(stats, "fail"),
            queue=_duration(stats, "queue"),
            compute_input=_duration(stats, "compute_input"),
            compute_infer=_duration(stats, "compute_infer"),
            compute_output=_duration(stats, "compute_output"),
        ),
        batch_stats=[
            ipb.InferBatchStatistics(
                batch_size=n,
                compute_input=_batch_duration(stats, n, "compute_input_ns"),
                compute_infer=_batch_duration(stats, n, "compute_infer_ns"),
                compute_output=_batch_duration(stats, n, "compute_output_ns"),
            )
            for n in batch_sizes
        ],
    )


def _data_type(datatype: str) -> int:
    # Triton names BYTES tensors TYPE_STRING; every other KServe datatype maps by name.
    return ipb.DataType.Value("TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}")


def model_config(info) -> ipb.ModelConfig:
    """Triton's view of a model (ModelConfig), from what the executor loaded and config.toml."""
    batched = info.max_batch_size > 0

    def dims(shape) -> list[int]:  # Triton leaves the batch dim out of a batched model's dims
        return list(shape[1:] if batched else shape)

    config = ipb.ModelConfig(
        name=info.name,
        platform=info.platform,
        backend="onnxruntime",
        max_batch_size=info.max_batch_size,
        input=[ipb.ModelInput(name=s.name, data_type=_data_type(s.datatype), dims=dims(s.shape)) for s in info.inputs],
        output=[ipb.ModelOutput(name=s.name, data_type=_data_type(s.datatype), dims=dims(s.shape)) for s in info.outputs],
        parameters={
            "providers": ipb.ModelParameter(string_value=",".join(info.providers)),
            "padded_inputs": ipb.ModelParameter(string_value=",".join(info.padded_inputs)),
        },
    )
    if batched:
        config.dynamic_batching.CopyFrom(ipb.ModelDynamicBatching(
            preferred_batch_size=list(info.preferred_batch_sizes),
            max_queue_delay_microseconds=round(info.max_queue_delay_ms * 1000),
            priority_levels=info.priority_levels,
            default_priority_level=info.default_priority,
            # A request that cannot make its budget is answered DEADLINE_EXCEEDED (REJECT), and
            # a `timeout` parameter or the gRPC deadline overrides the default budget.
            default_queue_policy=ipb.ModelQueuePolicy(
                timeout_action=ipb.ModelQueuePolicy.REJECT,
                default_timeout_microseconds=round(info.default_timeout_ms * 1000),
                allow_timeout_override=True,
                max_queue_size=info.max_queue_size,
            ),
        ))
    return config


def stream_error(request: ipb.ModelInferRequest, exc: BatchlineError) -> ipb.ModelStreamInferResponse:
    """A failed request's answer on a ModelStreamInfer stream, which goes on: the status name in
    brackets, the message, the request's id, and a refusal's retry-after hint as a parameter
    (a stream message has no trailing metadata of its own)."""
    answer = ipb.ModelInferResponse(id=request.id, model_name=request.model_name, model_version=request.model_version)
    if exc.retry_after_s is not None:
        answer.parameters[RETRY_AFTER_KEY].int64_param = _retry_after_ms(exc.retry_after_s)
    return ipb.ModelStreamInferResponse(error_message=f"[{grpc_status(exc).name}] {exc}", infer_response=answer)


class InferenceServicer(inference_pb2_grpc.GRPCInferenceServiceServicer):
    """ServerLive and ServerReady are open, as probes; with `tokens`, every other call needs a token,
    and a model call one whose scope holds the model (statistics: an admin token)."""

    def __init__(self, gateway: Gateway, tokens: Tokens | None = None):
        self.gateway = gateway
        self.tokens = tokens

    def _grant(self, context) -> Grant | None:
        """The caller's grant (None: the gateway is unauthenticated); raises Unauthenticated."""
        return self.tokens.grant(context.invocation_metadata()) if self.tokens is not None else None

    async def _allow(self, context, model: str = "", admin: str = "") -> Grant | None:
        """Abort the call unless its token may call `model` (and is an admin's, for `admin`); its grant."""
        try:
            grant = self._grant(context)
            if grant is not None:
                if admin:
                    grant.check_admin(admin)
                elif model:
                    grant.check_model(model)
            return grant
        except BatchlineError as exc:
            await _abort(context, exc)

    async def ServerLive(self, request, context):
        return ipb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return ipb.ServerReadyResponse(ready=await self.gateway.ready())

    async def ModelReady(self, request, context):
        await self._allow(context, request.name)
        return ipb.ModelReadyResponse(ready=await self.gateway.model_ready(request.name, request.version))

    async def ServerMetadata(self, request, context):
        await self._allow(context)
        return ipb.ServerMetadataResponse(name=SERVER_NAME, version=SERVER_VERSION, extensions=EXTENSIONS)

    async def ModelMetadata(self, request, context):
        await self._allow(context, request.name)
        try:
            info = await self.gateway.model(request.name, request.version)
        except BatchlineError as exc:
            await _abort(context, exc)
        tensor = ipb.ModelMetadataResponse.TensorMetadata
        return ipb.ModelMetadataResponse(
            name=info.name,
            versions=self.gateway.registry.versions(info.name),
            platform=info.platform,
            inputs=[tensor(name=s.name, datatype=s.datatype, shape=list(s.shape)) for s in info.inputs],
            outputs=[tensor(name=s.name, datatype=s.datatype, shape=list(s.shape)) for s in info.outputs],
        )

    async def ModelConfig(self, request, context):
        await self._allow(context, request.name)
        try:
            info = await self.gateway.model(request.name, request.version)
        except BatchlineError as exc:
            await _abort(context, exc)
        return ipb.ModelConfigResponse(config=model_config(info))

    async def _infer(self, request, context, name: str = "ModelInfer") -> ipb.ModelInferResponse:
        """One inference, traced (continuing the client's trace) and counted; raises BatchlineError."""
        started = time.perf_counter()
        traced = telemetry.enabled()
        with (telemetry.server_span(_tracer, name, context.invocation_metadata(), {"batchline.model": request.model_name})
              if traced else contextlib.nullcontext()) as span:
            def failed(error: BatchlineError) -> None:
                labels = self.gateway.metric_labels(request.model_name, request.model_version)
                metrics.REQUEST_FAILURE.labels(*labels, metrics.status_reason(grpc_status(error))).inc()
                if traced:
                    telemetry.set_error(span, f"{grpc_status(error).name}: {error}")

            try:
                response = await self.gateway.infer(request, context.time_remaining(), *_trace_headers(context))
            except BatchlineError as exc:
                failed(exc)
                raise
            except Exception as exc:
                # A bug or a failure nobody foresaw: INTERNAL with what happened, not gRPC's UNKNOWN,
                # and on a stream an answer rather than a request left hanging.
                log.exception("request %r to model %r failed unexpectedly", request.id, request.model_name)
                error = Internal(f"the gateway failed on this request unexpectedly ({type(exc).__name__}: {exc})")
                failed(error)
                raise error from exc
        metrics.REQUEST_SUCCESS.labels(response.model_name, response.model_version).inc()
        metrics.REQUEST_DURATION.labels(response.model_name, response.model_version).observe(time.perf_counter() - started)
        return response

    async def ModelInfer(self, request, context):
        grant = await self._allow(context, request.model_name)
        try:
            if grant is not None and grant.max_rate > 0:
                await self.gateway.take_rate(grant.tenant, grant.max_rate, request.model_name)
            return await self._infer(request, context)
        except BatchlineError as exc:
            await _abort(context, exc)

    async def ModelStreamInfer(self, request_iterator, context):
        # Requests on a stream run concurrently and are answered as they
        # finish; clients match answers to requests by id.
        try:
            grant = self._grant(context)  # the stream's token: checked once, the model per request
        except BatchlineError as exc:
            await _abort(context, exc)
        answers: asyncio.Queue = asyncio.Queue()
        tasks: set[asyncio.Task] = set()

        async def one(request: ipb.ModelInferRequest) -> None:
            try:
                if grant is not None:
                    grant.check_model(request.model_name)
                    if grant.max_rate > 0:
                        await self.gateway.take_rate(grant.tenant, grant.max_rate, request.model_name)
                response = await self._infer(request, context, "ModelStreamInfer")
                await answers.put(ipb.ModelStreamInferResponse(infer_response=response))
            except BatchlineError as exc:
                await answers.put(stream_error(request, exc))

        async def read() -> None:
            async for request in request_iterator:
                task = asyncio.create_task(one(request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            while tasks:
                await asyncio.gather(*list(tasks))
            await answers.put(None)

        reader = asyncio.create_task(read())
        try:
            while (item := await answers.get()) is not None:
                yield item
        finally:
            reader.cancel()
            for t in list(tasks):
                t.cancel()

    async def ModelStatistics(self, request, context):
        await self._allow(context, admin="statistics")
        try:
            entries = await self.gateway.statistics(request.name, request.version)
        except BatchlineError as exc:
            await _abort(context, exc)
        return ipb.ModelStatisticsResponse(model_stats=[model_statistics(info, s) for info, s in entries])
