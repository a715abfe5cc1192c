"""Which asyncio event loop batchline runs on.

Every request crosses several event loops (gRPC in the gateway and the load
generator, Redis round trips in all three services). uvloop's callbacks and
transports cost less CPU than the stdlib loop's, and on small models that CPU
is what limits throughput (docs/design/scheduling.md, cheaper I/O), so it
is used whenever it is installed. BATCHLINE_EVENT_LOOP=asyncio opts out.
"""
from __future__ import annotations

import asyncio
import os
from typing import Any, Callable, Coroutine, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop constructor, or None (the stdlib loop) when opted out or not installed."""
    if os.environ.get("BATCHLINE_EVENT_LOOP", "uvloop").strip().lower() == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(coro: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on the chosen loop."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(coro)
