"""A Redis Cluster on loopback for tests and soaks: primaries that are real redis-server processes
(--cluster-enabled yes), joined by `redis-cli --cluster create`. It stands in for EmbeddedRedis
(ProcessMesh(redis_server=...)): `url` is the redis+cluster:// URL the services are given."""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time

import redis

from batchline.embedded_redis import EmbeddedRedis, redis_server_binary
from batchline.redis_client import cluster_info_fields


def redis_cli_binary() -> str | None:
    """redis-cli beside the redis-server the tests use, or on PATH."""
    beside = shutil.which("redis-cli", path=os.path.dirname(redis_server_binary()))
    return beside or shutil.which("redis-cli")


def distinct_free_ports(n: int) -> list[int]:
    """`n` ports free now and different from each other: each socket stays bound until all are
    chosen, so the kernel cannot hand out one twice."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(n)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


class ClusterRedis:
    def __init__(self, shards: int = 3, replicas: int = 0, node_timeout_ms: int = 2_000):
        self.replicas = replicas  # per primary: redis-cli makes the first `shards` servers the primaries
        nodes = shards * (1 + replicas)
        ports = distinct_free_ports(2 * nodes)
        self.servers = [EmbeddedRedis(port=ports[2 * i], die_with_parent=True, extra_args=(
            "--cluster-enabled", "yes",
            "--cluster-port", str(ports[2 * i + 1]),  # not port + 10000, which may be taken or past 65535
            "--cluster-node-timeout", str(node_timeout_ms),
        )) for i in range(nodes)]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.servers)

    @property
    def proc(self) -> subprocess.Popen | None:
        """The first node's process (what ProcessMesh reports as Redis's)."""
        return self.servers[0].proc

    def node(self, i: int) -> redis.Redis:
        return redis.Redis(port=self.servers[i].port, socket_timeout=2, socket_connect_timeout=2)

    def start(self, timeout: float = 30.0) -> "ClusterRedis":
        """Start every node, join them (each primary takes an equal share of the slots) and wait
        until each says the cluster is ok; nothing if they run already."""
        if all(s.proc is not None for s in self.servers):
            return self
        cli = redis_cli_binary()
        if cli is None:
            raise RuntimeError("redis-cli is not installed (Debian: redis-tools); it creates the cluster")
        try:
            for server in self.servers:
                server.start()
            subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{s.port}" for s in self.servers),
                            "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                           check=True, capture_output=True, timeout=timeout)
            deadline = time.monotonic() + timeout
            while not self.ok():
                if time.monotonic() > deadline:
                    raise RuntimeError("the cluster's nodes did not agree that every slot is served in time")
                time.sleep(0.1)
        except BaseException:
            self.close()  # the nodes that did start: `with` never reaches __exit__ when __enter__ fails
            raise
        return self

    def ok(self) -> bool:
        """Every running node sees the cluster ok (every slot served) and every other node, and
        every replica is in sync with its primary."""
        try:
            for i in range(len(self.servers)):
                if self.servers[i].proc is None:
                    continue
                info = cluster_info_fields(self.node(i).execute_command("CLUSTER INFO"))
                if info.get("cluster_state") != "ok" or int(info.get("cluster_known_nodes", 0)) < len(self.servers):
                    return False
                # A replica that has not synced with its primary yet could not take its place.
                replication = self.node(i).info("replication")
                if replication.get("role") == "slave" and replication.get("master_link_status") != "up":
                    return False
            return True
        except redis.exceptions.RedisError:
            return False

    def shard_of(self, key: str) -> int:
        """The index (in `servers`) of the primary that serves `key`'s slot (the others redirect:
        MOVED; replicas too, and stopped servers are skipped)."""
        for i, server in enumerate(self.servers):
            if server.proc is None:
                continue
            try:
                self.node(i).exists(key)
                return i
            except (redis.exceptions.MovedError, redis.exceptions.ConnectionError,
                    redis.exceptions.ClusterDownError):
                continue
        raise LookupError(f"no node serves the slot of {key!r}")

    def wait_failover(self, key: str, old: int, timeout: float = 30.0) -> float:
        """Wait until a node other than `old` serves `key`'s slot (its replica was promoted) and
        every running node has left CLUSTERDOWN (the failover is over only when they all serve);
        returns when (time.monotonic())."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.shard_of(key) != old and self.ok():
                    return time.monotonic()
            except LookupError:
                pass
            time.sleep(0.02)
        raise RuntimeError(f"no replica took over the slot of {key!r} within {timeout} s")

    def stop(self, kill: bool = False) -> None:
        for server in self.servers:
            server.stop(kill=kill)

    def close(self) -> None:
        for server in self.servers:
            server.close()

    def __enter__(self) -> "ClusterRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
