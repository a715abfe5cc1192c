"""Wiring of the gateway service: the public gRPC and REST servers around the Gateway."""
from __future__ import annotations

import asyncio
import logging

from batchline import metrics, ports
from batchline.lifecycle import stop_tasks
from batchline.grpc_server import ServerHandle, start_server
from batchline.protocol import inference_pb2, inference_pb2_grpc
from batchline.auth import Tokens
from batchline.tls import TlsFiles, server_credentials, ssl_context
from batchline.redis_client import REDIS_ERRORS
from gateway.core import Gateway
from gateway.http_server import HttpServer
from gateway.rest import RestApp
from gateway.servicer import InferenceServicer
from gateway.settings import GatewaySettings

log = logging.getLogger(__name__)


class GatewayApp:
    def __init__(self, settings: GatewaySettings):
        self.settings = settings
        self.gateway = Gateway(settings)
        self.server: ServerHandle | None = None
        self.http: HttpServer | None = None
        self._health: asyncio.Task | None = None
        self.metrics_port = -1

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def http_port(self) -> int:
        """The REST port (-1: not served)."""
        return self.http.port if self.http is not None else -1

    @property
    def address(self) -> str:
        return f"{self.settings.host}:{self.server.port}"

    async def start(self) -> "GatewayApp":
        s = self.settings

        def register(server):
            inference_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(self.gateway, tokens),
                                                                          server)
            return [inference_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name]

        options = [
            ("grpc.max_receive_message_length", s.max_message_bytes),
            ("grpc.max_send_message_length", s.max_message_bytes),
        ]
        tokens = Tokens(s.auth_file) if s.auth_file else None
        if tokens is None:
            log.info("no auth file: anyone who reaches the gRPC (or REST) port may call every model")
        files = TlsFiles.of(s.tls_cert_file, s.tls_key_file, s.tls_client_ca_file)
        if files is None:
            log.info("the gRPC and REST ports are plaintext: set tls_cert_file to serve TLS")
        else:
            log.info("the gRPC and REST ports serve TLS (%s)", "clients need a certificate signed by "
                     f"{files.client_ca_file}" if files.client_ca_file else "no client certificate asked")
        credentials = server_credentials(files) if files else None
        shared = await self._may_share_port(s.port)
        options.append(("grpc.so_reuseport", int(shared)))
        http_shared = await self._may_share_port(s.http_port) if s.http_port >= 0 else False
        self.metrics_port = metrics.start_metrics_server(self.settings.host, self.settings.metrics_port)
        self.server = await start_server(s.host, s.port, register, options, credentials)
        if s.http_port >= 0:
            rest = RestApp(self.gateway, tokens, s.max_message_bytes)
            self.http = HttpServer(rest, s.host, s.http_port, ssl_context(files) if files else None, http_shared,
                                   s.http_max_connections)
            await self.http.start()
            log.info("REST (KServe v2 HTTP) on %s:%d", s.host, self.http.port)
        await self.gateway.start(self.address)
        self._health = asyncio.create_task(self.server.watch_redis(
            self.gateway.store, on_change=self.gateway.on_redis, on_restart=self.gateway.on_redis_restart))
        return self

    async def _may_share_port(self, port: int) -> bool:
        """Whether `port` is bound shared (SO_REUSEPORT); PortInUse when another process serves it
        and it is not a gateway of this mesh (known by its gRPC address)."""
        s = self.settings
        if port == 0 or not ports.in_use(s.host, port):
            return s.share_port
        if s.share_port:
            try:
                if await self.gateway.store.serves(f"{s.host}:{s.port}"):
                    return True
            except REDIS_ERRORS as exc:
                raise ports.PortInUse(s.port, f"cannot tell whether it is a gateway of this mesh ({exc})") from None
        flag = "--port" if port == s.port else "--http-port"
        raise ports.PortInUse(port, f"stop it, or serve on another port ({flag})")

    async def stop(self, grace: float = 2.0) -> None:
        # Refuse new requests and say NOT_SERVING (in that order: whoever sees it is refused), let
        # admitted ones be answered, then let go of Redis.
        self.gateway.draining = True
        await self.server.start_draining()
        if self._health:
            await stop_tasks([self._health])
        await self.gateway.drain(self.settings.drain_timeout_s)
        # What is still unanswered gets the gateway's own UNAVAILABLE, with its message, before the
        # server's stop cancels the calls.
        self.gateway.give_up()
        if self.http is not None:
            await self.http.stop()
        await self.server.stop(grace)
        metrics.stop_metrics_server(self.metrics_port)
        await self.gateway.stop()
