"""Running a service until SIGINT/SIGTERM, then stopping it cleanly."""
from __future__ import annotations

import asyncio
import signal
from typing import Awaitable, Callable

from batchline import telemetry


async def wait_for_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def run_service(service: str, start: Callable[[], Awaitable[Callable[[], Awaitable[None]]]]) -> None:
    """`start` brings the service up and returns the coroutine function that stops it.

    Tracing is set up from the OTEL_* environment first (off unless an
    exporter or endpoint is configured) and flushed on the way out.
    """

    async def main() -> None:
        stop = await start()
        try:
            await wait_for_signal()
        finally:
            await stop()

    telemetry.setup_tracing(service)
    try:
        asyncio.run(main())
    finally:
        telemetry.shutdown_tracing()
