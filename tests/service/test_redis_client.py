"""The services' Redis connections parse replies in C (hiredis) and round-trip what they send."""
from __future__ import annotations

import asyncio

from redis.asyncio.connection import _AsyncHiredisParser

from batchline.redis_client import connect, connect_blocking


def test_connections_parse_replies_with_hiredis(redis_server):
    """hiredis is a dependency because it cut the services' CPU per request by about a tenth;
    redis-py drops to its Python parser, silently, when hiredis is missing or too old for it."""

    async def check() -> tuple[list[bool], list[bytes], tuple[bytes, list[bytes]]]:
        plain, blocking = connect(redis_server.url, 2.0), connect_blocking(redis_server.url, 2.0)
        try:
            async with plain.pipeline(transaction=False) as pipe:
                pipe.delete("t:hiredis")
                pipe.rpush("t:hiredis", b"\x00binary", "text", 3)
                pipe.lrange("t:hiredis", 0, -1)
                pipe.expire("t:hiredis", 10)
                *_, values, _ = await pipe.execute()
            popped = await blocking.execute_command("BLMPOP", 1, 1, "t:hiredis", "LEFT", "COUNT", 10)
            parsers = []
            for client in (plain, blocking):
                conn = await client.connection_pool.get_connection()
                parsers.append(isinstance(conn._parser, _AsyncHiredisParser))
                await client.connection_pool.release(conn)
            return parsers, values, popped
        finally:
            await plain.aclose()
            await blocking.aclose()

    parsers, values, popped = asyncio.run(check())
    assert parsers == [True, True]
    assert values == [b"\x00binary", b"text", b"3"]
    assert popped == [b"t:hiredis", [b"\x00binary", b"text", b"3"]]
