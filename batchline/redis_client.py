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


def queue_script(pipe, script: str, keys: list, args: list) -> None:
    """Queue a Lua script on a pipeline as a plain EVAL.

    A redis-py Script object on a pipeline makes every execute() ask SCRIPT EXISTS
    first: one more round trip per pipeline. Redis caches an EVAL'd script under its
    SHA1 anyway, and a constant script of a few hundred bytes costs nothing to resend;
    it also survives a Redis restart, which empties the script cache.
    """
    pipe.eval(script, len(keys), *keys, *args)
