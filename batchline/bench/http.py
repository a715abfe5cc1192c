"""Load over KServe v2 HTTP/REST (`batchline bench --protocol http`), the counterpart of loadgen's
gRPC Endpoint: the same calls, so closed and open loops run unchanged.

Each request of the pool (a serialized ModelInferRequest) is turned once into the HTTP request
Triton's binary tensor data extension makes of it (JSON header, raw tensors after it, every
output asked for binary), and sent as those bytes over keep-alive HTTP/1.1 connections of a
minimal client here: one connection per request in flight, as HTTP/1.1 has it. Control calls go
through tritonclient.http.aio.
"""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import tritonclient.http.aio as tha
from tritonclient.utils import InferenceServerException

from batchline.bench.inputs import TensorInfo
from batchline.bench.loadgen import BenchError
from batchline.errors import RETRY_AFTER_KEY
from batchline.protocol import inference_pb2 as ipb

# HTTP statuses as the gRPC status names the reports count (batchline.errors' table, read back).
STATUS_NAMES = {200: "OK", 400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED",
                404: "NOT_FOUND", 429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 503: "UNAVAILABLE",
                504: "DEADLINE_EXCEEDED"}
TIMEOUT_HEADER = "Batchline-Timeout-Ms"


def http_body(payload: bytes) -> tuple[bytes, int]:
    """The binary-extension body of a serialized ModelInferRequest, and its JSON header's length."""
    request = ipb.ModelInferRequest.FromString(payload)
    if len(request.raw_input_contents) != len(request.inputs):
        raise BenchError("the request pool must carry raw_input_contents")
    parameters = {k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in request.parameters.items()}
    parameters["binary_data_output"] = True
    header: dict = {"parameters": parameters, "inputs": [
        {"name": t.name, "shape": list(t.shape), "datatype": t.datatype,
         "parameters": {"binary_data_size": len(raw)}}
        for t, raw in zip(request.inputs, request.raw_input_contents)]}
    if request.id:
        header["id"] = request.id
    text = json.dumps(header, separators=(",", ":")).encode()
    return text + b"".join(request.raw_input_contents), len(text)


class HttpEndpoint:
    """One model of a KServe v2 HTTP server (host:port), as loadgen's Endpoint is of a gRPC one."""

    def __init__(self, url: str, model: str, version: str = "", connections: int = 1,
                 headers: dict[str, str] | None = None):
        self.url, self.model, self.version = url, model, version
        self.host, _, port = url.rpartition(":")
        self.port = int(port)
        self.headers = dict(headers or {})
        self.path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"
        self.client: tha.InferenceServerClient | None = None
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._requests: dict[tuple[bytes, float | None], bytes] = {}

    async def __aenter__(self) -> "HttpEndpoint":
        self.client = tha.InferenceServerClient(self.url, conn_timeout=10.0)
        return self

    async def __aexit__(self, *exc) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()
        await self.client.close()

    async def inputs(self, timeout_s: float = 10.0) -> list[TensorInfo]:
        """Check the endpoint is live and serves the model; return the model's inputs (the
        client's conn_timeout bounds each call)."""
        try:
            await self.client.is_server_live(headers=self.headers)
        except (InferenceServerException, OSError, asyncio.TimeoutError, aiohttp.ClientError) as exc:
            raise BenchError(f"cannot reach a KServe v2 HTTP server at {self.url}: {exc}") from None
        try:
            meta = await self.client.get_model_metadata(self.model, self.version, headers=self.headers)
        except InferenceServerException as exc:
            what = f"model {self.model!r}" + (f" version {self.version!r}" if self.version else "")
            raise BenchError(f"{what} is not served by {self.url}: {exc.message()}") from None
        inputs = [TensorInfo(t["name"], t["datatype"], tuple(t["shape"])) for t in meta["inputs"]]
        text = await self.text_input(timeout_s)
        return [t for t in inputs if t.name != text] if text else inputs

    async def text_input(self, timeout_s: float = 10.0) -> str:
        try:
            config = await self.client.get_model_config(self.model, self.version, headers=self.headers)
        except InferenceServerException:
            return ""
        return config.get("parameters", {}).get("text_input", {}).get("string_value", "")

    async def counts(self) -> tuple[int, int] | None:
        try:
            stats = await self.client.get_inference_statistics(self.model, self.version, headers=self.headers)
        except InferenceServerException:
            return None
        entries = [s for s in stats.get("model_stats", []) if s["name"] == self.model]
        return sum(s.get("inference_count", 0) for s in entries), sum(s.get("execution_count", 0) for s in entries)

    def _request(self, payload: bytes, timeout_s: float | None) -> bytes:
        key = (payload, timeout_s)
        request = self._requests.get(key)
        if request is None:
            body, length = http_body(payload)
            lines = [f"POST {self.path} HTTP/1.1", f"Host: {self.url}", "Content-Type: application/octet-stream",
                     f"Inference-Header-Content-Length: {length}", f"Content-Length: {len(body)}",
                     *(f"{k}: {v}" for k, v in self.headers.items())]
            if timeout_s is not None:
                lines.append(f"{TIMEOUT_HEADER}: {timeout_s * 1000:g}")
            request = self._requests[key] = ("\r\n".join(lines) + "\r\n\r\n").encode() + body
        return request

    async def infer(self, payload: bytes, timeout_s: float | None) -> tuple[str, float]:
        code, latency, _ = await self.infer_hinted(payload, timeout_s)
        return code, latency

    async def infer_hinted(self, payload: bytes, timeout_s: float | None) -> tuple[str, float, float | None]:
        request = self._request(payload, timeout_s)
        t = time.perf_counter()
        try:
            # The connection, made if need be, within the budget as the exchange is: a client counts
            # its connect time in the request's.
            status, hint = await asyncio.wait_for(self._send(request), timeout_s)
        except asyncio.TimeoutError:
            return "DEADLINE_EXCEEDED", time.perf_counter() - t, None
        except (OSError, asyncio.IncompleteReadError, ValueError):
            return "UNAVAILABLE", time.perf_counter() - t, None
        return STATUS_NAMES.get(status, f"HTTP_{status}"), time.perf_counter() - t, hint

    async def _send(self, request: bytes) -> tuple[int, float | None]:
        """One exchange on an idle connection, or a new one. A kept-alive connection the server closed
        while it was idle (its keep-alive timeout) fails before any answer: sent again, once, on a
        new connection, as HTTP clients do, rather than counted as the server's failure."""
        reused = bool(self._idle)
        connection = self._idle.pop() if reused else await asyncio.open_connection(self.host, self.port)
        try:
            answer = await self._exchange(connection, request)
        except (OSError, asyncio.IncompleteReadError) as exc:
            connection[1].close()
            before_any_byte = not isinstance(exc, asyncio.IncompleteReadError) or not exc.partial
            if not (reused and before_any_byte):
                raise
            connection = await asyncio.open_connection(self.host, self.port)
            try:
                answer = await self._exchange(connection, request)
            except BaseException:
                connection[1].close()
                raise
        except BaseException:
            connection[1].close()
            raise
        self._idle.append(connection)
        return answer

    @staticmethod
    async def _exchange(connection, request: bytes) -> tuple[int, float | None]:
        reader, writer = connection
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length, hint = 0, None
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == RETRY_AFTER_KEY.encode():
                hint = int(value) / 1e3
        await reader.readexactly(length)
        return status, hint

    def stream(self):
        raise BenchError("--streaming is gRPC's ModelStreamInfer: HTTP has no streams")

    def stream_mux(self, streams: int = 0):
        raise BenchError("--streaming is gRPC's ModelStreamInfer: HTTP has no streams")
