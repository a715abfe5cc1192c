"""The real services as subprocesses, for fault-injection tests and the soak benchmark.

Unlike the test suite's tests/mesh.py (everything in one process), every gateway, scheduler
and executor here is its own `python -m <service>` process, so it can be
SIGKILLed, SIGTERMed, SIGSTOPped or restarted exactly as in production, and
its RSS measured. Redis is a private EmbeddedRedis that can be killed and
started again on the same port (it persists nothing: a restart is empty).
The load such a mesh serves in the tests and benchmarks/soak.py is in
batchline/testing/load.py.
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
from typing import Callable, Iterable, TypeVar

import grpc
import psutil
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from batchline import contract
from batchline.embedded_redis import EmbeddedRedis
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import inference_pb2_grpc, internal_pb2, internal_pb2_grpc
from batchline.redis_client import connect_sync

T = TypeVar("T")

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the checkout
# Where `python -m <service>` runs, so the service code comes from there (the
# modules of the working directory win over the installed ones). Point it at
# another checkout to run these tests against that version of the services.
SERVICES_ROOT = pathlib.Path(os.environ.get("BATCHLINE_SERVICES_ROOT", ROOT))

# Services started by any ProcessMesh of this interpreter, killed at exit in
# case a test run is interrupted before its teardown.
_LIVE: "weakref.WeakSet[ProcessMesh]" = weakref.WeakSet()


@atexit.register
def _kill_leftovers() -> None:
    for mesh in list(_LIVE):
        mesh.stop(graceful=False)


class MeshError(AssertionError):
    """The mesh did not reach a state in time, or a service died unexpectedly."""


def poll(condition: Callable[[], T], timeout: float, what: str, interval: float = 0.05,
         check: Callable[[], None] | None = None) -> T:
    """Wait until condition() is truthy and return it; MeshError after `timeout` seconds.

    `check` runs on every round so that a crashed service fails the wait at once
    instead of after the whole timeout."""
    deadline = time.monotonic() + timeout
    while True:
        if check is not None:
            check()
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise MeshError(f"timed out after {timeout:.1f} s waiting for {what} (last value: {value!r})")
        time.sleep(interval)


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
    Redis keys of a service are found from its name. Fast heartbeats by default
    (0.2 s, expiring after 1 s) so that deaths are noticed quickly in tests.
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
        self._addresses: dict[str, str] = {}
        self._redis: redis.Redis | None = None
        self._channels: dict[str, grpc.Channel] = {}
        _LIVE.add(self)

    # -- Redis ---------------------------------------------------------------

    @property
    def redis_url(self) -> str:
        return self.redis_server.url

    @property
    def redis(self) -> redis.Redis:
        """A synchronous client; commands fail (ConnectionError) while Redis is down."""
        if self._redis is None:
            self._redis = connect_sync(self.redis_url, 2)
        return self._redis

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
        self._add(name, "gateway", ["--gateway-id", name, "--port", "0",
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
        self.wait_for_executors(executors, timeout)
        for name in self.schedulers:
            poll(lambda: self.health(name) == "SERVING", timeout, f"{name} to serve", check=self.check_alive)
        if gateway:
            self.wait_ready(timeout=timeout)
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
        self._addresses.pop(name, None)
        self._channels.pop(name, None)
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

    # -- observing ---------------------------------------------------------------

    def _redis_or(self, default: T, fn: Callable[[redis.Redis], T]) -> T:
        try:
            return fn(self.redis)
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            return default

    def live_executors(self) -> list[str]:
        """Executors of this mesh registered by their current process (a key left by a
        previous, killed run under the same id does not count)."""
        names = self.executors
        if not names:
            return []
        blobs = self._redis_or([], lambda r: r.mget([contract.executor(n) for n in names]))
        live = []
        for name, blob in zip(names, blobs):
            if blob is not None and (internal_pb2.ExecutorInfo.FromString(blob).started_us
                                     >= self.services[name].started_us):
                live.append(name)
        return live

    def wait_for_executors(self, n: int, timeout: float = 60.0, names: Iterable[str] | None = None) -> list[str]:
        """Until at least n executors (or all of `names`) are registered."""
        want = set(names or ())

        def ready():
            live = self.live_executors()
            ok = want.issubset(live) if want else len(live) >= n
            return live if ok else None

        what = f"executors {sorted(want)} to register" if want else f"{n} executor(s) to register"
        return poll(ready, timeout, what, check=self.check_alive)

    def wait_executor_gone(self, name: str, timeout: float | None = None) -> None:
        """Until the heartbeat key of a dead executor has expired."""
        timeout = timeout if timeout is not None else self.heartbeat_ttl_s + 5.0
        poll(lambda: not self._redis_or(1, lambda r: r.exists(contract.executor(name))), timeout,
             f"the heartbeat key of {name} to expire")

    def held_batches(self, executor: str) -> int:
        """Batches dispatched to `executor` and not answered yet (its in-flight sets, one per model)."""
        def count(r) -> int:
            models = [contract.parse_model_tag(t) for t in r.smembers(contract.served(executor))]
            return sum(r.scard(contract.inflight(m, executor)) for m in models)
        return int(self._redis_or(0, count))

    def queued_work(self, executor: str) -> int:
        return int(self._redis_or(0, lambda r: r.llen(contract.work(executor))))

    def queue_depth(self, model: str = "mlp", version: str = "1") -> int:
        return int(self._redis_or(0, lambda r: r.zcard(contract.queue((model, version)))))

    def gateway_address(self, name: str = "gateway", timeout: float = 60.0) -> str:
        """host:port of a gateway, from the key it keeps in Redis (cached: the port stays the same)."""
        if name not in self._addresses:
            def read():
                value = self._redis_or(None, lambda r: r.get(contract.gateway(name)))
                return value.decode() if value else None
            self._addresses[name] = poll(read, timeout, f"{name} to register its address", check=self.check_alive)
        return self._addresses[name]

    def listening_ports(self, name: str) -> list[int]:
        """TCP ports a service listens on (its gRPC port, and any metrics port), read from the OS."""
        try:
            conns = psutil.Process(self.services[name].pid).net_connections(kind="tcp")
        except psutil.Error:
            return []
        return sorted({c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN})

    def address(self, name: str, timeout: float = 30.0) -> str:
        """host:port of a service's gRPC server. Schedulers and executors bind port 0 and publish
        nothing a test can rely on, so the port is found from the OS: the one answering gRPC health."""
        if self.services[name].kind == "gateway":
            return self.gateway_address(name, timeout)

        def find() -> str | None:
            for port in self.listening_ports(name):
                with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                    try:
                        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                    except grpc.RpcError as exc:
                        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                          grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
                            continue  # not gRPC (a metrics endpoint) or not up yet
                    return f"127.0.0.1:{port}"
            return None

        if name not in self._addresses:
            self._addresses[name] = poll(find, timeout, f"{name} to serve gRPC", check=self.check_alive)
        return self._addresses[name]

    def channel(self, name: str) -> grpc.Channel:
        if name not in self._channels:
            self._channels[name] = grpc.insecure_channel(self.address(name))
        return self._channels[name]

    def health(self, name: str, service: str = "") -> str:
        """grpc.health.v1 Check of a service: SERVING / NOT_SERVING / ..., or the gRPC error code's name."""
        try:
            stub = health_pb2_grpc.HealthStub(self.channel(name))
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
        except grpc.RpcError as exc:
            return exc.code().name
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def server_ready(self, name: str = "gateway") -> bool:
        try:
            stub = inference_pb2_grpc.GRPCInferenceServiceStub(self.channel(name))
            return stub.ServerReady(ipb.ServerReadyRequest(), timeout=2).ready
        except grpc.RpcError:
            return False

    def wait_ready(self, name: str = "gateway", timeout: float = 60.0) -> str:
        address = self.gateway_address(name, timeout)
        poll(lambda: self.server_ready(name), timeout, f"{name} to be ready", check=self.check_alive)
        return address

    def scheduler_status(self, name: str) -> internal_pb2.SchedulerStatus:
        stub = internal_pb2_grpc.SchedulerStub(self.channel(name))
        return stub.Status(internal_pb2.StatusRequest(), timeout=2)

    def model_statistics(self, model: str = "mlp", gateway: str = "gateway") -> ipb.ModelStatistics:
        stub = inference_pb2_grpc.GRPCInferenceServiceStub(self.channel(gateway))
        response = stub.ModelStatistics(ipb.ModelStatisticsRequest(name=model), timeout=5)
        return response.model_stats[0]

    def logs(self, lines: int = 60) -> str:
        parts = [f"----- {n} ({s.log_path}) -----\n{s.tail(lines)}" for n, s in self.services.items()]
        return "\n".join(parts)

    # -- teardown ----------------------------------------------------------------

    def stop(self, graceful: bool = True, timeout: float = 10.0) -> dict[str, int]:
        """Stop everything (gateways, then schedulers, then executors, then Redis); SIGKILL
        whatever does not exit in time. Returns the exit code of each service stopped here."""
        for ch in self._channels.values():
            ch.close()
        self._channels.clear()
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
        if self._redis is not None:
            self._redis.close()
            self._redis = None
        self.redis_server.stop(kill=True)
        self.redis_server.close()  # and its directory
        _LIVE.discard(self)
        return codes

    def __enter__(self) -> "ProcessMesh":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
