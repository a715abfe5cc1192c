"""A Sentinel-managed Redis on loopback for tests and soaks: one primary, replicas and sentinels,
each a real redis-server process. It stands in for EmbeddedRedis (ProcessMesh(redis_server=...)):
`url` is the redis+sentinel:// URL the services are given."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time

import redis

from batchline.embedded_redis import EmbeddedRedis, die_with_parent, free_port, redis_server_binary

MASTER = "mymaster"


class SentinelRedis:
    def __init__(self, replicas: int = 1, sentinels: int = 3, down_after_ms: int = 1_000,
                 failover_timeout_ms: int = 5_000, master: str = MASTER, password: str = ""):
        self.master = master
        self.password = password  # the primary's and replicas' (requirepass); the sentinels have none
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.binary = redis_server_binary()
        self.servers = [EmbeddedRedis(password=password)]
        primary = self.servers[0].port
        self.servers += [EmbeddedRedis(password=password, extra_args=("--replicaof", "127.0.0.1", str(primary)))
                         for _ in range(replicas)]
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        self.dir = tempfile.mkdtemp(prefix="batchline-sentinel-")
        self.sentinels: list[subprocess.Popen] = []

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis+sentinel://{auth}{','.join(f'127.0.0.1:{p}' for p in self.sentinel_ports)}/{self.master}/0"

    @property
    def proc(self) -> subprocess.Popen | None:
        """The primary's process (what ProcessMesh reports as Redis's)."""
        return self.primary().proc

    def _sentinel(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1)

    def master_address(self) -> tuple[str, int] | None:
        """The primary's address as the first sentinel that answers gives it."""
        for port in self.sentinel_ports:
            try:
                found = self._sentinel(port).sentinel_get_master_addr_by_name(self.master)
            except redis.exceptions.ConnectionError:
                continue
            if found:
                return found[0], int(found[1])
        return None

    def primary(self) -> EmbeddedRedis:
        address = self.master_address()
        port = address[1] if address else self.servers[0].port
        return next(s for s in self.servers if s.port == port)

    def start(self, timeout: float = 30.0) -> "SentinelRedis":
        """Start every process and wait until the sentinels see them all; nothing if they run already."""
        if self.sentinels:
            return self
        for server in self.servers:
            server.start()
        primary = self.servers[0].port
        for port in self.sentinel_ports:
            conf = os.path.join(self.dir, f"sentinel-{port}.conf")
            with open(conf, "w") as f:
                f.write(f"port {port}\nbind 127.0.0.1\ndir {self.dir}\n"
                        f"sentinel monitor {self.master} 127.0.0.1 {primary} {len(self.sentinel_ports) // 2 + 1}\n"
                        f"sentinel down-after-milliseconds {self.master} {self.down_after_ms}\n"
                        f"sentinel failover-timeout {self.master} {self.failover_timeout_ms}\n"
                        + (f"sentinel auth-pass {self.master} {self.password}\n" if self.password else ""))
            self.sentinels.append(subprocess.Popen(
                [self.binary, conf, "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=die_with_parent))
        deadline = time.monotonic() + timeout
        while not self._ready():
            if time.monotonic() > deadline:
                raise RuntimeError("the sentinels did not see the primary, its replicas and each other in time")
            time.sleep(0.1)
        return self

    def _ready(self) -> bool:
        """Every sentinel sees the primary, every replica in sync and every other sentinel."""
        try:
            for port in self.sentinel_ports:
                state = self._sentinel(port).sentinel_master(self.master)
                if (int(state.get("num-slaves", 0)) < len(self.servers) - 1
                        or int(state.get("num-other-sentinels", 0)) < len(self.sentinel_ports) - 1):
                    return False
            info = redis.Redis(port=self.servers[0].port, password=self.password or None,
                               socket_timeout=1).info("replication")
            return int(info.get("connected_slaves", 0)) == len(self.servers) - 1 and all(
                info.get(f"slave{i}", {}).get("state") == "online" for i in range(len(self.servers) - 1))
        except redis.exceptions.RedisError:
            return False

    def kill_primary(self) -> EmbeddedRedis:
        """SIGKILL the primary; returns it (start() it again to bring it back, as a replica of whoever won)."""
        primary = self.primary()
        primary.stop(kill=True)
        return primary

    def wait_failover(self, old: tuple[str, int], timeout: float = 30.0) -> float:
        """Wait until the sentinels name a primary other than `old`; returns when (time.monotonic())."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            address = self.master_address()
            if address is not None and address != old:
                return time.monotonic()
            time.sleep(0.02)
        raise RuntimeError(f"no failover from {old} within {timeout} s")

    def stop(self, kill: bool = False) -> None:
        for proc in self.sentinels:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.sentinels = []
        for server in self.servers:
            server.stop(kill=kill)

    def close(self) -> None:
        self.stop(kill=True)
        for server in self.servers:
            server.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "SentinelRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
