"""The REST port's HTTP server: uvicorn's httptools protocol serving an ASGI app on the gateway's
own event loop (docs/design/rest.md says why this server), on a socket bound here so that it can
be shared (SO_REUSEPORT) by the gateways of a mesh as the gRPC port is."""
from __future__ import annotations

import asyncio
import logging
import socket
import ssl

import uvicorn

from batchline import ports

log = logging.getLogger(__name__)


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
    def __init__(self, app, host: str, port: int, ssl_context: ssl.SSLContext | None = None, share: bool = False):
        self.app, self.host, self.requested_port = app, host, port
        self.ssl_context, self.share = ssl_context, share
        self.port = -1
        self._server: uvicorn.Server | None = None
        self._ticks: asyncio.Task | None = None
        self._sock: socket.socket | None = None

    async def start(self) -> int:
        """Bind and serve; the port bound (the one asked for, or a free one for 0)."""
        self._sock = _bind(self.host, self.requested_port, self.share)
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(self.app, http="httptools", loop="none", lifespan="off", ws="none",
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
