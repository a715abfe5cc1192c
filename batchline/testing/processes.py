"""The real services as subprocesses, for fault-injection tests and the soak benchmark.

Unlike batchline/testing/in_process.py (everything in one process), every gateway, scheduler
and executor here is its own `python -m <service>` process, so it can be
SIGKILLed, SIGTERMed, SIGSTOPped or restarted exactly as in production, and
its RSS measured. Redis is a private EmbeddedRedis that can be killed and
started again on the same port (it persists nothing: a restart is empty).
What the tests see of such a mesh (its Redis keys, its services' gRPC servers) is read
through its probe (batchline/testing/probe.py); the load it serves in the tests and
benchmarks/soak.py is in batchline/testing/load.py.
"""
from __future__ import annotations

import atexit
import os
import pathlib
import signal
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass
from typing import Iterable

import psutil

from batchline.embedded_redis import EmbeddedRedis
from batchline.testing.checkout import ROOT
from batchline.testing.loop_bugs import in_log, judged_to
from batchline.testing.polling import MeshError, poll
from batchline.testing.probe import MeshProbe

# Where `python -m <service>` runs, so the service code comes from there (the
# modules of the working directory win over the installed ones). Point it at
# another checkout to run these tests against that version of the services.
SERVICES_ROOT = pathlib.Path(os.environ.get("BATCHLINE_SERVICES_ROOT", ROOT))

# Services started by any ProcessMesh of this interpreter, killed at exit in
# case a test run is interrupted before its teardown.
_LIVE: "weakref.WeakSet[ProcessMesh]" = weakref.WeakSet()
# Every ProcessMesh made, in order: the tests' conftest reads the logs of those a test made or
# used (loop_bugs.in_log) after it, and drops each once it is stopped.
MADE: "list[ProcessMesh]" = []


@atexit.register
def _kill_leftovers() -> None:
    for mesh in list(_LIVE):
        mesh.stop(graceful=False)


# -- one service ---------------------------------------------------------------------


@dataclass
class Service:
    name: str
    kind: str  # "gateway" | "scheduler" | "executor"
    argv: list[str]
    env: dict[str, str]
    log_path: pathlib.Path
    proc: subprocess.Popen | None = None
    starts: int = 0
    started_us: int = 0  # wall clock of the last start: registrations older than it are a previous run's
    expect_exit: bool = False  # killed or stopped on purpose: not a crash

    def start(self) -> None:
        self.starts += 1
        self.started_us = time.time_ns() // 1000
        self.expect_exit = False
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== start #{self.starts} of {self.name}: {' '.join(self.argv)}\n".encode())
            log.flush()
            # Own session: a Ctrl-C in the terminal reaches pytest only, which then tears down in order.
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True, cwd=SERVICES_ROOT)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            if sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
                self.expect_exit = True
            self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None, f"{self.name} was never started"
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise MeshError(f"{self.name} (pid {self.proc.pid}) did not exit within {timeout} s") from None

    def tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text[-lines:])


# -- the mesh ------------------------------------------------------------------------


class ProcessMesh:
    """Redis + executors + schedulers + gateways, each a real subprocess.

    Names are the services' ids (executor id, scheduler id, gateway id), so the
    Redis keys of a service are found from its name (by `probe`). Fast heartbeats by
    default (0.2 s, expiring after 1 s) so that deaths are noticed quickly in tests.
    """

    def __init__(
        self,
        model_repository: str | os.PathLike,
        log_dir: str | os.PathLike,
        *,
        models: Iterable[str] = ("mlp",),
        heartbeat_interval_s: float = 0.2,
        heartbeat_ttl_s: float = 1.0,
        lease_ttl_s: float | None = None,
        log_level: str = "INFO",
        redis_timeout_s: float = 1.0,
        intra_op_threads: int = 1,
        redis_server=None,
    ):
        self.repo = str(pathlib.Path(model_repository).resolve())
        self.log_dir = pathlib.Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.models = list(models)
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.lease_ttl_s = lease_ttl_s
        self.log_level = log_level
        self.redis_timeout_s = redis_timeout_s
        self.intra_op_threads = intra_op_threads
        # Anything with EmbeddedRedis's url, start, stop, restart, close and proc (testing/sentinel.py).
        self.redis_server = redis_server or EmbeddedRedis()
        self.services: dict[str, Service] = {}
        self.probe = MeshProbe(self)
        self._bugs_read_to: dict[str, int] = {}  # per service: how far loop_bugs has read its log
        _LIVE.add(self)
        MADE.append(self)

    # -- Redis ---------------------------------------------------------------

    @property
    def redis_url(self) -> str:
        return self.redis_server.url

    def start_redis(self) -> None:
        self.redis_server.start()

    def kill_redis(self) -> None:
        self.redis_server.stop(kill=True)

    def restart_redis(self) -> None:
        """SIGKILL Redis and start an empty one on the same port (nothing is persisted)."""
        self.redis_server.restart()

    @property
    def redis_pid(self) -> int | None:
        return self.redis_server.proc.pid if self.redis_server.proc else None

    # -- adding services -------------------------------------------------------

    def _env(self, kind: str, extra: dict[str, str]) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        # Settings that not every version of the services has go through the
        # environment: pydantic-settings ignores variables it has no field for.
        if kind == "scheduler" and self.lease_ttl_s is not None:
            env["BATCHLINE_SCHEDULER_LEASE_TTL_S"] = str(self.lease_ttl_s)
        # Prometheus endpoints on any free port: a fixed default would collide between services.
        env[f"BATCHLINE_{kind.upper()}_METRICS_PORT"] = "0"
        env.update(extra)
        return env

    def _add(self, name: str, kind: str, flags: list[str], env: dict[str, str] | None) -> Service:
        if name in self.services:
            raise ValueError(f"a service named {name!r} exists already")
        argv = [sys.executable, "-m", kind, "--redis-url", self.redis_url, "--log-level", self.log_level,
                "--redis-timeout-s", str(self.redis_timeout_s), *flags]
        svc = Service(name, kind, argv, self._env(kind, env or {}), self.log_dir / f"{name}.log")
        self.services[name] = svc
        svc.start()
        return svc

    def add_executor(self, name: str | None = None, *, models: Iterable[str] | None = None,
                     flags: Iterable[str] = (), env: dict[str, str] | None = None) -> str:
        name = name or f"exec-{len(self.executors)}"
        models = list(self.models if models is None else models)
        self._add(name, "executor", [
            "--executor-id", name, "--model-repository", self.repo,
            "--intra-op-threads", str(self.intra_op_threads),
            "--heartbeat-interval-s", str(self.heartbeat_interval_s),
            "--heartbeat-ttl-s", str(self.heartbeat_ttl_s),
            *(["--models", *models] if models else []), *flags,
        ], env)
        return name

    def add_scheduler(self, name: str | None = None, *, flags: Iterable[str] = (),
                      env: dict[str, str] | None = None) -> str:
        name = name or f"sched-{len(self.schedulers)}"
        self._add(name, "scheduler", ["--scheduler-id", name, *flags], env)
        return name

    def add_gateway(self, name: str = "gateway", *, flags: Iterable[str] = (),
                    env: dict[str, str] | None = None) -> str:
        flags = list(flags)
        # No REST port unless a test asks: the gateway's default (8000) is one port per host, and
        # test meshes in parallel would contend for it.
        rest = [] if "--http-port" in flags else ["--http-port", "-1"]
        self._add(name, "gateway", ["--gateway-id", name, "--port", "0", *rest,
                                    "--heartbeat-interval-s", str(self.heartbeat_interval_s), *flags], env)
        return name

    def of_kind(self, kind: str) -> list[str]:
        return [n for n, s in self.services.items() if s.kind == kind]

    @property
    def executors(self) -> list[str]:
        return self.of_kind("executor")

    @property
    def schedulers(self) -> list[str]:
        return self.of_kind("scheduler")

    @property
    def gateways(self) -> list[str]:
        return self.of_kind("gateway")

    def start(self, executors: int = 1, schedulers: int = 1, gateway: bool = True,
              timeout: float = 60.0) -> "ProcessMesh":
        """Redis, then every service at once (they wait for each other through Redis); returns when serving."""
        self.start_redis()
        for _ in range(executors):
            self.add_executor()
        for _ in range(schedulers):
            self.add_scheduler()
        if gateway:
            self.add_gateway()
        self.probe.wait_for_executors(executors, timeout)
        for name in self.schedulers:
            poll(lambda: self.probe.health(name) == "SERVING", timeout, f"{name} to serve", check=self.check_alive)
        if gateway:
            self.probe.wait_ready(timeout=timeout)
        return self

    # -- controlling services ---------------------------------------------------

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        self.services[name].signal(sig)

    def wait_exit(self, name: str, timeout: float = 15.0) -> int:
        return self.services[name].wait(timeout)

    def restart(self, name: str) -> None:
        """Start `name` again with the same id and flags (SIGKILLing it first if it still runs)."""
        svc = self.services[name]
        if svc.alive:
            svc.signal(signal.SIGKILL)
        if svc.proc is not None:
            svc.wait(10)
        self.probe.forget(name)
        svc.start()

    def pids(self) -> dict[str, int]:
        """Pids of the running services, and of Redis."""
        out = {n: s.pid for n, s in self.services.items() if s.alive}
        if self.redis_pid is not None:
            out["redis"] = self.redis_pid
        return out

    def rss(self) -> dict[str, int]:
        """Resident set size in bytes of every running service and of Redis."""
        out = {}
        for name, pid in self.pids().items():
            try:
                out[name] = psutil.Process(pid).memory_info().rss
            except psutil.Error:
                pass
        return out

    def check_alive(self) -> None:
        """Fail at once when a service exited that nobody stopped on purpose."""
        for svc in self.services.values():
            if svc.proc is not None and not svc.expect_exit and svc.proc.poll() is not None:
                raise MeshError(f"{svc.name} exited unexpectedly with code {svc.proc.returncode}:\n{svc.tail(30)}")

    def loop_bugs(self) -> str | None:
        """The first service whose log holds a loop's failure on a bug (loop_bugs.in_log), or None.
        Each call reads only what the logs gained since the last one: a mesh that outlives a test
        (a module's) is read after each, and a failure is reported once, by the test it came in."""
        found = None
        for name, svc in self.services.items():
            try:
                with open(svc.log_path, "rb") as log:
                    log.seek(self._bugs_read_to.get(name, 0))
                    text = log.read()
            except FileNotFoundError:
                continue
            judged = judged_to(text)
            self._bugs_read_to[name] = self._bugs_read_to.get(name, 0) + judged
            bug = in_log(text[:judged].decode(errors="replace"))
            if bug and found is None:
                found = f"{name} ({svc.log_path}): {bug}"
        return found

    @property
    def stopped(self) -> bool:
        return self not in _LIVE

    def logs(self, lines: int = 60) -> str:
        parts = [f"----- {n} ({s.log_path}) -----\n{s.tail(lines)}" for n, s in self.services.items()]
        return "\n".join(parts)

    # -- teardown ----------------------------------------------------------------

    def stop(self, graceful: bool = True, timeout: float = 10.0) -> dict[str, int]:
        """Stop everything (gateways, then schedulers, then executors, then Redis); SIGKILL
        whatever does not exit in time. Returns the exit code of each service stopped here."""
        self.probe.close()
        order = [*self.gateways, *self.schedulers, *self.executors]
        codes: dict[str, int] = {}
        running = [self.services[n] for n in order if self.services[n].alive]
        for svc in running:
            svc.signal(signal.SIGCONT)  # a stopped process would not act on SIGTERM
            svc.signal(signal.SIGTERM if graceful else signal.SIGKILL)
        deadline = time.monotonic() + timeout
        for svc in running:
            try:
                codes[svc.name] = svc.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                svc.proc.kill()
                codes[svc.name] = svc.proc.wait()
        self.redis_server.stop(kill=True)
        self.redis_server.close()  # and its directory
        _LIVE.discard(self)
        return codes

    def __enter__(self) -> "ProcessMesh":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
