"""What the benchmark scripts share: a local mesh as subprocesses, repository copies, printing.

Each script starts the meshes it needs (`batchline up`'s Mesh: a private
Redis, one executor, the scheduler and the gateway on a free port) and stops
them; the load generator runs in the script's own process. Importing this
module makes SIGTERM (`timeout`, `kill`) stop a script as Ctrl-C does, so that
the `finally` blocks that stop its meshes and peers run: by default SIGTERM
ends the process at once and leaves them running.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import platform
import shutil
import signal
import socket
import tempfile
import time
from collections import Counter
from typing import Iterator

import psutil

from batchline.cli import DEFAULT_REPOSITORY
from batchline.mesh import Mesh
from batchline.tune.layouts import set_config

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _interrupt(signum, frame) -> None:
    # Once: a second SIGTERM while the meshes stop must not cut their stopping short.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt(f"signal {signum}")


if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
    signal.signal(signal.SIGTERM, _interrupt)

# Closed-loop runs that measure what the mesh can serve give requests a budget long enough
# that admission control and shedding never refuse them (the model default is 5 s, which a
# saturated 2-core machine can exceed at 128 tokens): they measure capacity, not promises.
CAPACITY_BUDGET_MS = 60_000.0


def arg_parser(description: str, progress: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model-repository", default=str(ROOT / DEFAULT_REPOSITORY),
                   help="demo model repository; built with `batchline build-models` if missing "
                        f"(default: {DEFAULT_REPOSITORY}/ at the project root)")
    p.add_argument("--log-level", default="WARNING", help="log level of the mesh's services (default: WARNING)")
    if progress:
        p.add_argument("--progress", action="store_true", help="show a progress bar per step")
    return p


def step_args(p: argparse.ArgumentParser, duration: float = 10.0, rounds: int = 0,
              rounds_help: str = "alternating rounds") -> None:
    """--duration and --warmup of each measured step, and --rounds when the script alternates."""
    if rounds:
        p.add_argument("--rounds", type=int, default=rounds, help=f"{rounds_help} (default: {rounds})")
    p.add_argument("--duration", type=float, default=duration,
                   help=f"measured seconds per step (default: {duration:g})")
    p.add_argument("--warmup", type=float, default=3.0, help="warm-up seconds per step (default: 3)")


def mesh_args(model_repository: str | pathlib.Path, log_level: str = "WARNING", executors: int = 1,
              gateways: int = 1, metrics_port: int = 0, http_port: int = -1) -> argparse.Namespace:
    """`batchline up`'s arguments for a local mesh: a private Redis, the gateways on a free port, the
    metrics on free ports (or consecutive ones from `metrics_port`: gateways, scheduler, executors),
    and no REST port unless `http_port` (0: a free one, Mesh.http_port once started)."""
    return argparse.Namespace(model_repository=str(model_repository), redis_url="", executors=executors,
                              gateways=gateways, gateway_port=0, host="127.0.0.1", log_level=log_level,
                              startup_timeout=180.0, metrics_port=metrics_port, http_port=http_port)


@contextlib.contextmanager
def mesh(model_repository: str | pathlib.Path, env: dict[str, str] | None = None, executors: int = 1,
         log_level: str = "WARNING", gateways: int = 1, metrics_port: int = 0,
         protocol: str = "grpc") -> Iterator[str]:
    """Run a mesh for the duration of the block; yields the gateway's address for `protocol`
    (grpc, or http: its REST port, on a free port).

    `env` reaches the services' settings (e.g. BATCHLINE_SCHEDULER_POLICY=fifo): the
    children inherit os.environ, which is restored once they are started.
    """
    if protocol not in ("grpc", "http"):
        raise ValueError(f"protocol must be grpc or http, got {protocol!r}")
    m = Mesh(mesh_args(model_repository, log_level, executors, gateways, metrics_port,
                       http_port=0 if protocol == "http" else -1))
    saved = {k: os.environ.get(k) for k in env or {}}
    try:
        os.environ.update(env or {})
        try:
            address = m.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        yield address if protocol == "grpc" else f"127.0.0.1:{m.http_port}"
    finally:
        m.stop()


def free_base(span: int = 8) -> int:
    """A base port with `span` free ports after it (the mesh's metrics endpoints)."""
    for base in range(19100, 29000, span):
        ok = True
        for port in range(base, base + span):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise SystemExit("no free metrics ports")


def ensure_repository(path: str | pathlib.Path) -> pathlib.Path:
    """The demo repository at `path`: built when missing; when there, its config.toml files are
    brought up to date (the benchmarks measure the demo models as this checkout configures them)."""
    path = pathlib.Path(path).resolve()
    if not path.exists():
        from batchline.mesh import build_demo

        build_demo(path)
    else:
        from batchline.demo_models import build_repository

        build_repository(path)
    return path


@contextlib.contextmanager
def repository_copy(source: pathlib.Path, changes: dict[str, dict[str, str]]) -> Iterator[pathlib.Path]:
    """A temporary copy of the repository with config.toml keys changed: {model: {key: toml value}}."""
    with tempfile.TemporaryDirectory(prefix="batchline-bench-repo-") as tmp:
        dest = pathlib.Path(tmp) / "repo"
        # TensorRT caches and tokenizers are not needed to serve on CPU.
        shutil.copytree(source, dest, ignore=shutil.ignore_patterns("trt_cache", "tokenizer"))
        for model, keys in changes.items():
            cfg = dest / model / "config.toml"
            text = cfg.read_text() if cfg.exists() else ""
            for key, value in keys.items():
                text = set_config(text, key, value)
            cfg.write_text(text)
        yield dest


def machine() -> str:
    return (f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}, "
            f"{cpu_model()}; single-core speed: {python_loop_s():.2f} s for 10M Python additions")


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def python_loop_s() -> float:
    """A yardstick for comparing runs on shared VMs whose vCPUs differ from day to day: the best
    of three timings of a plain Python loop (lower is faster)."""
    best = float("inf")
    for _ in range(3):
        start, total = time.perf_counter(), 0
        for i in range(10_000_000):
            total += i
        best = min(best, time.perf_counter() - start)
    return best


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)


def f(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def cpu_seconds(named: dict[int, str] | None = None, rest: str | None = None) -> Counter:
    """CPU seconds so far of this script ("client") and of every process it started, by what they
    run: Redis, each service, a pid in `named` by its name there; any other child counts as `rest`
    (left out when None)."""
    out: Counter = Counter()
    me = psutil.Process()
    out["client"] += sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            cmd = " ".join(child.cmdline())
            times = child.cpu_times()
        except psutil.Error:
            continue  # it exited between the listing and the reading
        name = (named or {}).get(child.pid) or next(
            (n for n, sign in (("redis", "redis-server"), ("gateway", "-m gateway"), ("scheduler", "-m scheduler"),
                               ("executor", "-m executor")) if sign in cmd), rest)
        if name:
            out[name] += times.user + times.system
    return out
