"""Redis Cluster: the URL every service accepts for one, and its clients.

    redis+cluster://[user:password@]host:port[,host:port...][?options]
    rediss+cluster://...   TLS to every node

The nodes listed are where a client starts: it learns the rest of the cluster (every shard's
primary and the slots it holds) from them and follows the cluster's redirections after a
resharding or a failover. Query options are the plain URL's (`ssl_ca_certs`, `ssl_certfile`,
...). A port left out is 6379. What batchline writes where on a cluster:
batchline.contract.keys (the hash tags) and batchline.contract.slots.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import urllib.parse
from typing import AsyncIterator
from dataclasses import dataclass, field

import redis.asyncio.cluster as aiocluster
import redis.cluster
import redis.exceptions

from batchline import redis_url

SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
DEFAULT_PORT = 6379
SLOTS = 16_384


def is_cluster_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() in SCHEMES


@dataclass(frozen=True)
class ClusterTarget:
    nodes: list[tuple[str, int]]
    kwargs: dict = field(default_factory=dict)  # credentials and TLS options of every node

    def describe(self) -> str:
        """The nodes, without secrets: what messages may show."""
        return "Redis Cluster at " + ",".join(f"{h}:{p}" for h, p in self.nodes)


def parse(url: str) -> ClusterTarget:
    """The start-up nodes and connection options of a redis+cluster:// URL; ValueError naming
    what is wrong with it."""
    parts = urllib.parse.urlsplit(url)
    scheme = SCHEMES.get(parts.scheme.lower())
    if scheme is None:
        raise ValueError(f"not a Redis Cluster URL (redis+cluster:// or rediss+cluster://): {parts.scheme}://")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    nodes = redis_url.hosts(hosts, DEFAULT_PORT, "Redis Cluster URL")
    if parts.path.strip("/") not in ("", "0"):
        raise ValueError(f"a Redis Cluster has only database 0, not {parts.path!r}")
    kwargs = redis_url.options(scheme, userinfo, "", parts.query)
    kwargs.pop("db", None)
    if scheme == "rediss":
        kwargs["ssl"] = True
    return ClusterTarget(nodes, kwargs)


# Commands and pipelines one client has under way at once: below redis-py's connections per node
# (100; fewer if the URL's max_connections says so), past which it fails a command with
# MaxConnectionsError instead of making it wait as the other URLs' pools do.
CONCURRENT_COMMANDS = 64
# What redis-py says when it reached no node of the cluster at all (every node away).
_UNREACHABLE = "Redis Cluster cannot be connected"
# Set while a gated call is under way: a call it makes itself is not gated again.
_gated: contextvars.ContextVar[bool] = contextvars.ContextVar("batchline_cluster_gated", default=False)


@contextlib.asynccontextmanager
async def outage_as_connection_error() -> AsyncIterator[None]:
    """redis-py's "cannot be connected" (no node reachable) as the ConnectionError it is, which
    callers wait out as any outage; its other RedisClusterExceptions are bugs, and stay."""
    try:
        yield
    except redis.exceptions.RedisClusterException as exc:
        if _UNREACHABLE in str(exc):
            raise redis.exceptions.ConnectionError(str(exc)) from exc
        raise


class _WaitingCluster(aiocluster.RedisCluster):
    """A cluster client whose commands and pipelines, past a number at once, wait for a connection
    (at most the client's timeout, as the other URLs' pools) rather than fail (a burst of a
    tenant's rate checks on one node, say); and whose "no node reachable" is an outage."""

    def __init__(self, *args, wait_s: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._wait_s = wait_s
        self._sending = asyncio.Semaphore(max(1, min(CONCURRENT_COMMANDS, kwargs.get("max_connections", 100) - 8)))

    @contextlib.asynccontextmanager
    async def _gate(self) -> AsyncIterator[None]:
        if _gated.get():
            yield
            return
        try:
            await asyncio.wait_for(self._sending.acquire(), self._wait_s)
        except asyncio.TimeoutError:
            raise redis.exceptions.ConnectionError(
                f"no connection to the Redis Cluster came free within {self._wait_s:g} s") from None
        token = _gated.set(True)
        try:
            async with outage_as_connection_error():
                yield
        finally:
            _gated.reset(token)
            self._sending.release()

    async def execute_command(self, *args, **kwargs):
        async with self._gate():
            return await super().execute_command(*args, **kwargs)

    async def initialize(self, *args, **kwargs) -> None:
        async with outage_as_connection_error():
            await super().initialize(*args, **kwargs)

    def pipeline(self, *args, **kwargs):
        pipe = super().pipeline(*args, **kwargs)
        execute = pipe.execute

        async def gated(*a, **kw):
            async with self._gate():
                return await execute(*a, **kw)

        pipe.execute = gated  # type: ignore[method-assign]
        return pipe


def connect(url: str, timeout: float, blocking_reads: bool = False) -> aiocluster.RedisCluster:
    """An asyncio client of the cluster of `url`. With `blocking_reads` its reads wait as long as a
    blocking wait may, and a little longer; a connection still waits at most `timeout`."""
    target = parse(url)
    options = timeouts(target, timeout)
    if blocking_reads:  # whatever the URL says: a read shorter than the wait would end every wait
        options["socket_timeout"] = redis_url.blocking_read_timeout(timeout)
    return _WaitingCluster(startup_nodes=[aiocluster.ClusterNode(h, p) for h, p in target.nodes], wait_s=timeout,
                           **options)


def timeouts(target: ClusterTarget, timeout: float) -> dict:
    """The connection options of `target` with the service's `timeout` for socket reads and
    connections, unless the URL sets them (as a plain URL's options override them)."""
    return {"socket_timeout": timeout, "socket_connect_timeout": timeout, **target.kwargs}


def connect_sync(url: str, timeout: float) -> redis.cluster.RedisCluster:
    """A synchronous client of the cluster (command-line tools, tests)."""
    target = parse(url)
    return redis.cluster.RedisCluster(
        startup_nodes=[redis.cluster.ClusterNode(h, p) for h, p in target.nodes], **timeouts(target, timeout))


def coverage_problem(info: dict) -> str | None:
    """What is wrong with a cluster whose node answered CLUSTER INFO with `info`, or None when
    every hash slot is served (a key in an uncovered slot would fail every request of its model)."""
    assigned, state = int(info.get("cluster_slots_assigned", 0)), info.get("cluster_state")
    failing = int(info.get("cluster_slots_fail", 0))
    if assigned < SLOTS:
        return (f"only {assigned} of its {SLOTS} hash slots are assigned to a node (cluster_state {state}): "
                "assign the rest (redis-cli --cluster fix)")
    if state != "ok" or failing:
        return f"its state is {state!r} ({failing} hash slots on failing nodes): batchline needs every slot served"
    return None
