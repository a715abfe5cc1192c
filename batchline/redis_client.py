"""Redis connections with the timeouts every service needs.

A command that hangs is worse than one that fails: with a socket timeout a
dead Redis turns into an Unavailable error within `timeout` seconds.
Blocking reads (BLMPOP, BLPOP) get their own connection, whose reads time out a little after the
longest wait (batchline.redis_url.BLOCKING_WAIT_S): a Redis lost without closing its sockets must
not hold them for good, at the price of an element popped in a stall of more than that being lost
(a reply: its request is answered DEADLINE_EXCEEDED; a batch: the orphan sweep hands it back). A URL names one
Redis (redis://), a primary behind Sentinel (batchline.sentinel) or a Redis Cluster
(batchline.cluster).
"""
from __future__ import annotations

import urllib.parse

import redis.asyncio as aioredis
import redis.exceptions

from batchline import cluster, redis_url, sentinel

# What a lost or stalled Redis raises: callers turn these into UNAVAILABLE or retry.
# On a cluster, a shard without a primary (until its replica is promoted) and a slot being moved
# pass the same way, and so does a client that reached no node at all (the cluster client raises
# that as a ConnectionError: batchline.cluster).
REDIS_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError,
                redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError,
                redis.exceptions.SlotNotCoveredError)
# Redis answered, but refused a write for a state of its own that passes (maxmemory reached, a
# replica during a failover): the caller may retry, as after an outage.
REDIS_REFUSALS = (redis.exceptions.OutOfMemoryError, redis.exceptions.ReadOnlyError)
# After a blocking wait failed on Redis (the scheduler's for events, an executor's for work, a
# gateway's for replies) or a scheduling step did, the next begins this much later: each is on
# every request's path, and a promoted replica serves at once.
WAIT_RETRY_S = 0.2


def unreachable(exc: BaseException) -> str:
    """What a client is told of a Redis outage: its kind, not the text of the error, which names
    the Redis's host and port (the service's own log and metrics have those)."""
    return f"Redis is unreachable ({type(exc).__name__})"


class RedisAccessError(Exception):
    """Redis answered but will not serve this service: wrong credentials, or a TLS certificate that
    cannot be verified. Retrying cannot help, so the service stops with this message."""


def mask(url: str) -> str:
    """`url` with its passwords (the server's, in its user part or as an option, a TLS key's
    ssl_password, a Sentinel URL's sentinel_password) replaced by ***: what messages and logs may show."""
    parts = urllib.parse.urlsplit(url)
    if "password" in parts.query.lower():  # password=, ssl_password= (a key's passphrase), sentinel_password=
        query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
        parts = parts._replace(query=urllib.parse.urlencode(
            [(k, "***" if "password" in k.lower() else v) for k, v in query], safe="*/"))
    if parts.password is not None:
        host = parts.netloc.rsplit("@", 1)[1]
        parts = parts._replace(netloc=f"{parts.username or ''}:***@{host}")
    return urllib.parse.urlunsplit(parts)


def _refused(url: str, exc: Exception) -> RedisAccessError:
    return RedisAccessError(f"Redis at {mask(url)} refuses the credentials: {exc}")


async def check_access(url: str, timeout: float) -> None:
    """Raise RedisAccessError if the Redis at `url` refuses this client for good (credentials,
    TLS, or sentinels that know no master of the URL's name); a Redis that cannot be reached is
    left to the service, which keeps trying."""
    if sentinel.is_sentinel(url):
        try:
            answered, known = await sentinel.masters_known(url, timeout)
        except (redis.exceptions.AuthenticationError, redis.exceptions.AuthorizationError) as exc:
            raise RedisAccessError(f"the sentinels of {mask(url)} refuse the credentials: {exc}") from None
        except redis.exceptions.ResponseError as exc:
            if "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
                raise RedisAccessError(f"the sentinels of {mask(url)} refuse the credentials: {exc}") from None
            raise
        except REDIS_ERRORS as exc:
            raise RedisAccessError(f"cannot verify the TLS certificate of the sentinels of {mask(url)}: "
                                   f"{exc}") from None
        if answered and not known:
            target = sentinel.parse(url)
            raise RedisAccessError(f"no sentinel of {mask(url)} monitors a master named {target.master!r}: "
                                   "check the master name (SENTINEL MASTERS lists them)")
        if not answered:
            return
        client = sentinel.connect(url, timeout, max_connections=1)
    elif cluster.is_cluster_url(url):
        target = cluster.parse(url)
        host, port = target.nodes[0]
        client = aioredis.Redis(host=host, port=port, **cluster.timeouts(target, timeout))
    else:
        client = aioredis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    try:
        await client.ping()
        clustered = int((await client.info("cluster")).get("cluster_enabled", 0))
        if cluster.is_cluster_url(url):
            if not clustered:
                raise RedisAccessError(f"{mask(url)} names a Redis that is not a Redis Cluster node: "
                                       "give a single Redis as redis://HOST:PORT")
            problem = cluster.coverage_problem(cluster_info_fields(await client.execute_command("CLUSTER INFO")))
            if problem:
                raise RedisAccessError(f"the Redis Cluster at {mask(url)} cannot serve: {problem}")
        elif clustered:
            # A plain client would be refused (MOVED, CROSSSLOT) request by request: say so once, at start.
            raise RedisAccessError(f"Redis at {mask(url)} is a Redis Cluster node: name the cluster as "
                                   "redis+cluster://HOST:PORT[,HOST:PORT...]")
    except (redis.exceptions.AuthenticationError, redis.exceptions.AuthorizationError) as exc:
        raise _refused(url, exc) from None
    except redis.exceptions.ResponseError as exc:
        if "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
            raise _refused(url, exc) from None
        raise
    except REDIS_ERRORS as exc:
        if "CERTIFICATE_VERIFY_FAILED" in str(exc) or "SSL" in str(exc):
            raise RedisAccessError(f"cannot verify the TLS certificate of Redis at {mask(url)}: {exc}") from None
    finally:
        await client.aclose()


def cluster_info_fields(info) -> dict:
    """CLUSTER INFO's answer as a dict (redis-py parses it or not, by version and protocol)."""
    if isinstance(info, dict):
        return {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
                for k, v in info.items()}
    text = info.decode() if isinstance(info, bytes) else str(info)
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def connect(url: str, timeout: float) -> aioredis.Redis:
    if cluster.is_cluster_url(url):
        return cluster.connect(url, timeout)
    if sentinel.is_sentinel(url):
        return sentinel.connect(url, timeout, max_connections=64)
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


def connect_blocking(url: str, timeout: float, waits: int = 8) -> aioredis.Redis:
    """For BLPOP-style waits: the read may last as long as the wait itself. `waits`: how many the
    caller may have under way at once (each holds a connection)."""
    if cluster.is_cluster_url(url):
        return cluster.connect(url, timeout, blocking_reads=True)
    if sentinel.is_sentinel(url):
        return sentinel.connect(url, timeout, max_connections=max(8, waits), blocking_reads=True)
    return aioredis.Redis.from_url(
        url,
        socket_timeout=redis_url.blocking_read_timeout(timeout),
        socket_connect_timeout=timeout,
        max_connections=max(8, waits),
    )


def connect_sync(url: str, timeout: float) -> redis.Redis:
    """A synchronous client, for command-line tools and test harnesses."""
    if cluster.is_cluster_url(url):
        return cluster.connect_sync(url, timeout)
    if sentinel.is_sentinel(url):
        return sentinel.connect_sync(url, timeout)
    return redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
