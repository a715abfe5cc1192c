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


def test_a_wait_that_redis_ends_unblocked_is_an_outage_not_a_refusal(redis_server):
    """A primary demoted under a blocking wait ends it `-UNBLOCKED`, as CLIENT UNBLOCK ... ERROR
    does: the wait fails as a connection error (retried as one), and it keeps BLMPOP (a refusal
    of an unknown command is what turns to BLPOP)."""
    import redis.exceptions

    from batchline.contract.waits import ListPop

    async def run() -> None:
        blocking, client = connect_blocking(redis_server.url, 2), connect(redis_server.url, 2)
        try:
            pop = ListPop(blocking)
            wait = asyncio.ensure_future(pop(["test:unblocked"], 10, timeout=10))
            blocked: list = []
            for _ in range(200):
                blocked = [c for c in await client.client_list() if c.get("cmd") == "blmpop"]
                if blocked:
                    break
                await asyncio.sleep(0.01)
            assert blocked, "the wait never blocked"
            await client.execute_command("CLIENT", "UNBLOCK", blocked[0]["id"], "ERROR")
            try:
                await wait
            except redis.exceptions.ConnectionError as exc:
                assert "UNBLOCKED" in str(exc)
            else:
                raise AssertionError("the ended wait returned")
            assert pop.all_at_once
        finally:
            await blocking.aclose()
            await client.aclose()

    asyncio.run(run())


def test_sentinels_that_refuse_their_password_stop_the_service_at_start():
    """The sentinels' own password wrong (sentinel_password=): refused as credentials at start, as
    the primary's are, not taken for sentinels that cannot be reached (kept trying for ever)."""
    import pytest

    from batchline.embedded_redis import EmbeddedRedis
    from batchline.redis_client import RedisAccessError, check_access

    # A password-protected Redis in the sentinels' place: the refusal comes at AUTH, before any command.
    with EmbeddedRedis(password="the-right-secret") as guarded:
        url = f"redis+sentinel://127.0.0.1:{guarded.port}/mymaster?sentinel_password=a-wrong-secret"
        with pytest.raises(RedisAccessError, match="refuse the credentials"):
            asyncio.run(check_access(url, 2))


def test_a_blocking_client_holds_a_connection_for_each_wait_it_is_sized_for(redis_server):
    """An executor lane's batch workers each wait for work on a connection of their own: more of
    them than the default pool would leave the rest retrying for ever."""
    client = connect_blocking(redis_server.url, 2, waits=12)
    try:
        assert client.connection_pool.max_connections == 12
        assert connect_blocking(redis_server.url, 2).connection_pool.max_connections == 8
    finally:
        asyncio.run(client.aclose())


def test_a_blocking_wait_on_a_server_that_never_answers_times_out():
    """A primary gone without closing its connections (its host lost): a blocking wait's read
    times out a little past the longest wait, instead of holding the connection for ever."""
    import socket
    import time

    import pytest
    import redis.exceptions

    from batchline.contract.waits import ListPop
    from batchline.redis_url import blocking_read_timeout

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts (in the kernel's backlog) and never answers a byte

    async def run() -> float:
        client = connect_blocking(f"redis://127.0.0.1:{silent.getsockname()[1]}", 0.5)
        began = time.monotonic()
        try:
            with pytest.raises(redis.exceptions.TimeoutError):
                await ListPop(client)(["never"], 1)
        finally:
            await client.aclose()
        return time.monotonic() - began

    try:
        assert asyncio.run(run()) < blocking_read_timeout(0.5) + 5  # bounded: the read gave up
    finally:
        silent.close()


def test_a_wait_refused_readonly_is_an_outage():
    """A URL whose address is a replica now (its primary demoted): READONLY ends the wait as a
    failover would, to be tried again, not as an error that ends the reader."""
    import redis.exceptions

    from batchline.contract.waits import as_outage

    assert isinstance(as_outage(redis.exceptions.ReadOnlyError("You can't write against a read only replica.")),
                      redis.exceptions.ConnectionError)
    assert isinstance(as_outage(redis.exceptions.ResponseError("UNBLOCKED force unblock")),
                      redis.exceptions.ConnectionError)
    other = redis.exceptions.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value")
    assert as_outage(other) is other
