"""When a missing heartbeat says its owner died.

Gateways and executors keep a key alive in Redis by beating; a key that is gone says its owner
stopped, and the others act on it: an executor skips a dead gateway's requests (nobody waits for
their answers), the scheduler hands a dead executor's batches back to their queues. Right after
Redis was away that reading is wrong. During an outage or a failover no beat lands, so keys expire
(a promoted replica expires them too) while their owners live; a live owner beats again within
its interval once Redis answers (1 s by default; its key lives 3). For GRACE_S after the last sign
of trouble, a missing heartbeat says nothing yet.
"""
from __future__ import annotations

import time
from typing import Callable

GRACE_S = 5.0


class HeartbeatTrust:
    """Whether a missing heartbeat may be read as a death now. `clock` is monotonic seconds."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.trouble_at = float("-inf")

    def redis_trouble(self) -> None:
        """Redis failed a call, went away, came back or changed primary."""
        self.trouble_at = self._clock()

    def heartbeats_tell(self) -> bool:
        return self._clock() - self.trouble_at > GRACE_S
