"""A lean connection to one Redis for the calls on every request's path.

redis-py spends about 100 µs of its caller's CPU on a round trip that a bare asyncio protocol
makes in 15 (its pool, retry, event and observability layers run in Python on every command:
benchmarks/redis_client.py), and the mesh makes about fifteen round trips a batch. A `Link` is one
connection, shared by every coroutine of a service: commands are written as they come, replies
matched to them in order (hiredis parses them, redis-py's own table maps error replies to its
exception classes), so it is pipelined without a pool. It serves what the stores' hot calls use:
single commands, scripts and pipelines of them; a blocking pop gets a Link of its own.

It talks to one plain Redis (redis:// or unix://, with a password and a database). Sentinel,
Cluster and TLS clients keep redis-py, which knows their failover, slots and certificates: `hot`
hands such a client back as it is. Failures are redis-py's exception classes (a lost connection
`ConnectionError`, a reply later than the timeout `TimeoutError`, which also drops the connection),
so the callers' handling of `REDIS_ERRORS` is unchanged; a Link reconnects at its next command and
retries nothing itself.
"""
from __future__ import annotations

import asyncio
import collections
import hashlib
import time
from typing import Any, Awaitable, Sequence

import hiredis
import redis.asyncio as aioredis
import redis.exceptions
from redis._parsers.base import BaseParser
from redis.asyncio.connection import Connection, UnixDomainSocketConnection

_pack = hiredis.pack_command


class _Protocol(asyncio.Protocol):
    def __init__(self, link: Link) -> None:
        self.link = link
        self.reader = hiredis.Reader(protocolError=redis.exceptions.InvalidResponse,
                                     replyError=BaseParser.parse_error)

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        answer = self.link._answer
        while (reply := self.reader.gets()) is not False:
            answer(self, reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.link._lost(self, redis.exceptions.ConnectionError(
            f"Connection to Redis at {self.link.where} lost{f': {exc}' if exc else ''}"))


class Link:
    """One connection to the Redis of `kwargs` (redis-py's connection options); replies later than
    `timeout` seconds (per command: `wait`'s own) drop it."""

    def __init__(self, kwargs: dict, timeout: float) -> None:
        self._path = kwargs.get("path")
        self._host, self._port = kwargs.get("host", "localhost"), int(kwargs.get("port", 6379))
        self._hello: list[tuple] = []
        if kwargs.get("password") is not None:
            user = kwargs.get("username")
            self._hello.append(("AUTH", user, kwargs["password"]) if user else ("AUTH", kwargs["password"]))
        if int(kwargs.get("db") or 0):
            self._hello.append(("SELECT", int(kwargs["db"])))
        self.where = self._path or f"{self._host}:{self._port}"
        self.timeout = timeout
        self._connect_timeout = kwargs.get("socket_connect_timeout") or timeout
        self._protocol: _Protocol | None = None
        # The connection's loop: a store used under another loop (a new asyncio.run) reconnects there.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._transport: asyncio.Transport | None = None
        self._opening: asyncio.Future | None = None
        # Per command or pipeline written and not yet answered, in order: [future, replies expected
        # (None: one command, answered by its reply alone), replies so far, when it times out].
        self._pending: collections.deque[list] = collections.deque()
        self._watch: asyncio.TimerHandle | None = None
        self._sha: dict[str, tuple[bytes, bytes]] = {}  # script text -> (its SHA1, its bytes)

    @classmethod
    def of(cls, client: Any, timeout: float | None = None) -> Link | None:
        """A Link to the Redis `client` (an asyncio redis-py client) talks to, if that is one plain
        Redis; `timeout`: its own (a blocking wait's client's is longer than its commands')."""
        pool = getattr(client, "connection_pool", None)
        if not isinstance(client, aioredis.Redis) or pool is None or \
                pool.connection_class not in (Connection, UnixDomainSocketConnection):
            return None
        kwargs = pool.connection_kwargs
        if kwargs.get("credential_provider") is not None:
            return None
        return cls(kwargs, timeout or kwargs.get("socket_timeout") or 5.0)

    # -- commands -------------------------------------------------------------------------------

    async def execute_command(self, *args: Any) -> Any:
        return await self._send(_pack(args), None, self.timeout)

    async def wait(self, timeout: float, *args: Any) -> Any:
        """A blocking command, whose reply may take up to `timeout` seconds. Cancelled, it drops the
        connection, which ends the wait in Redis: its reply would otherwise hold up the next command.
        What it had popped and not yet delivered is lost, as with redis-py, whose cancelled read
        drops its connection too."""
        try:
            return await self._send(_pack(args), None, timeout)
        except asyncio.CancelledError:
            self._drop(redis.exceptions.ConnectionError("the wait was cancelled"))
            raise

    async def eval(self, script: str, numkeys: int, *keys_and_args: Any) -> Any:
        """The script by its SHA1, sent whole only when this Redis does not have it (NOSCRIPT: it ran nothing)."""
        sent = self.eval_now(script, numkeys, *keys_and_args)
        if sent is None:
            await self._connected()
            sent = self.eval_now(script, numkeys, *keys_and_args)
            if sent is None:
                raise redis.exceptions.ConnectionError(f"Connection to Redis at {self.where} lost")
        return await sent

    def eval_now(self, script: str, numkeys: int, *keys_and_args: Any) -> Awaitable[Any] | None:
        """`eval`, written to the connection before this returns; None, with nothing sent, where the
        connection must be opened first. A caller sends in the middle of its turn of the event loop,
        ahead of the tasks already scheduled, and awaits the reply later (or leaves that to a task)."""
        transport = self._transport
        if transport is None or not self.is_open():
            return None
        sha, text = self._script(script)
        sent = self._write(asyncio.get_running_loop(), transport, _pack(("EVALSHA", sha, numkeys, *keys_and_args)),
                           None, self.timeout)
        return self._evalsha_reply(sent, text, numkeys, keys_and_args)

    async def _evalsha_reply(self, sent: asyncio.Future, text: bytes, numkeys: int, keys_and_args: tuple) -> Any:
        try:
            return await sent
        except redis.exceptions.NoScriptError:
            return await self._send(_pack(("EVAL", text, numkeys, *keys_and_args)), None, self.timeout)

    def mget(self, names: Sequence[str]) -> Any:
        return self.execute_command("MGET", *names)

    def lpop(self, name: str, count: int | None = None) -> Any:
        return self.execute_command("LPOP", name) if count is None else self.execute_command("LPOP", name, count)

    def pipeline(self, transaction: bool = False) -> Pipe:
        return Pipe(self, transaction)

    async def aclose(self) -> None:
        self._drop(redis.exceptions.ConnectionError("the client was closed"))

    # -- the connection -------------------------------------------------------------------------

    def _script(self, script: str) -> tuple[bytes, bytes]:
        found = self._sha.get(script)
        if found is None:
            text = script.encode()
            found = self._sha[script] = (hashlib.sha1(text).hexdigest().encode(), text)
        return found

    async def _send(self, packed: bytes, replies: int | None, timeout: float) -> Any:
        transport = await self._connected()
        return await self._write(asyncio.get_running_loop(), transport, packed, replies, timeout)

    def is_open(self) -> bool:
        """Whether a command can be written at once: the connection is open, on this event loop."""
        transport = self._transport
        return transport is not None and self._loop is asyncio.get_running_loop() and not transport.is_closing()

    async def _connected(self) -> asyncio.Transport:
        """The connection, opened first if it is not (on this event loop)."""
        if not self.is_open():
            await self._open()
        if self._transport is None:
            raise redis.exceptions.ConnectionError(f"Connection to Redis at {self.where} lost")
        return self._transport

    def _write(self, loop: asyncio.AbstractEventLoop, transport: asyncio.Transport, packed: bytes,
               replies: int | None, timeout: float) -> asyncio.Future:
        """Send `packed`, which `replies` replies answer as a list (None: one command, whose reply
        resolves the future alone, an error raised); the future, watched for `timeout`."""
        future = loop.create_future()
        self._pending.append([future, replies, [], time.monotonic() + timeout])
        transport.write(packed)
        if self._watch is None:
            self._watch = loop.call_later(timeout, self._check)
        return future

    async def _open(self) -> None:
        if self._opening is not None:
            return await asyncio.shield(self._opening)
        self._drop(redis.exceptions.ConnectionError(f"Connection to Redis at {self.where} closed"))
        loop = asyncio.get_running_loop()
        self._opening = loop.create_future()
        try:
            protocol = _Protocol(self)
            if self._path:
                made = loop.create_unix_connection(lambda: protocol, self._path)
            else:
                made = loop.create_connection(lambda: protocol, self._host, self._port)
            try:
                transport, _ = await asyncio.wait_for(made, self._connect_timeout)
            except asyncio.TimeoutError:
                raise redis.exceptions.TimeoutError(f"Timeout connecting to Redis at {self.where}") from None
            except OSError as exc:
                raise redis.exceptions.ConnectionError(f"Error connecting to Redis at {self.where}: {exc}") from None
            self._protocol, self._transport, self._loop = protocol, transport, loop
            for command in self._hello:
                await self._write(loop, transport, _pack(command), None, self.timeout)
            self._opening.set_result(None)
        except BaseException as exc:
            if self._transport is not None:
                self._transport.close()
            # The callers waiting on this opening were not cancelled themselves: they hear of a failure.
            failure = redis.exceptions.ConnectionError(f"Connecting to Redis at {self.where} was cancelled") \
                if isinstance(exc, asyncio.CancelledError) else exc
            self._opening.set_exception(failure)
            self._opening.exception()  # retrieved: a caller that waited on it has it raised
            raise
        finally:
            self._opening = None

    def _answer(self, protocol: _Protocol, reply: Any) -> None:
        if protocol is not self._protocol or not self._pending:
            return
        entry = self._pending[0]
        if entry[1] is None:
            self._pending.popleft()
            future = entry[0]
            if not future.done():
                if isinstance(reply, redis.exceptions.RedisError):
                    future.set_exception(reply)
                else:
                    future.set_result(reply)
            return
        entry[2].append(reply)
        if len(entry[2]) == entry[1]:
            self._pending.popleft()
            if not entry[0].done():
                entry[0].set_result(entry[2])

    def _lost(self, protocol: _Protocol, exc: Exception) -> None:
        if protocol is not self._protocol:
            return
        self._protocol = self._transport = None
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        pending, self._pending = self._pending, collections.deque()
        for entry in pending:
            if not entry[0].done():
                entry[0].set_exception(exc)

    def _check(self) -> None:
        """The oldest command's timeout: past, the connection goes (as redis-py's socket timeout drops it)."""
        self._watch = None
        if not self._pending:
            return
        late = self._pending[0][3] - time.monotonic()
        if late > 0:
            self._watch = asyncio.get_running_loop().call_later(late, self._check)
            return
        self._drop(redis.exceptions.TimeoutError(f"Timeout reading from Redis at {self.where}"))

    def _drop(self, exc: Exception) -> None:
        """Close the connection, failing what it has not answered with `exc`."""
        protocol, transport = self._protocol, self._transport
        if protocol is not None:
            self._lost(protocol, exc)
        if transport is not None:
            try:
                transport.close()
            except RuntimeError:  # its loop is closed: the socket went with it
                pass


class Pipe:
    """Commands sent in one write and answered in one read, as redis-py's pipeline (the first error
    raised once every reply is in); with `transaction`, in MULTI/EXEC."""

    def __init__(self, link: Link, transaction: bool) -> None:
        self._link = link
        self._transaction = transaction
        self._commands: list[tuple] = []

    async def __aenter__(self) -> Pipe:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._commands = []

    def __len__(self) -> int:
        return len(self._commands)

    def execute_command(self, *args: Any) -> Pipe:
        self._commands.append(args)
        return self

    def eval(self, script: str, numkeys: int, *keys_and_args: Any) -> Pipe:
        # The whole text: a NOSCRIPT inside a pipeline would fail one command among others that ran.
        return self.execute_command("EVAL", self._link._script(script)[1], numkeys, *keys_and_args)

    def set(self, name: str, value: Any, px: int | None = None, ex: int | None = None) -> Pipe:
        extra = ("PX", px) if px is not None else ("EX", ex) if ex is not None else ()
        return self.execute_command("SET", name, value, *extra)

    def zrem(self, name: str, *members: Any) -> Pipe:
        return self.execute_command("ZREM", name, *members)

    def rpush(self, name: str, *values: Any) -> Pipe:
        return self.execute_command("RPUSH", name, *values)

    def pexpire(self, name: str, ms: int) -> Pipe:
        return self.execute_command("PEXPIRE", name, ms)

    async def execute(self) -> list[Any]:
        commands, self._commands = self._commands, []
        if not commands:
            return []
        if self._transaction:
            commands = [("MULTI",), *commands, ("EXEC",)]
        packed = b"".join(_pack(c) for c in commands)
        replies = await self._link._send(packed, len(commands), self._link.timeout)
        if self._transaction:
            for reply in replies[:-1]:  # MULTI's OK and QUEUED, or an error queueing a command
                if isinstance(reply, redis.exceptions.RedisError):
                    raise reply
            replies = replies[-1]
            if replies is None:
                raise redis.exceptions.WatchError("the transaction was aborted")
        for reply in replies:
            if isinstance(reply, redis.exceptions.RedisError):
                raise reply
        return [True if reply == b"OK" and command[0] == "SET" else reply
                for command, reply in zip(commands[1:-1] if self._transaction else commands, replies)]


def hot(client: Any) -> Any:
    """What a store sends its calls on every request's path through: a Link to `client`'s Redis, or
    `client` itself where that is not one plain Redis."""
    return Link.of(client) or client
