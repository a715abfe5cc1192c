"""Running a service until SIGINT/SIGTERM, then stopping it cleanly."""
from __future__ import annotations

import asyncio
import logging
import signal
from typing import Awaitable, Callable

from batchline import eventloop, telemetry

log = logging.getLogger(__name__)


async def stop_tasks(tasks, timeout: float = 5.0) -> None:
    """Cancel background tasks and wait for them to end.

    A cancellation can be swallowed (redis-py turns one that lands mid-read
    into a connection error, which a retry loop then survives), so pending
    tasks are cancelled again until they end or `timeout` passes.
    """
    pending = {t for t in tasks if not t.done()}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while pending and loop.time() < deadline:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.1)
    if pending:
        log.warning("tasks did not stop: %s", sorted(t.get_name() for t in pending))


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
        eventloop.run(main())
    finally:
        telemetry.shutdown_tracing()
