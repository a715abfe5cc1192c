"""Redis connections with the timeouts every service needs.

A command that hangs is worse than one that fails: with a socket timeout a
dead Redis turns into an Unavailable error within `timeout` seconds.
Blocking reads (BLPOP) get their own connection without a read timeout.
"""
from __future__ import annotations

import redis.asyncio as aioredis
import redis.exceptions

# What a lost or stalled Redis raises: callers turn these into UNAVAILABLE or retry.
REDIS_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


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

