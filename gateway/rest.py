"""The KServe v2 REST protocol (with Triton's binary tensor data and repository extensions) as a
bare ASGI app: HTTP in, Gateway calls out, as gateway/servicer.py does for gRPC.

Health probes are open; with `tokens`, every other call needs an `authorization: Bearer` header
judged as the gRPC metadata is. Errors answer `{"error": "<the gRPC status's message>"}` with the
HTTP status of batchline.errors.http_status.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import zlib
from typing import AsyncIterator

from batchline.auth import Grant, Tokens, visible
from batchline.errors import (RETRY_AFTER_KEY, BatchlineError, Internal, InvalidArgument, NotFound, Unauthenticated,
                              http_status)
from batchline.protocol import inference_pb2 as ipb
from gateway import inference
from gateway.convert import inputs_of, model_config, model_statistics
from gateway.core import EXTENSIONS, SERVER_NAME, SERVER_VERSION, Gateway
from gateway.rest_generate import SSE_HEADERS, first_then_rest, generate_answer, generate_request
from gateway.rest_hangup import ClientGone, unless_gone
from gateway.rest_tensors import given, infer_request, infer_response
from gateway.rest_json import message_dict

log = logging.getLogger(__name__)

# The client's deadline, in milliseconds from when the request arrives: what a gRPC deadline is
# to ModelInfer (the tighter of it and the `timeout` parameter is the budget).
TIMEOUT_HEADER = b"batchline-timeout-ms"
HEADER_LENGTH = b"inference-header-content-length"
_TRACE_HEADERS = (b"traceparent", b"tracestate")
_JSON = [(b"content-type", b"application/json")]
# Headers that say how to read the body or what it is owed: given twice with different values, a
# proxy and the gateway could each read the request another way.
_ONCE = (HEADER_LENGTH, b"content-encoding", TIMEOUT_HEADER)
# A body that sends nothing for this long is given up (its memory is held meanwhile).
UPLOAD_IDLE_S = 30.0



def _error_body(exc: BatchlineError) -> tuple[int, list, bytes]:
    headers = list(_JSON)
    if isinstance(exc, Unauthenticated):
        headers.append((b"www-authenticate", b"Bearer"))
    if exc.retry_after_s is not None:
        headers.append((b"retry-after", str(max(1, math.ceil(exc.retry_after_s))).encode()))
        headers.append((RETRY_AFTER_KEY.encode(), str(max(1, round(exc.retry_after_s * 1000))).encode()))
    return http_status(exc), headers, json.dumps({"error": str(exc)}).encode()


def _json(value) -> tuple[int, list, bytes]:
    return 200, _JSON, json.dumps(value, separators=(",", ":")).encode()


def _deadline(headers: dict[bytes, bytes], arrived: float) -> float | None:
    """When the client's deadline falls (time.monotonic), from its header and when the request arrived."""
    value = headers.get(TIMEOUT_HEADER)
    if value is None:
        return None
    try:
        ms = float(value)
    except ValueError:
        ms = math.nan
    if not math.isfinite(ms) or ms < 0:
        raise InvalidArgument(f"the {TIMEOUT_HEADER.decode()} header must be a number of milliseconds >= 0, "
                              f"got {value.decode('latin-1')!r}")
    return arrived + ms / 1000


def _left(deadline: float | None) -> float | None:
    """What is left of the client's deadline now, as a gRPC call's time_remaining() says it: the body's
    upload and the lookups before the call have spent their share."""
    return None if deadline is None else deadline - time.monotonic()


class RestApp:
    def __init__(self, gateway: Gateway, tokens: Tokens | None, max_body_bytes: int):
        self.gateway = gateway
        self.tokens = tokens
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        arrived = time.monotonic()
        headers = _Headers(scope["headers"])
        events = None
        try:
            _once(headers)
            status, answer_headers, body = await self._route(scope, headers, receive, arrived)
            if not isinstance(body, bytes):
                events, body = body, b""
        except ClientGone:
            return  # the connection is closed: nothing to send, and uvicorn expects nothing
        except BatchlineError as exc:
            status, answer_headers, body = _error_body(exc)
        except Exception as exc:
            # A bug or a failure nobody foresaw: a JSON error as every other, not uvicorn's text page.
            log.exception("%s %s failed unexpectedly", scope["method"], scope["path"])
            status, answer_headers, body = _error_body(
                Internal(f"the gateway failed on this request unexpectedly ({type(exc).__name__}: {exc})"))
        if events is not None:
            await self._stream(status, answer_headers, events, send, receive)
            return
        await send({"type": "http.response.start", "status": status,
                    "headers": [*answer_headers, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    @staticmethod
    async def _stream(status: int, headers: list, events, send, receive) -> None:
        """Server-sent events as they come, each sent at once (chunked: no content-length). A
        client that hangs up stops the stream at once, between events too (uvicorn would drop
        what is sent to it silently), and closing the events cancels the request."""
        async def pump() -> None:
            async for chunk in events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})

        await send({"type": "http.response.start", "status": status, "headers": headers})
        try:
            await unless_gone(receive, pump())
        except ClientGone:
            pass
        finally:
            await events.aclose()

    async def _body(self, headers: dict[bytes, bytes], receive) -> bytes:
        declared = headers.get(b"content-length")
        cap = self.max_body_bytes
        if declared is not None and declared.isdigit() and int(declared) > cap:
            raise InvalidArgument(f"the request body is {int(declared)} bytes, over the gateway's limit of {cap} "
                                  "(max_message_bytes)")
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), UPLOAD_IDLE_S)
            except asyncio.TimeoutError:
                raise InvalidArgument(f"the request body stalled: nothing arrived for {UPLOAD_IDLE_S:g} s after "
                                      f"{size} bytes") from None
            if message["type"] == "http.disconnect":
                raise InvalidArgument("the client went away before the request body was complete")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > cap:
                raise InvalidArgument(f"the request body is over the gateway's limit of {cap} bytes "
                                      "(max_message_bytes)")
            chunks.append(chunk)
            if not message.get("more_body"):
                body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                encoding = headers.get(b"content-encoding")
                return self._decompress(body, encoding.decode("latin-1").strip().lower()) if encoding else body

    def _decompress(self, body: bytes, encoding: str) -> bytes:
        """A compressed body (tritonclient's request_compression_algorithm), within the same cap."""
        if encoding == "identity":
            return body
        if encoding not in ("gzip", "deflate"):
            raise InvalidArgument(f"Content-Encoding {encoding!r} is not supported: send gzip, deflate or none")
        inflater = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
        try:
            out = inflater.decompress(body, self.max_body_bytes + 1)
        except zlib.error as exc:
            raise InvalidArgument(f"the request body is not valid {encoding} data: {exc}") from None
        if len(out) > self.max_body_bytes:
            raise InvalidArgument(f"the request body is over the gateway's limit of {self.max_body_bytes} bytes "
                                  "(max_message_bytes) once decompressed")
        if not inflater.eof or inflater.unused_data:
            # A stream cut short (its checksum never checked) or bytes after it: not what was sent.
            raise InvalidArgument(f"the request body is not valid {encoding} data: "
                                  + ("it ends before the stream does" if not inflater.eof else
                                     f"{len(inflater.unused_data)} bytes follow the end of the stream"))
        return out

    async def _json_body(self, headers, receive) -> dict:
        body = await self._body(headers, receive)
        if not body.strip():
            return {}
        try:
            value = json.loads(body)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
            raise InvalidArgument(f"the request body is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise InvalidArgument("the request body must be a JSON object")
        return value

    def _allow(self, headers, model: str | None = None, admin: str = "") -> Grant | None:
        """The caller's grant (None: no tokens), if it may call `model` (an empty name too: no scope
        holds it) and is an admin's, for `admin`."""
        if self.tokens is None:
            return None
        grant = self.tokens.grant(getattr(headers, "raw", headers.items()))  # each header, repeated ones too
        if admin:
            grant.check_admin(admin)
        if model is not None:
            grant.check_model(model)
        return grant

    async def _route(self, scope, headers, receive, arrived: float) -> tuple[int, list, bytes | AsyncIterator[bytes]]:
        """The answer: its status, headers and body, or its events (generate_stream)."""
        method, path = scope["method"], scope["path"]
        parts = path.strip("/").split("/")
        if parts[0] != "v2":
            raise NotFound(f"no such endpoint: {method} {path} (the KServe v2 REST API lives under /v2)")
        route = parts[1:]
        if method == "GET":
            if route == ["health", "live"]:
                return 200, [], b""
            if route == ["health", "ready"]:
                ready = not self.gateway.draining and await self.gateway.catalog.ready()
                return (200 if ready else 400), [], b""
            if route == []:
                self._allow(headers)
                return _json({"name": SERVER_NAME, "version": SERVER_VERSION,
                              "extensions": [*EXTENSIONS, "binary_tensor_data"]})
            if route == ["models", "stats"]:
                return await self._statistics(headers, "", "")
        if route[:1] == ["models"] and len(route) >= 2:
            name, rest = route[1], route[2:]
            version = ""
            if rest[:1] == ["versions"] and len(rest) >= 2:
                version, rest = rest[1], rest[2:]
            action = "/".join(rest)
            if method == "POST" and action == "infer":
                return await self._infer(headers, receive, name, version, arrived)
            if method == "POST" and action in ("generate", "generate_stream"):
                return await self._generate(headers, receive, name, version, action == "generate_stream", arrived)
            if method == "GET":
                if action == "":
                    return await self._metadata(headers, name, version)
                if action == "ready":
                    self._allow(headers, name)
                    return (200 if await self.gateway.catalog.model_ready(name, version) else 400), [], b""
                if action == "config":
                    grant = self._allow(headers, name)
                    info = await self.gateway.catalog.model(name, version, visible(grant))
                    return _json(message_dict(model_config(info)))
                if action == "stats":
                    return await self._statistics(headers, name, version)
        if method == "POST" and route[:1] == ["repository"]:
            return await self._repository(headers, receive, route[1:], path, arrived)
        raise NotFound(f"no such endpoint: {method} {path}")

    async def _metadata(self, headers, name: str, version: str):
        grant = self._allow(headers, name)
        info = await self.gateway.catalog.model(name, version, visible(grant))

        def tensors(specs) -> list[dict]:
            return [{"name": s.name, "datatype": s.datatype, "shape": list(s.shape)} for s in specs]

        return _json({"name": info.name, "versions": list(self.gateway.catalog.registry.versions(info.name)),
                      "platform": info.platform, "inputs": tensors(inputs_of(info)), "outputs": tensors(info.outputs)})

    async def _statistics(self, headers, name: str, version: str):
        grant = self._allow(headers, name or None, admin="statistics")
        entries = await self.gateway.catalog.statistics(name, version, visible(grant))
        answer = ipb.ModelStatisticsResponse(model_stats=[model_statistics(info, s) for info, s in entries])
        return _json(message_dict(answer))

    async def _before_infer(self, grant: Grant | None, name: str, version: str, checks):
        """`checks` awaited after the tenant's rate is charged (as gRPC charges it first), each refusal
        counted as the inference's own failures are."""
        try:
            if grant is not None and grant.max_rate > 0:
                await self.gateway.take_rate(grant.tenant, grant.max_rate, name)
            return await checks()
        except BatchlineError as exc:
            inference.count_failure(self.gateway, name, version, grant, exc)
            raise

    async def _infer(self, headers, receive, name: str, version: str, arrived: float):
        grant = self._allow(headers, name)

        async def checks():
            deadline = _deadline(headers, arrived)
            model = await self.gateway.catalog.model(name, version, visible(grant))  # 404 whatever the body
            if model.decoupled and not model.generation:
                raise InvalidArgument(f"HTTP end point doesn't support models with decoupled transaction policy: "
                                      f"model '{model.name}' answers with any number of responses; call "
                                      f"ModelStreamInfer on the gRPC port")
            body = await self._body(headers, receive)
            length = headers.get(HEADER_LENGTH)
            if length is not None and not length.isdigit():
                raise InvalidArgument(f"the Inference-Header-Content-Length header must be a byte count, "
                                      f"got {length.decode('latin-1')!r}")
            return deadline, *infer_request(body, int(length) if length is not None else None, name, version)

        deadline, request, choice = await self._before_infer(grant, name, version, checks)
        # What the trace context needs, not every header: this runs for every request.
        metadata = [(k.decode(), v.decode("latin-1")) for k in _TRACE_HEADERS if (v := headers.get(k)) is not None]
        response = await unless_gone(
            receive, inference.infer(self.gateway, request, _left(deadline), metadata, "HTTP ModelInfer", grant,
                                     rate_taken=True))
        body, header_length = infer_response(response, choice)
        if header_length is None:
            return 200, _JSON, body
        return 200, [(b"content-type", b"application/octet-stream"),
                     (HEADER_LENGTH, str(header_length).encode())], body

    async def _generate(self, headers, receive, name: str, version: str, stream: bool, arrived: float):
        grant = self._allow(headers, name)

        async def checks():
            deadline = _deadline(headers, arrived)
            model = await self.gateway.catalog.model(name, version, visible(grant))
            return deadline, generate_request(await self._json_body(headers, receive), model, version)

        deadline, request = await self._before_infer(grant, name, version, checks)
        metadata = [(k.decode(), v.decode("latin-1")) for k in _TRACE_HEADERS if (v := headers.get(k)) is not None]
        if not stream:
            response = await unless_gone(
                receive, inference.infer(self.gateway, request, _left(deadline), metadata, "HTTP generate", grant,
                                         rate_taken=True))
            if response is None:
                raise Internal(f"model '{name}' ended without a response: ask generate_stream for its responses")
            return _json(generate_answer(response))

        def run(on_partial):
            return inference.infer(self.gateway, request, _left(deadline), metadata, "HTTP generate_stream", grant,
                                   on_partial, rate_taken=True)

        return 200, SSE_HEADERS, await unless_gone(receive, first_then_rest(run))

    async def _repository(self, headers, receive, route: list[str], path: str, arrived: float):
        if route == ["index"]:
            grant = self._allow(headers)
            ready = (await self._json_body(headers, receive)).get("ready", False)
            entries = await self.gateway.repository.index(ready is True)
            return _json([{"name": e.name, "version": e.version, "state": e.state, "reason": e.reason}
                          for e in entries if grant is None or grant.allows(e.name)])
        if len(route) == 3 and route[0] == "models" and route[2] in ("load", "unload"):
            name, action = route[1], route[2]
            self._allow(headers, name, admin=f"{action}ing a model")
            deadline = _deadline(headers, arrived)
            body = await self._json_body(headers, receive)
            if action == "load":
                parameters = given(body, "parameters", {})
                if not isinstance(parameters, dict):
                    raise InvalidArgument("`parameters` must be an object")
                await self.gateway.load_model(name, parameters, _left(deadline))
            else:
                await self.gateway.unload_model(name, _left(deadline))
            return 200, [], b""
        raise NotFound(f"no such endpoint: POST {path}")


def _once(headers: "_Headers") -> None:
    if len(headers) == len(headers.raw):
        return  # no name given twice
    for name in _ONCE:
        values = {v for n, v in headers.raw if n == name}
        if len(values) > 1:
            raise InvalidArgument(f"the {name.decode()} header is given {len(values)} times with different values: "
                                  "send it once")


class _Headers(dict):
    """A request's headers by name (the last of a repeated one), and as sent (`raw`)."""

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        super().__init__(raw)
        self.raw = raw
