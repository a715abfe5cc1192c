"""`batchline up`'s processes: started in dependency order, restarted when they die, stopped in reverse.

A service that exits while the mesh runs is restarted under the same id (an
executor then hands back the batches it held) after a backoff that doubles
with each crash in a row, from RESTART_BACKOFF_S up to RESTART_BACKOFF_MAX_S,
and starts over once the service has run STABLE_S. More than `max_restarts`
crashes of one service within CRASH_LOOP_WINDOW_S, or in a row with no run
reaching STABLE_S (a service that dies a little later after each start, which
the backoff spreads past any window), is a crash loop: the mesh stops, and the
message names the service and gives its last log lines. An
embedded Redis is restarted the same way (the services reconnect by
themselves); one that cannot start again stops the mesh, with a line that
says why. Each restart is logged and counted in batchline_restarts_total on
the supervisor's metrics endpoint. A service retired (an executor the
autoscaler stops, batchline/autoscale.py) is asked to stop, drains, and is
forgotten once it exits, whatever its exit code.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from batchline import logs, metrics
from batchline.embedded_redis import EmbeddedRedis, RedisStartError
from batchline.lifecycle import PARENT_ENV

RESTART_BACKOFF_S = 0.5
RESTART_BACKOFF_MAX_S = 10.0
# A service that ran this long without exiting is healthy again: its next crash waits the first backoff.
STABLE_S = 30.0
CRASH_LOOP_WINDOW_S = 60.0
# Lines of a service's output kept for the message that stops a crash loop.
TAIL_LINES = 20
# How long a service may take to stop before it is killed: longer than the gateway's and the
# executors' default drain_timeout_s (30 s), so that what they hold is answered or handed back.
STOP_TIMEOUT_S = 40.0
STOP_POLL_S = 0.05


class CrashLoop(SystemExit):
    """A service crashed more often than the limit allows: the mesh stops."""


class RedisLost(SystemExit):
    """The embedded Redis died and could not be started again (its port taken, its binary failing):
    without it no service can work, so the mesh stops."""


@dataclass
class Service:
    name: str        # its id: executor-0, scheduler, gateway-0
    cmd: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restart_at: float | None = None  # when a crashed service is started again (time.monotonic())
    backoff_s: float = RESTART_BACKOFF_S
    crashes: deque = field(default_factory=deque)  # time.monotonic() of its recent crashes
    unstable: int = 0  # crashes in a row, each before its run reached STABLE_S
    tail: deque = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    retiring: bool = False  # asked to stop for good: not restarted once it exits
    retiring_since: float = 0.0  # when it was asked (time.monotonic()): killed if it outlasts STOP_TIMEOUT_S

    @property
    def role(self) -> str:
        return self.name.split("-")[0]

    def start(self) -> None:
        # In a session of its own, so that a Ctrl-C in the terminal reaches only `batchline up`, which
        # stops the services in order. Its output passes through here, keeping the last lines.
        self.proc = subprocess.Popen(self.cmd, env=self.env, start_new_session=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.started_at = time.monotonic()
        self.restart_at = None
        threading.Thread(target=self._relay, args=(self.proc,), name=f"{self.name}-output", daemon=True).start()

    def _relay(self, proc: subprocess.Popen) -> None:
        for raw in proc.stdout:
            line = raw.decode(errors="replace")
            self.tail.append(line.rstrip("\n"))
            sys.stderr.write(line)
            sys.stderr.flush()
        proc.stdout.close()


class Supervisor:
    """The processes of a local mesh and what keeps them running."""

    def __init__(self, args: argparse.Namespace, redis_url: str, redis: EmbeddedRedis | None,
                 env: dict[str, str | None] | None = None):
        self.args = args
        self.redis_url = redis_url
        self.redis = redis
        # Merged into os.environ for every child (None removes a variable), e.g. OTEL_* settings.
        self.env = {**os.environ, **{k: v for k, v in (env or {}).items() if v is not None}}
        for key in [k for k, v in (env or {}).items() if v is None]:
            self.env.pop(key, None)
        self.env[PARENT_ENV] = str(os.getpid())  # and they go with this process, should it die without stopping them
        self.services: list[Service] = []
        self.max_restarts = getattr(args, "max_restarts", 5)
        self._redis_crashes: deque = deque()
        self.hurry = False  # set (e.g. by a second Ctrl-C) to kill what is still stopping at once

    def spawn(self, name: str, module: str, *flags: str) -> Service:
        cmd = [sys.executable, "-m", module, "--host", self.args.host,
               "--log-level", self.args.log_level, "--log-format", getattr(self.args, "log_format", "text"), *flags]
        # The Redis URL, with its password, goes in the child's environment, which only this user may
        # read, not on its command line, which `ps` shows everyone (BATCHLINE_<SERVICE>_REDIS_URL).
        env = {**self.env, f"BATCHLINE_{module.upper()}_REDIS_URL": self.redis_url}
        service = Service(name, cmd, env)
        service.start()
        self.services.append(service)
        say(self.args, f"batchline: started {name} (pid {service.proc.pid})")
        return service

    def retire(self, name: str) -> None:
        """Ask a service to stop for good (SIGTERM: it drains first); forgotten once it exits."""
        s = next(s for s in self.services if s.name == name)
        s.retiring, s.retiring_since = True, time.monotonic()
        if s.proc is not None and s.proc.poll() is None:
            s.proc.send_signal(signal.SIGTERM)

    def supervise(self) -> None:
        """Restart what died and is due; raise CrashLoop when a service keeps dying."""
        now = time.monotonic()
        if self.redis is not None and self.redis.proc is not None and self.redis.proc.poll() is not None:
            self._restart_redis(now)
        for s in [s for s in self.services if s.retiring and s.proc is not None and s.proc.poll() is None
                  and now - s.retiring_since > STOP_TIMEOUT_S]:
            # As `stop` does: a drain that hangs (a stuck run) would hold its slot for good.
            say(self.args, f"batchline: killing {s.name} as it did not stop within {STOP_TIMEOUT_S:.0f} s")
            s.proc.kill()
            s.proc.wait()
        for s in [s for s in self.services if s.retiring and (s.proc is None or s.proc.poll() is not None)]:
            self.services.remove(s)
            code = s.proc.returncode if s.proc is not None else None
            say(self.args, f"batchline: {s.name} stopped (exit code {code})")
        for s in self.services:
            if s.proc is None:
                if s.restart_at is not None and now >= s.restart_at:
                    s.start()
                    metrics.RESTARTS.labels(s.name).inc()
                    say(self.args, f"batchline: restarted {s.name} (pid {s.proc.pid})")
                continue
            code = s.proc.poll()
            if code is None:
                if now - s.started_at >= STABLE_S:
                    s.backoff_s, s.unstable = RESTART_BACKOFF_S, 0
                continue
            self._crashed(s, code, now)

    def _crashed(self, s: Service, code: int, now: float) -> None:
        pid, s.proc = s.proc.pid, None
        s.unstable = s.unstable + 1 if now - s.started_at < STABLE_S else 1
        windowed = _too_many(s.crashes, now, self.max_restarts)
        if windowed or s.unstable > self.max_restarts:
            last = "\n".join(f"  {line}" for line in s.tail) or "  (no output)"
            how = (f"{len(s.crashes)} times within {CRASH_LOOP_WINDOW_S:.0f} s" if windowed else
                   f"{s.unstable} times in a row, each within {STABLE_S:.0f} s of its start")
            raise CrashLoop(f"batchline: {s.name} crashed {how} (last: pid {pid}, exit code {code}); stopping the "
                            f"mesh. Its last output:\n{last}")
        s.restart_at = now + s.backoff_s
        say(self.args, f"batchline: {s.name} (pid {pid}) exited with code {code}; restarting it in {s.backoff_s:.1f} s")
        s.backoff_s = min(RESTART_BACKOFF_MAX_S, s.backoff_s * 2)

    def _restart_redis(self, now: float) -> None:
        code = self.redis.proc.returncode
        if _too_many(self._redis_crashes, now, self.max_restarts):
            raise CrashLoop(f"batchline: Redis crashed {len(self._redis_crashes)} times within "
                            f"{CRASH_LOOP_WINDOW_S:.0f} s (last exit code {code}); stopping the mesh")
        say(self.args, f"batchline: Redis exited with code {code}; restarting it (empty: the services re-register, "
            "and the requests it held are answered UNAVAILABLE)")
        self.redis.stop()
        try:
            self.redis.start()
        except RedisStartError as exc:
            raise RedisLost(f"batchline: Redis exited with code {code} and could not be restarted: {exc}; "
                            "stopping the mesh") from None
        metrics.RESTARTS.labels("redis").inc()

    def stop(self) -> None:
        # The gateways first: they refuse new requests and wait for those they hold to be answered,
        # which takes the scheduler and the executors; then the scheduler (it gives its lease up);
        # then the executors, which finish or hand back the batches sent to them.
        for role in ("gateway", "scheduler", "executor"):
            group = [s for s in self.services if s.role == role and s.proc is not None and s.proc.poll() is None]
            for s in group:
                s.proc.send_signal(signal.SIGTERM)
            for s in group:
                self._wait_stopped(s)

    def _wait_stopped(self, s: Service) -> None:
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while s.proc.poll() is None and not self.hurry and time.monotonic() < deadline:
            time.sleep(STOP_POLL_S)
        if s.proc.poll() is None:
            why = "as asked" if self.hurry else f"as it did not stop within {STOP_TIMEOUT_S:.0f} s"
            say(self.args, f"batchline: killing {s.name} {why}")
            s.proc.kill()
            s.proc.wait()


def say(args: argparse.Namespace, message: str, stream=None) -> None:
    """A line of `batchline up`'s own, in its --log-format: written whole, newline included, in one
    write (print() writes the text and the newline apart, and unbuffered, a service's line sharing
    the terminal or pipe could land between them: two JSON objects on one line)."""
    out = stream or sys.stdout
    out.write(logs.line("batchline", message, getattr(args, "log_format", "text")) + "\n")
    out.flush()


def _too_many(crashes: deque, now: float, limit: int) -> bool:
    """Count a crash at `now`; whether there have been more than `limit` within the window."""
    crashes.append(now)
    while crashes and now - crashes[0] > CRASH_LOOP_WINDOW_S:
        crashes.popleft()
    return len(crashes) > limit
