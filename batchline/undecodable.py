"""Requests whose bytes are not a valid message get INVALID_ARGUMENT naming the method and what
could not be read. Left to gRPC, a deserializer that raises is answered UNKNOWN "Unexpected <class
'google.protobuf.message.DecodeError'>", which tells a caller nothing it can act on.

`guard(server)` stands in for a grpc.aio server while services are registered on it: every method
handler added through it reads its requests with a deserializer that never raises (an undecodable
request becomes an `Undecodable`), and its behaviour refuses an `Undecodable` before any servicer
code runs. A streaming method that answers each message on its own (ModelStreamInfer) is marked
`@tolerated` and is handed the `Undecodable` messages of its stream instead, so one bad message
does not end the stream for the good ones around it.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import grpc


class Undecodable:
    """A request whose bytes did not parse as the method's request message."""

    __slots__ = ("method", "message_type", "error")

    def __init__(self, method: str, message_type: str, error: Exception):
        self.method, self.message_type, self.error = method, message_type, error

    def __str__(self) -> str:
        return (f"{self.method}: the request's bytes are not a valid {self.message_type} message "
                f"({type(self.error).__name__}: {self.error})")


def tolerated(method: Callable) -> Callable:
    """Mark a request-streaming servicer method that handles each Undecodable message itself."""
    method.takes_undecodable = True
    return method


def _reader(method: str, deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    owner = getattr(deserialize, "__self__", None)
    message_type = getattr(getattr(owner, "DESCRIPTOR", None), "full_name", "request")

    def read(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError, or whatever a custom deserializer raises
            return Undecodable(method, message_type, exc)

    return read


async def _refuse(context: grpc.aio.ServicerContext, request: Undecodable) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request))


def _unary(behavior: Callable) -> Callable:
    if inspect.isasyncgenfunction(behavior):
        async def stream(request, context):
            if isinstance(request, Undecodable):
                await _refuse(context, request)
            async for answer in behavior(request, context):
                yield answer
        return stream

    async def unary(request, context):
        if isinstance(request, Undecodable):
            await _refuse(context, request)
        return await behavior(request, context)
    return unary


def _streaming(behavior: Callable) -> Callable:
    if getattr(behavior, "takes_undecodable", False):
        return behavior

    async def checked(requests, context):
        async for request in requests:
            if isinstance(request, Undecodable):
                await _refuse(context, request)
            yield request

    if inspect.isasyncgenfunction(behavior):
        async def stream(requests, context):
            async for answer in behavior(checked(requests, context), context):
                yield answer
        return stream

    async def unary(requests, context):
        return await behavior(checked(requests, context), context)
    return unary


def _guarded(method: str, handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
    if handler is None or handler.request_deserializer is None:
        return handler
    kind = (("stream_" if handler.request_streaming else "unary_")
            + ("stream" if handler.response_streaming else "unary"))
    behavior = getattr(handler, kind)
    if not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)):
        return handler  # a synchronous handler runs on a thread: none is registered on the services
    wrap = _streaming if handler.request_streaming else _unary
    return handler._replace(request_deserializer=_reader(method, handler.request_deserializer),
                            **{kind: wrap(behavior)})


class _GuardedGeneric(grpc.GenericRpcHandler):
    def __init__(self, inner: grpc.GenericRpcHandler):
        self.inner = inner
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = details.method
        handler = self.handlers.get(method)
        if handler is None:
            handler = _guarded(method, self.inner.service(details))
            if handler is not None:  # only methods served: a client naming paths at will must not grow it
                self.handlers[method] = handler
        return handler


class guard:
    """The server as registration sees it, with every handler added through it guarded."""

    def __init__(self, server: grpc.aio.Server):
        self._server = server

    def add_generic_rpc_handlers(self, handlers) -> None:
        self._server.add_generic_rpc_handlers(tuple(_GuardedGeneric(h) for h in handlers))

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self._server.add_registered_method_handlers(
            service, {name: _guarded(f"/{service}/{name}", h) for name, h in handlers.items()})

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)
