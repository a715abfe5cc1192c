"""W3C trace context (traceparent) carried inside the Redis messages.

Every queued request and dispatched batch carries a traceparent so that a
request's path can be stitched into one trace across services. This module
only mints and continues context; exporting spans is the tracing layer's job.
"""
from __future__ import annotations

import random
import re

_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


def parse(traceparent: str) -> tuple[str, str, str] | None:
    """(trace_id, parent_span_id, flags), or None when absent or malformed."""
    m = _TRACEPARENT.match(traceparent.strip().lower()) if traceparent else None
    if not m or m.group(1) == "0" * 32 or m.group(2) == "0" * 16:
        return None
    return m.group(1), m.group(2), m.group(3)


def child(traceparent: str | None) -> str:
    """A traceparent for a new span: same trace and flags as `traceparent` if valid, else a new trace."""
    parsed = parse(traceparent or "")
    trace_id, flags = (parsed[0], parsed[2]) if parsed else (f"{random_id(128):032x}", "00")
    return f"00-{trace_id}-{random_id(64):016x}-{flags}"


def random_id(bits: int) -> int:
    """A random non-zero id of `bits` bits, from Python's generator (seeded from the OS at start)
    as OpenTelemetry's own id generator does: unique, not secret, and with no system call per id
    (os.urandom makes one)."""
    return random.getrandbits(bits) or 1


def trace_id(traceparent: str) -> str | None:
    parsed = parse(traceparent)
    return parsed[0] if parsed else None
