"""What a test or the soak benchmark sees of a ProcessMesh from outside, as a client would: its
Redis keys (which executors are registered, the batches they hold, queue depths, the gateways'
addresses) and its gRPC servers (health, readiness, a scheduler's status, a model's statistics).
A probe changes nothing; batchline/testing/processes.py starts, kills and restarts."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, TypeVar

import grpc
import psutil
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from batchline import contract
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import inference_pb2_grpc, internal_pb2, internal_pb2_grpc
from batchline.redis_client import connect_sync
from batchline.testing.polling import poll

if TYPE_CHECKING:
    from batchline.testing.processes import ProcessMesh

T = TypeVar("T")


class MeshProbe:
    """Reads a ProcessMesh's Redis and calls its services' gRPC servers. Services are named as the
    mesh names them (their ids), so a service's Redis keys are found from its name."""

    def __init__(self, mesh: "ProcessMesh"):
        self.mesh = mesh
        self._redis: redis.Redis | None = None
        self._addresses: dict[str, str] = {}
        self._channels: dict[str, grpc.Channel] = {}

    # -- Redis -------------------------------------------------------------------

    @property
    def redis(self) -> redis.Redis:
        """A synchronous client; commands fail (ConnectionError) while Redis is down."""
        if self._redis is None:
            self._redis = connect_sync(self.mesh.redis_url, 2)
        return self._redis

    def _redis_or(self, default: T, fn: Callable[[redis.Redis], T]) -> T:
        try:
            return fn(self.redis)
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            return default

    def live_executors(self) -> list[str]:
        """Executors of this mesh registered by their current process (a key left by a
        previous, killed run under the same id does not count)."""
        names = self.mesh.executors
        if not names:
            return []
        blobs = self._redis_or([], lambda r: r.mget([contract.executor(n) for n in names]))
        live = []
        for name, blob in zip(names, blobs):
            if blob is not None and (internal_pb2.ExecutorInfo.FromString(blob).started_us
                                     >= self.mesh.services[name].started_us):
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
        return poll(ready, timeout, what, check=self.mesh.check_alive)

    def wait_executor_gone(self, name: str, timeout: float | None = None) -> None:
        """Until the heartbeat key of a dead executor has expired."""
        timeout = timeout if timeout is not None else self.mesh.heartbeat_ttl_s + 5.0
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

    # -- gRPC --------------------------------------------------------------------

    def gateway_address(self, name: str = "gateway", timeout: float = 60.0) -> str:
        """host:port of a gateway, from the key it keeps in Redis (cached: the port stays the same)."""
        if name not in self._addresses:
            def read():
                value = self._redis_or(None, lambda r: r.get(contract.gateway(name)))
                return value.decode() if value else None
            self._addresses[name] = poll(read, timeout, f"{name} to register its address",
                                         check=self.mesh.check_alive)
        return self._addresses[name]

    def listening_ports(self, name: str) -> list[int]:
        """TCP ports a service listens on (its gRPC port, and any metrics port), read from the OS."""
        try:
            conns = psutil.Process(self.mesh.services[name].pid).net_connections(kind="tcp")
        except psutil.Error:
            return []
        return sorted({c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN})

    def address(self, name: str, timeout: float = 30.0) -> str:
        """host:port of a service's gRPC server. Schedulers and executors bind port 0 and publish
        nothing a test can rely on, so the port is found from the OS: the one answering gRPC health."""
        if self.mesh.services[name].kind == "gateway":
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
            self._addresses[name] = poll(find, timeout, f"{name} to serve gRPC", check=self.mesh.check_alive)
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
        poll(lambda: self.server_ready(name), timeout, f"{name} to be ready", check=self.mesh.check_alive)
        return address

    def scheduler_status(self, name: str) -> internal_pb2.SchedulerStatus:
        stub = internal_pb2_grpc.SchedulerStub(self.channel(name))
        return stub.Status(internal_pb2.StatusRequest(), timeout=2)

    def model_statistics(self, model: str = "mlp", gateway: str = "gateway") -> ipb.ModelStatistics:
        stub = inference_pb2_grpc.GRPCInferenceServiceStub(self.channel(gateway))
        response = stub.ModelStatistics(ipb.ModelStatisticsRequest(name=model), timeout=5)
        return response.model_stats[0]

    # -- lifecycle ---------------------------------------------------------------

    def forget(self, name: str) -> None:
        """Drop what is cached of `name`'s server: a restarted service listens on a new port."""
        self._addresses.pop(name, None)
        channel = self._channels.pop(name, None)
        if channel is not None:
            channel.close()

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()
        if self._redis is not None:
            self._redis.close()
            self._redis = None
