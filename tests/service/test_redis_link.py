"""The contract's lean connection (batchline.contract.link) against a real Redis: it answers as
redis-py does for the calls the stores send through it, maps errors to redis-py's classes, and
fails, drops and reconnects the way the services' outage handling expects."""
from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
import redis.exceptions
from redis.credentials import UsernamePasswordCredentialProvider

from batchline.contract.link import Link, hot
from batchline.embedded_redis import EmbeddedRedis
from batchline.redis_client import connect, connect_blocking

SCRIPT = "redis.call('RPUSH', KEYS[1], ARGV[1]); return {redis.call('LLEN', KEYS[1]), ARGV[1]}"


async def _blocked_in(client, command: str) -> None:
    """Until Redis shows a client blocked in `command` (5 s at most)."""
    for _ in range(500):
        if any(c.get("cmd") == command for c in await client.client_list()):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"no client was blocked in {command}")


@pytest.fixture(scope="module")
def locked_redis():
    """A Redis with a password, reached over its Unix socket: what `batchline up` gives its services."""
    with EmbeddedRedis(password="s3cret pass") as server:
        yield server


def test_a_link_answers_as_redis_py_does(locked_redis):
    url = locked_redis.unix_url.replace("db=0", "db=2")

    async def check() -> None:
        client = connect(url, 2.0)
        link = Link.of(client)
        assert link is not None and hot(client) is not client
        try:
            await client.delete("t:list", "t:z", "t:k", "t:n")
            first = await link.eval(SCRIPT, 1, "t:list", b"\x00a")
            second = await client.eval(SCRIPT, 1, "t:list", b"\x00b")
            assert (first[0] + 1, second[1]) == (second[0], b"\x00b")
            await client.execute_command("SCRIPT", "FLUSH")  # NOSCRIPT: sent whole, once
            assert (await link.eval(SCRIPT, 1, "t:list", b"c"))[0] == second[0] + 1

            for pipe in (link.pipeline(), client.pipeline(transaction=False)):
                async with pipe:
                    pipe.set("t:k", b"v", px=10_000)
                    pipe.zrem("t:z", "absent")
                    pipe.rpush("t:n", 1, 2)
                    pipe.eval("return ARGV[1]", 0, "x")
                    results = await pipe.execute()
                assert results[:2] == [True, 0] and results[3] == b"x"
            async with link.pipeline(transaction=True) as pipe:
                pipe.rpush("t:n", 3)
                pipe.pexpire("t:n", 10_000)
                assert await pipe.execute() == [5, 1]
            assert await link.mget(["t:k", "t:absent"]) == await client.mget(["t:k", "t:absent"]) == [b"v", None]
            assert await link.lpop("t:n", 2) == [b"1", b"2"] and await link.lpop("t:none", 2) is None
            # Concurrent callers on the one connection each get their own reply.
            assert sorted(await asyncio.gather(*(link.execute_command("INCR", "t:c") for _ in range(100)))) == \
                list(range(1, 101))
            # The database and the password of the URL: db 2 holds the writes, db 0 none of them.
            other = connect(locked_redis.unix_url, 2.0)
            assert await other.exists("t:k") == 0
            await other.aclose()

            with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
                await link.execute_command("LPUSH", "t:k", 1)
            with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):  # the first error, every reply read
                async with link.pipeline() as pipe:
                    pipe.rpush("t:k", 1)
                    pipe.set("t:after", 1)
                    await pipe.execute()
            assert await link.execute_command("GET", "t:after") == b"1"
        finally:
            await client.delete("t:list", "t:z", "t:k", "t:n", "t:c", "t:after")
            await link.aclose()
            await client.aclose()

    asyncio.run(check())


def test_a_pipeline_of_one_command_answers_a_list_as_redis_pys_does(redis_server):
    # A scheduler step that writes one thing sends a pipeline of one command.
    async def check() -> None:
        client = connect(redis_server.url, 2.0)
        link = Link.of(client)
        assert link is not None
        try:
            await client.delete("t1:n", "t1:k")
            for pipe in (link.pipeline(), client.pipeline(transaction=False)):
                async with pipe:
                    pipe.rpush("t1:n", 1)
                    assert len(await pipe.execute()) == 1
            assert await client.llen("t1:n") == 2
            async with link.pipeline() as pipe:
                pipe.set("t1:k", b"v", px=10_000)
                assert await pipe.execute() == [True]
            with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
                async with link.pipeline() as pipe:
                    pipe.rpush("t1:k", 1)
                    await pipe.execute()
        finally:
            await client.delete("t1:n", "t1:k")
            await link.aclose()
            await client.aclose()

    asyncio.run(check())


def test_a_wrong_password_is_redis_pys_error(locked_redis):
    async def check() -> None:
        client = connect(locked_redis.url.replace("s3cret%20pass", "wrong"), 2.0)
        link = Link.of(client)
        assert link is not None
        with pytest.raises(redis.exceptions.AuthenticationError):
            await link.execute_command("PING")
        await client.aclose()

    asyncio.run(check())


def test_only_one_plain_redis_gets_a_link(redis_server):
    async def check() -> None:
        clients = [aioredis.Redis.from_url("rediss://127.0.0.1:1/0"),  # TLS: redis-py's certificates
                   aioredis.Redis(host="127.0.0.1", port=redis_server.port,
                                  credential_provider=UsernamePasswordCredentialProvider("u", "p"))]
        for client in clients:
            assert Link.of(client) is None and hot(client) is client
            await client.aclose()
        assert Link.of(None) is None

    asyncio.run(check())


def test_a_reply_later_than_the_timeout_fails_everything_behind_it_and_the_link_reconnects(redis_server):
    async def check() -> None:
        client = connect(redis_server.url, 2.0)
        link = Link.of(client, timeout=0.3)
        assert link is not None
        try:
            # A pop that never answers, then a command behind it on the same connection.
            blocked = asyncio.ensure_future(link.execute_command("BLPOP", "t:never", 0))
            behind = asyncio.ensure_future(link.execute_command("PING"))
            for call in (blocked, behind):
                with pytest.raises(redis.exceptions.TimeoutError):
                    await call
            assert await link.execute_command("PING") == b"PONG"
        finally:
            await link.aclose()
            await client.aclose()

    asyncio.run(check())


def test_a_cancelled_wait_drops_its_connection_and_pops_nothing(redis_server):
    async def check() -> None:
        client, blocking = connect(redis_server.url, 2.0), connect_blocking(redis_server.url, 2.0)
        link = Link.of(blocking)
        assert link is not None
        try:
            await client.delete("t:wait")
            wait = asyncio.ensure_future(link.wait(30, "BLMPOP", 20, 1, "t:wait", "LEFT", "COUNT", 10))
            await _blocked_in(client, "blmpop")
            wait.cancel()
            with pytest.raises(asyncio.CancelledError):
                await wait
            # Not behind the abandoned pop (20 s): on a connection of its own, at once.
            assert await asyncio.wait_for(link.execute_command("PING"), 5) == b"PONG"
            await client.rpush("t:wait", b"kept")
            assert await link.wait(5, "BLMPOP", 1, 1, "t:wait", "LEFT", "COUNT", 10) == [b"t:wait", [b"kept"]]
        finally:
            await client.delete("t:wait")
            await link.aclose()
            await client.aclose()
            await blocking.aclose()

    asyncio.run(check())


def test_a_lost_redis_fails_what_it_had_not_answered_and_a_restarted_one_serves(tmp_path):
    async def check(server: EmbeddedRedis) -> None:
        client = connect(server.url, 2.0)
        link = Link.of(client)
        assert link is not None
        try:
            assert await link.execute_command("SET", "t:gone", 1) == b"OK"
            wait = asyncio.ensure_future(link.wait(30, "BLPOP", "t:never", 20))
            await _blocked_in(client, "blpop")
            server.stop(kill=True)
            with pytest.raises(redis.exceptions.ConnectionError):
                await wait
            with pytest.raises(redis.exceptions.ConnectionError):  # nobody listens: refused, not hung
                await link.execute_command("PING")
            server.start()
            assert await link.execute_command("GET", "t:gone") is None  # a new, empty Redis
        finally:
            await link.aclose()
            await client.aclose()

    with EmbeddedRedis() as server:
        asyncio.run(check(server))


def test_a_link_used_under_a_new_event_loop_reconnects_there(redis_server):
    """A store outlives an `asyncio.run` in tools and tests: its connection belonged to the loop
    that made it."""
    client = connect(redis_server.url, 2.0)
    link = Link.of(client)
    assert link is not None
    for value in (b"1", b"2"):
        assert asyncio.run(link.execute_command("SET", "t:loops", value)) == b"OK"
        assert asyncio.run(link.execute_command("GET", "t:loops")) == value
    asyncio.run(link.execute_command("DEL", "t:loops"))
    asyncio.run(link.aclose())


def test_a_cancelled_connect_fails_the_callers_waiting_on_it_with_a_connection_error():
    """Two calls on a fresh Link share its connecting; the first is cancelled while the server has
    not answered its AUTH (a server that reads and never replies): the second hears of a failed
    connection, which the services treat as an outage, not of a cancellation it never asked for."""

    async def check() -> None:
        heard = asyncio.Event()

        class Silent(asyncio.Protocol):
            def data_received(self, data: bytes) -> None:
                heard.set()

        server = await asyncio.get_running_loop().create_server(Silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        link = Link({"host": "127.0.0.1", "port": port, "password": "x"}, timeout=30)
        first = asyncio.ensure_future(link.execute_command("PING"))
        second = asyncio.ensure_future(link.execute_command("PING"))
        await asyncio.wait_for(heard.wait(), 10)  # the AUTH was sent: both wait on the one connecting
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        with pytest.raises(redis.exceptions.ConnectionError):
            await second
        await link.aclose()
        server.close()
        await server.wait_closed()

    asyncio.run(check())


def test_eval_now_writes_its_command_before_it_returns(redis_server):
    """What the gateway's group commit sends in the middle of a turn of the event loop must reach
    Redis then, not when the loop next runs; before the connection is open nothing is sent."""
    import redis as sync_redis

    from batchline.testing.polling import poll

    sync = sync_redis.Redis.from_url(redis_server.url)
    sync.delete("t:now")

    async def check() -> None:
        client = connect(redis_server.url, 2.0)
        link = Link.of(client)
        assert link is not None
        try:
            assert link.eval_now(SCRIPT, 1, "t:now", b"a") is None
            assert await link.eval(SCRIPT, 1, "t:now", b"a") == [1, b"a"]  # opened, and the script loaded
            sent = link.eval_now(SCRIPT, 1, "t:now", b"b")
            assert sent is not None
            # A blocking wait: the event loop stands still, so only a command already written counts.
            poll(lambda: sync.llen("t:now") == 2, 5, "the script to have run")
            assert await sent == [2, b"b"]
            sync.script_flush()  # NOSCRIPT: sent whole, as eval does
            assert await link.eval_now(SCRIPT, 1, "t:now", b"c") == [3, b"c"]  # type: ignore[misc]
        finally:
            await link.aclose()
            await client.aclose()

    try:
        asyncio.run(check())
    finally:
        sync.delete("t:now")
