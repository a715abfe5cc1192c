"""The load generator's ModelStreamInfer side, as with perf_analyzer's ``--streaming``: in closed
loop each worker keeps a stream (InferStream) and sends on it one request at a time; in open loop
a few streams (StreamMux) carry every request, matched to its answer by id. A message on an open
HTTP/2 stream costs both ends much less than a unary call, which opens and closes a stream each time.
"""
from __future__ import annotations

import asyncio
import time

import grpc

from batchline.errors import RETRY_AFTER_KEY
from batchline.protocol import inference_pb2 as ipb

# A stream answer's error_message carries no status code; batchline starts it with
# "[CODE] ". Errors of other servers (Triton's) count under this name.
STREAM_ERROR = "STREAM_ERROR"
# How much longer than a request's budget the client waits for the server's DEADLINE_EXCEEDED.
STREAM_GRACE_S = 1.0
OPEN_LOOP_STREAMS = 4  # streams an open-loop step spreads its requests over
_CODE_NAMES = frozenset(c.name for c in grpc.StatusCode)


def stream_answer(blob: bytes) -> tuple[str, float | None]:
    """The status name of one ModelStreamInferResponse (serialized), and a refusal's retry-after
    hint in seconds (batchline's `retry-after-ms` parameter on the error answer), if any."""
    answer = ipb.ModelStreamInferResponse.FromString(blob)
    hint = answer.infer_response.parameters.get(RETRY_AFTER_KEY) if answer.error_message else None
    return _answer_status(answer), (hint.int64_param / 1e3 if hint is not None and hint.int64_param > 0 else None)


def _answer_status(answer: ipb.ModelStreamInferResponse) -> str:
    message = answer.error_message
    if not message:
        return "OK"
    if message.startswith("["):
        name = message[1:].partition("]")[0]
        if name in _CODE_NAMES:
            return name
    return STREAM_ERROR


class InferStream:
    """One ModelStreamInfer stream carrying one request at a time.

    A stream message has no gRPC deadline of its own: the budget travels in the
    request's `timeout` parameter and the server answers DEADLINE_EXCEEDED by it.
    The client waits STREAM_GRACE_S longer for that answer; past it, the request
    counts DEADLINE_EXCEEDED and its stream is replaced, so that its late answer
    cannot pass for the next request's.
    """

    def __init__(self, method):
        self._method = method
        self._call = None

    async def infer(self, payload: bytes, timeout_s: float | None) -> tuple[str, float, float | None]:
        """(status code name, latency in s, the server's retry-after hint in s if it gave one)."""
        t = time.perf_counter()
        if self._call is None:
            self._call = self._method()
        blob = None
        retry_after = None
        try:
            await self._call.write(payload)
            if timeout_s is None:
                blob = await self._call.read()
            else:
                blob = await asyncio.wait_for(self._call.read(), timeout_s + STREAM_GRACE_S)
            if isinstance(blob, bytes):
                code, retry_after = stream_answer(blob)
            else:
                code = "UNAVAILABLE"  # EOF: the server hung up
        except asyncio.TimeoutError:
            code = "DEADLINE_EXCEEDED"
        except grpc.aio.AioRpcError as exc:
            code = exc.code().name
        latency = time.perf_counter() - t
        if not isinstance(blob, bytes):
            self.close()  # no answer on this stream: the next request goes on a new one
        return code, latency, retry_after

    def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None


def with_id(payload: bytes, request_id: str) -> bytes:
    """A serialized ModelInferRequest with its `id` (field 3) set to `request_id`: a field
    appended to a message overrides an earlier value, so the pool's bytes need no re-serializing."""
    raw = request_id.encode()
    if len(raw) > 127:
        raise ValueError("request id too long for a one-byte length")
    return payload + bytes((0x1A, len(raw))) + raw


class _MuxStream:
    """One stream of a StreamMux: its writes one at a time, its requests waiting for answers."""

    def __init__(self, method):
        self.call = method()
        self.waiting: dict[str, asyncio.Future] = {}
        self.write_lock = asyncio.Lock()
        self.ended: str | None = None  # the status the stream ended with
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        code = "UNAVAILABLE"  # the server closed the stream
        try:
            while isinstance(blob := await self.call.read(), bytes):
                answer = ipb.ModelStreamInferResponse.FromString(blob)
                fut = self.waiting.pop(answer.infer_response.id, None)
                if fut is not None and not fut.done():
                    fut.set_result(_answer_status(answer))
        except grpc.aio.AioRpcError as exc:
            code = exc.code().name
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        finally:
            self.ended = code
            for fut in self.waiting.values():
                if not fut.done():
                    fut.set_result(code)
            self.waiting.clear()

    def close(self) -> None:
        self.reader.cancel()
        self.call.cancel()


class StreamMux:
    """Open loop over a few ModelStreamInfer streams.

    Requests go out round-robin, each with an id of its own, without waiting for
    earlier answers; answers come back as the server finishes them and are matched
    by `id` (batchline echoes it on errors too). A stream that ends fails what
    waits on it with its status and is replaced. As on InferStream, the budget
    travels in `timeout` and the client waits STREAM_GRACE_S longer than it.
    """

    def __init__(self, method, streams: int):
        self._method = method
        self._streams: list[_MuxStream | None] = [None] * max(1, streams)
        self._next = 0
        self._seq = 0

    async def infer(self, payload: bytes, timeout_s: float | None) -> tuple[str, float]:
        t = time.perf_counter()
        k = self._next
        self._next = (k + 1) % len(self._streams)
        stream = self._streams[k]
        if stream is None or stream.ended:
            stream = self._streams[k] = _MuxStream(self._method)
        self._seq += 1
        request_id = f"bench-{self._seq}"
        fut = asyncio.get_running_loop().create_future()
        stream.waiting[request_id] = fut
        try:
            async with stream.write_lock:
                await stream.call.write(with_id(payload, request_id))
            code = await (fut if timeout_s is None else asyncio.wait_for(fut, timeout_s + STREAM_GRACE_S))
        except asyncio.TimeoutError:
            code = "DEADLINE_EXCEEDED"
        except grpc.aio.AioRpcError as exc:
            code = exc.code().name
        finally:
            stream.waiting.pop(request_id, None)
        return code, time.perf_counter() - t

    def close(self) -> None:
        for stream in self._streams:
            if stream is not None:
                stream.close()
