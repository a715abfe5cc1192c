"""Running a service until SIGINT/SIGTERM, then stopping it cleanly."""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
from typing import Awaitable, Callable

from batchline import eventloop, telemetry
from batchline.redis_client import RedisAccessError, check_access
from batchline.embedded_redis import die_with_parent

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


# Set by `batchline up` to its own pid in the services it starts: they go when it goes, even when
# it is SIGKILLed (they run in sessions of their own, so nothing else would stop them). Armed in the
# service rather than between fork and exec, where a parent with threads must run no Python.
PARENT_ENV = "BATCHLINE_DIE_WITH_PARENT"


def die_with_parent_if_asked() -> None:
    parent = os.environ.pop(PARENT_ENV, "")
    if not parent or sys.platform != "linux":
        return
    die_with_parent()
    if os.getppid() != int(parent):  # it died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)


def run_service(service: str, start: Callable[[], Awaitable[Callable[[], Awaitable[None]]]],
                redis_url: str = "", redis_timeout_s: float = 1.0) -> None:
    """`start` brings the service up and returns the coroutine function that stops it.

    Tracing is set up from the OTEL_* environment first (off unless an
    exporter or endpoint is configured) and flushed on the way out. A Redis at `redis_url` that
    refuses the service's credentials or TLS stops it at once, in one line (exit code 2).
    """

    async def main() -> None:
        if redis_url:
            try:
                await check_access(redis_url, redis_timeout_s)
            except RedisAccessError as exc:
                print(f"{service}: {exc}", file=sys.stderr, flush=True)
                raise SystemExit(2) from None
        stop = await start()
        # What start-up built (modules, sessions, protobuf descriptors) lives as long as the process:
        # frozen, it is out of the collector's reach, so full collections do not walk it. Full
        # collections walking it are mlp's longest stalls: p99 at 32 in flight is 24 ms with the
        # freeze, 29 ms without (median of three alternating pairs, benchmarks/mlp_overhead.py's load).
        gc.collect()
        gc.freeze()
        try:
            await wait_for_signal()
        finally:
            await stop()

    die_with_parent_if_asked()
    telemetry.setup_tracing(service)
    try:
        eventloop.run(main())
    finally:
        telemetry.shutdown_tracing()
