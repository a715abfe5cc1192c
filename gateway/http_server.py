"""The REST port's HTTP server: uvicorn's httptools protocol serving an ASGI app on the gateway's
own event loop (docs/design/rest.md says why this server), on a socket bound here so that it can
be shared (SO_REUSEPORT) by the gateways of a mesh as the gRPC port is."""
from __future__ import annotations

import asyncio
import json
import logging
import resource
import socket
import ssl

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from batchline import ports

log = logging.getLogger(__name__)

# A request's head (its request line and headers) is at most this large, and arrives within this
# long of its first byte (a new connection's: of the connection): uvicorn bounds neither, so one
# client sending an endless header, or one byte of it at a time, would hold the gateway's memory
# or a connection for as long as it liked.
HEAD_MAX_BYTES = 64 << 10
HEAD_TIMEOUT_S = 10.0
# An answer sent before its request's body was read (a refusal, an unknown model) leaves the rest
# of the body to be read and dropped, so that the client, still sending, gets to read the answer
# (closed at once, it would fail on a broken pipe instead); for at most this long, then the
# connection is closed.
DISCARD_S = 10.0


class _HeadTooLarge(Exception):
    pass


def connection_cap(setting: int) -> int:
    """The REST connections served at once for the setting `setting` (0: half the open-file limit)."""
    if setting:
        return setting
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(16, (soft if soft != resource.RLIM_INFINITY else 65536) // 2)


def _too_many(cap: int):
    body = json.dumps({"error": f"this gateway serves at most {cap} REST connections at once and has "
                                "that many open: retry in a moment on a new connection, reuse one (keep-alive), "
                                "or raise the gateway's http_max_connections"}).encode()

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"retry-after", b"1"), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body, "more_body": False})
    return app


class BoundedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds above: past a head's, 431 or 408 and the connection
    closed; past the time to drop a body answered early, the connection closed; a request on a
    connection past the server's cap (`max_connections`, set by HttpServer), 503 and the connection
    closed."""

    max_connections = 0
    refuse_app = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = self.loop.call_later(HEAD_TIMEOUT_S, self._head_late)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0
        self._discard_until: float | None = None
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_late)

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._stop_head_timer()
        # The set of open connections counts this one.
        if self.max_connections and len(self.connections) > self.max_connections:
            app, self.app = self.app, self.refuse_app
            try:
                super().on_headers_complete()  # takes self.app for this request
            finally:
                self.app = app
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if self.cycle is not None and self.cycle.response_complete:
            now = self.loop.time()
            if self._discard_until is None:
                self._discard_until = now + DISCARD_S
            elif now > self._discard_until:
                self.transport.close()
            return
        super().on_body(body)

    def send_400_response(self, msg: str) -> None:
        # A head past its bound fails the parser's callback (_count raises), which uvicorn takes for a
        # malformed request.
        if self._head_bytes > HEAD_MAX_BYTES:
            self._refuse(431, f"the request's line and headers are over {HEAD_MAX_BYTES} bytes")
        else:
            super().send_400_response(msg)

    def _count(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > HEAD_MAX_BYTES:
            raise _HeadTooLarge()

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self._refuse(408, f"no complete request head within {HEAD_TIMEOUT_S:g} s")

    def _refuse(self, status: int, why: str) -> None:
        reason = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}[status]
        body = why.encode()
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%s" % (status, reason, len(body), body))
        self.transport.close()


def _bind(host: str, port: int, share: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if share:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if port and ports.in_use(host, port):
            raise ports.PortInUse(port, "stop it, or serve REST on another port (--http-port)") from None
        raise OSError(f"cannot bind the REST port to {host}:{port}: {exc}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class HttpServer:
    def __init__(self, app, host: str, port: int, ssl_context: ssl.SSLContext | None = None, share: bool = False,
                 max_connections: int = 0):
        """`max_connections`: served at once (gateway.settings' http_max_connections; 0: from the open-file limit)."""
        self.app, self.host, self.requested_port = app, host, port
        self.ssl_context, self.share = ssl_context, share
        self.max_connections = connection_cap(max_connections)
        self.port = -1
        self._server: uvicorn.Server | None = None
        self._ticks: asyncio.Task | None = None
        self._sock: socket.socket | None = None

    async def start(self) -> int:
        """Bind and serve; the port bound (the one asked for, or a free one for 0)."""
        self._sock = _bind(self.host, self.requested_port, self.share)
        self.port = self._sock.getsockname()[1]
        cap = self.max_connections
        protocol = type("CappedProtocol", (BoundedProtocol,),
                        {"max_connections": cap, "refuse_app": staticmethod(_too_many(cap))})
        config = uvicorn.Config(self.app, http=protocol, loop="none", lifespan="off", ws="none",
                                log_config=None, access_log=False, server_header=False,
                                timeout_graceful_shutdown=5)
        config.load()
        # uvicorn builds its SSL context from file names only; this one follows rotated files.
        config.ssl = self.ssl_context
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[self._sock])
        self._server = server
        # uvicorn's tick: the Date header, and the exit flag stop() sets.
        self._ticks = asyncio.create_task(server.main_loop(), name="http-ticks")
        return self.port

    async def stop(self) -> None:
        """Close the port, let answers being written finish (a few seconds at most), and stop."""
        if self._server is None:
            return
        self._server.should_exit = True
        if self._ticks is not None:
            await self._ticks
        await self._server.shutdown(sockets=[self._sock])
        self._server = None
