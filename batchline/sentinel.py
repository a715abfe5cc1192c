"""Redis behind Sentinel: the URL every service accepts for it, and clients that follow a failover.

    redis+sentinel://[user:password@]host:port[,host:port...]/MASTER[/DB][?options]
    rediss+sentinel://...   TLS to the sentinels and to the primary

`user:password` are the primary's (and its replicas') credentials; `sentinel_username` and
`sentinel_password` in the query are the sentinels' own, when they require one. Every other
query option is the plain URL's (`ssl_ca_certs`, `ssl_certfile`, `ssl_keyfile`, ...). A port
left out is Sentinel's 26379.

A client asks the sentinels for the primary's address whenever it opens a connection, so after a
failover its next connection goes to the promoted replica; a connection still open to a demoted
primary turns its writes' READONLY into a connection error (redis-py's SentinelManagedConnection).
"""
from __future__ import annotations

import time
import urllib.parse
from dataclasses import dataclass, field

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel as aiosentinel
import redis.sentinel
from redis.asyncio.connection import BlockingConnectionPool

from batchline import redis_url

SCHEMES = {"redis+sentinel": "redis", "rediss+sentinel": "rediss"}
DEFAULT_PORT = 26379
# Options in the query that are the sentinels' own credentials, not the primary's.
_SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password")


def is_sentinel(url: str) -> bool:
    return url.split("://", 1)[0].lower() in SCHEMES


@dataclass(frozen=True)
class SentinelTarget:
    sentinels: list[tuple[str, int]]
    master: str
    master_kwargs: dict = field(default_factory=dict)    # db, credentials and TLS options of the primary
    sentinel_kwargs: dict = field(default_factory=dict)  # credentials and TLS options of the sentinels

    def describe(self) -> str:
        """The sentinels and the master's name, without secrets: what messages may show."""
        return f"sentinels {','.join(f'{h}:{p}' for h, p in self.sentinels)} (master {self.master!r})"


def parse(url: str) -> SentinelTarget:
    """The sentinels, master name and connection options of a redis+sentinel:// URL; ValueError
    naming what is wrong with it."""
    parts = urllib.parse.urlsplit(url)
    scheme = SCHEMES.get(parts.scheme.lower())
    if scheme is None:
        raise ValueError(f"not a Sentinel URL (redis+sentinel:// or rediss+sentinel://): {parts.scheme}://")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    sentinels = redis_url.hosts(hosts, DEFAULT_PORT, "Sentinel URL")
    path = [p for p in parts.path.split("/") if p]
    if not path:
        raise ValueError("Sentinel URL names no master: redis+sentinel://HOST:PORT/MASTER[/DB]")
    if len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError(f"Sentinel URL path must be /MASTER or /MASTER/DB, not {parts.path!r}")
    query = urllib.parse.parse_qs(parts.query)
    own = {name: query.pop(name)[0] for name in _SENTINEL_OPTIONS if name in query}
    master_kwargs = redis_url.options(scheme, userinfo, "/" + (path[1] if len(path) == 2 else "0"),
                                      urllib.parse.urlencode(query, doseq=True))
    tls = {k: v for k, v in master_kwargs.items() if k.startswith("ssl_")}
    if scheme == "rediss":
        master_kwargs["ssl"] = True
    sentinel_kwargs = dict(tls, ssl=True) if scheme == "rediss" else {}
    if "sentinel_username" in own:
        sentinel_kwargs["username"] = own["sentinel_username"]
    if "sentinel_password" in own:
        sentinel_kwargs["password"] = own["sentinel_password"]
    return SentinelTarget(sentinels, path[0], master_kwargs, sentinel_kwargs)


# A pool asks the sentinels for the primary's address again when it hands out a connection this
# long after it last asked. A primary that was demoted rather than killed (a manual failover, or
# a dead primary back as a replica) still answers reads, so connections kept open to it must be
# dropped as soon as the sentinels name another: the pool closes them once they are idle.
REDISCOVER_S = 0.5


class _FollowingPool(aiosentinel.SentinelConnectionPool):
    _asked_at = 0.0

    async def get_connection(self, *args, **kwargs):
        now = time.monotonic()
        if now - self._asked_at >= REDISCOVER_S:
            self._asked_at = now
            try:
                await self.get_master_address()
            except aiosentinel.MasterNotFoundError:
                pass  # no primary now: connecting says so
        return await super().get_connection(*args, **kwargs)


class _FollowingBlockingPool(_FollowingPool, BlockingConnectionPool):
    """Like the plain URL's pool, a burst waits for a connection instead of failing with "too many
    connections"."""


def _socket(timeout: float | None, connect_timeout: float) -> dict:
    return {"socket_timeout": timeout, "socket_connect_timeout": connect_timeout}


def connect(url: str, timeout: float, max_connections: int, blocking_reads: bool = False) -> aioredis.Redis:
    """An asyncio client of the primary behind the sentinels of `url`. With `blocking_reads` its
    reads wait as long as a blocking wait may (redis_url.BLOCKING_WAIT_S) and a little longer; a
    connection still waits at most `timeout`."""
    target = parse(url)
    sentinel = aiosentinel.Sentinel(target.sentinels,
                                    sentinel_kwargs={**target.sentinel_kwargs, **_socket(timeout, timeout)})
    read_timeout = redis_url.blocking_read_timeout(timeout) if blocking_reads else timeout
    options = {**target.master_kwargs, **_socket(read_timeout, timeout)}
    if blocking_reads:
        return sentinel.master_for(target.master, connection_pool_class=_FollowingPool,
                                   max_connections=max_connections, **options)
    return sentinel.master_for(target.master, connection_pool_class=_FollowingBlockingPool,
                               max_connections=max_connections, timeout=timeout, **options)


def connect_sync(url: str, timeout: float) -> redis.Redis:
    """A synchronous client of the primary (command-line tools, tests)."""
    target = parse(url)
    sentinel = redis.sentinel.Sentinel(target.sentinels,
                                       sentinel_kwargs={**target.sentinel_kwargs, **_socket(timeout, timeout)})
    return sentinel.master_for(target.master, **target.master_kwargs, **_socket(timeout, timeout))


async def masters_known(url: str, timeout: float) -> tuple[int, bool]:
    """(how many sentinels answered, whether any of them knows the URL's master)."""
    target = parse(url)
    answered, known = 0, False
    for host, port in target.sentinels:
        client = aioredis.Redis(host=host, port=port, **target.sentinel_kwargs, **_socket(timeout, timeout))
        try:
            masters = await client.sentinel_masters()
        except (redis.exceptions.AuthenticationError, redis.exceptions.AuthorizationError):
            raise  # answered, refusing the credentials (both are ConnectionErrors): no retry helps
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as exc:
            if "CERTIFICATE_VERIFY_FAILED" in str(exc):
                raise  # answered, with a certificate this client does not trust: no retry helps
            continue
        finally:
            await client.aclose()
        answered += 1
        known = known or target.master in masters
    return answered, known
