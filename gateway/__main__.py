"""python -m gateway: run the public KServe v2 endpoint, gRPC and HTTP/REST."""
from __future__ import annotations

import logging
import sys

from batchline import logs
from batchline.ports import PortInUse
from batchline.lifecycle import run_service
from batchline.settings import parse_settings
from gateway.app import GatewayApp
from gateway.settings import GatewaySettings


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(
        GatewaySettings,
        argv,
        prog="python -m gateway",
        description="batchline gateway: the KServe v2 / Open Inference Protocol gRPC endpoint "
        "(inference.GRPCInferenceService) and its HTTP/REST form (--http-port, with Triton's binary tensor "
        "data extension). Validates requests, stamps their latency budget and priority, queues them in "
        "Redis and answers when the result comes back.",
    )
    logs.configure(settings.log_level, "gateway", settings.log_format)

    async def start():
        try:
            app = await GatewayApp(settings).start()
        except PortInUse as exc:
            print(f"gateway: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        rest = f" (REST on port {app.http_port})" if app.http_port >= 0 else ""
        logging.getLogger("gateway").info("gateway %s listening on %s%s", app.gateway.gateway_id, app.address, rest)
        return app.stop

    run_service("gateway", start, settings.redis_url, settings.redis_timeout_s)


if __name__ == "__main__":
    main(sys.argv[1:])
