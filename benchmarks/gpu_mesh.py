"""The mesh under load from several client processes, for benchmarks/gpu.py: gateways and executors
added to a running mesh, steps driven in step by every client, and CPU per request per process.

One gateway process is a single Python event loop, so feeding a GPU takes several. Each gateway the
script adds listens on a port of its own, and each client process drives one gateway (client i the
gateway i mod G), so a step with G gateways uses exactly G of them; the ones left idle cost nothing
but their heartbeats. Clients are long-lived processes (spawned, not forked: the parent has gRPC
channels open) that start each step together at a barrier, so the script samples every process's
CPU over the same measured window.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pathlib
import time
from dataclasses import asdict

import _common
from batchline.contract.admin_store import AdminStore
from batchline.mesh import Mesh, executors_up
from batchline.redis_client import connect_sync

KINDS = ("client", "gateway", "scheduler", "executor", "redis")


def _client_main(conn, barrier, cores: list[int] | None) -> None:
    if cores:
        os.sched_setaffinity(0, cores)
    from batchline.bench import run_closed

    conn.send("ready")
    while True:
        job = conn.recv()
        if job is None:
            return
        barrier.wait()
        if not job:
            continue  # not in this step
        try:
            step = run_closed(job["address"], job["model"], job["concurrency"], job["duration"],
                              warmup=job["warmup"], version=job.get("version", ""),
                              streaming=job.get("streaming", False),
                              budget_ms=_common.CAPACITY_BUDGET_MS,
                              inputs=_inputs(job.get("seq_len"), job.get("rows", 1)))
            conn.send(asdict(step))
        except Exception as exc:  # noqa: BLE001 - the step fails, not the client
            conn.send({"error": f"{type(exc).__name__}: {exc}"})


def _inputs(seq_len: int | None, rows: int):
    """minilm's token inputs, `rows` sequences of `seq_len` tokens a request (one row: the shapes the
    model's config gives, with `seq_len` for the dynamic length)."""
    from batchline.bench import InputOptions

    if not seq_len:
        return InputOptions()
    shapes = {name: [rows, seq_len] for name in ("input_ids", "attention_mask")} if rows > 1 else {}
    return InputOptions(seq_len=seq_len, shapes=shapes, int_ranges={"input_ids": (1000, 29000)})


class Clients:
    """`n` client processes (pinned to `cores` if given) that run closed-loop steps together."""

    def __init__(self, n: int, cores: list[int] | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.barrier = ctx.Barrier(n + 1)
        self.conns, self.procs = [], []
        for _ in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_client_main, args=(child, self.barrier, cores), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        for c in self.conns:
            c.recv()

    @property
    def pids(self) -> dict[int, str]:
        return {p.pid: "client" for p in self.procs}

    def step(self, addresses: list[str], model: str, in_flight: int, duration: float, warmup: float,
             seq_len: int | None = None, version: str = "", streaming: bool = False, rows: int = 1) -> dict:
        """One closed-loop step over `addresses` (client i drives addresses[i % len]), each request
        carrying `rows` sequences; the summed throughput in sequences/s, the worst client's p99 and
        median p50, and CPU ms per answered sequence per kind of process over the measured window.

        The clients in the step are the most the pool has that share the gateways evenly (a multiple
        of their number): a gateway driven by two clients while another has one would be given twice
        the load, and the step would measure the busier one's limit."""
        g = len(addresses)
        n = len(self.conns) // g * g if len(self.conns) >= g else len(self.conns)
        for i, c in enumerate(self.conns):
            c.send({"address": addresses[i % g], "model": model, "duration": duration, "warmup": warmup,
                    "concurrency": max(1, in_flight // n + (1 if i < in_flight % n else 0)),
                    "seq_len": seq_len, "version": version, "streaming": streaming, "rows": rows} if i < n else {})
        self.barrier.wait()
        time.sleep(warmup)
        before = _common.cpu_seconds(self.pids)
        time.sleep(duration)
        after = _common.cpu_seconds(self.pids)
        results = [c.recv() for c in self.conns[:n]]
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            return {"error": "; ".join(sorted(set(errors)))}
        answered = rows * sum(r["throughput_rps"] * r["duration_s"] for r in results)
        p50s = sorted((r["latency_ms"] or {}).get("p50", float("nan")) for r in results)
        statuses: dict[str, int] = {}
        for r in results:
            for k, v in r["status_counts"].items():
                statuses[k] = statuses.get(k, 0) + v
        cpu = {k: 1e3 * (after[k] - before[k]) / answered if answered else None for k in KINDS}
        cpu["total"] = sum(v for v in cpu.values() if v is not None) if answered else None
        return {"gateways": len(addresses), "in_flight": in_flight, "clients": n, "streaming": streaming,
                "rows": rows, "throughput": rows * sum(r["throughput_rps"] for r in results),
                "p50_ms": p50s[len(p50s) // 2],
                "p99_ms": max((r["latency_ms"] or {}).get("p99", float("nan")) for r in results),
                "mean_batch": next((r["mean_batch_size"] for r in results if r["mean_batch_size"]), None),
                "statuses": statuses, "cpu_ms_per_request": cpu}

    def close(self) -> None:
        for c in self.conns:
            c.send(None)
        for p in self.procs:
            p.join(5)


@contextlib.contextmanager
def pinned(cores: list[int] | None):
    """This process (and the services it starts inside, which inherit it) on `cores`, if given."""
    if not cores:
        yield
        return
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved)


class GrowingMesh:
    """A mesh started with one gateway and one executor, to which gateways (each on a port of its own)
    and executors are added while it runs."""

    def __init__(self, repo: pathlib.Path, env: dict[str, str | None] | None = None, log_level: str = "WARNING",
                 cores: list[int] | None = None) -> None:
        self.repo, self.cores = repo, cores
        self.mesh = Mesh(_common.mesh_args(repo, log_level, executors=1, gateways=1, metrics_port=-1), env=env)
        self.addresses: list[str] = []
        self.executors = 1

    def __enter__(self) -> "GrowingMesh":
        with pinned(self.cores):
            self.addresses.append(self.mesh.start())
        self.store = AdminStore(connect_sync(self.mesh.redis_url, 2))
        return self

    def __exit__(self, *exc) -> None:
        self.mesh.stop()

    def gateways(self, n: int) -> list[str]:
        """The addresses of `n` gateways, starting the ones missing."""
        while len(self.addresses) < n:
            gid = f"gateway-{len(self.addresses)}"
            with pinned(self.cores):
                self.mesh.supervisor.spawn(gid, "gateway", "--port", "0", "--model-control-mode", "none",
                                           "--gateway-id", gid, "--metrics-port", "-1")
            self.addresses.append(self.mesh._wait_ready(self.store, gateway=gid))
        return self.addresses[:n]

    def add_executor(self, timeout: float = 180.0) -> None:
        eid = f"executor-{self.executors}"
        with pinned(self.cores):
            self.mesh.supervisor.spawn(eid, "executor", "--model-repository", str(self.repo), "--executor-id", eid,
                                       "--metrics-port", "-1", "--nice", "5", "--model-control-mode", "none")
        self.executors += 1
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.mesh.supervise()
            live = self.store.live_executors()
            if executors_up(live, self.executors):
                return
            time.sleep(0.2)
        raise RuntimeError(f"{eid} did not register within {timeout:.0f} s")

    def providers(self) -> dict[str, dict[str, str]]:
        """Per executor, model:version -> the provider it reports running on (`batchline status`)."""
        from batchline.status import gather

        return {e["id"]: {f"{m['name']}:{m['version']}": m["provider"] for m in e["models"]}
                for e in gather(self.store)["executors"]}
