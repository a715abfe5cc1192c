"""Wall-clock time shared across services.

Deadlines cross process (and host) boundaries inside Redis messages, so they
are absolute Unix-epoch microseconds; hosts are expected to be NTP-synced.
"""
from __future__ import annotations

import time


def now_us() -> int:
    return time.time_ns() // 1000
