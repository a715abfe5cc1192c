"""The real mode of benchmarks/autoscale.py: a trace played by an open-loop client against a local
mesh (`batchline up`'s Mesh, in this process) whose executors the policy under test scales.

Predictive is the mesh's own `--autoscale` (Mesh.autoscale with batchline.autoscale.ScalePolicy,
which the simulated mode runs too); reactive swaps in a policy that reads the queue depth (ceil(queued / 32),
as a plain KEDA queue-length scaler would); the static ones start their executors and leave them. Executor-seconds
count every executor process from its start (starting ones included, as in the simulation).
Refused requests are not sent again: each counts once.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import math
import os
import random
import threading
import time
from typing import Callable

from batchline.bench import InputOptions, build_pool
from batchline.bench.loadgen import Endpoint
from batchline.mesh import Mesh
from batchline.protocol import internal_pb2 as pb


class QueueDepthPolicy:
    """⌈queued / threshold⌉ executors, up at once, down to the most asked within the cool-down:
    the KEDA ScaledObject on batchline_pending_requests, as ScalePolicy's stand-in."""

    def __init__(self, depth: Callable[[], int], low: int, high: int, cool_down_s: float, threshold: int) -> None:
        self.depth, self.low, self.high = depth, low, high
        self.cool_down_s, self.threshold = cool_down_s, threshold
        self.recent: list[tuple[float, int]] = []

    def decide(self, now: float, running: int, demand: pb.MeshDemand | None):
        from batchline.autoscale import Decision

        desired = min(self.high, max(self.low, math.ceil(self.depth() / self.threshold)))
        self.recent = [(t, d) for t, d in self.recent if now - t <= self.cool_down_s] + [(now, desired)]
        target = desired if desired > running else max(d for _, d in self.recent)
        if target == running:
            return None
        return Decision(target, "up" if target > running else "down", "queue", f"{self.depth()} queued")


def _mesh(a: argparse.Namespace, repo: str, executors: int, autoscale: str, cool_down_s: float) -> tuple[Mesh, str]:
    args = argparse.Namespace(model_repository=repo, redis_url="", executors=executors, gateways=1, gateway_port=0,
                              host="127.0.0.1", log_level="ERROR", startup_timeout=180.0, metrics_port=-1,
                              autoscale=autoscale, scale_down_cool_down_s=cool_down_s)
    mesh = Mesh(args)
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            return mesh, mesh.start()
        except BaseException:
            mesh.stop()
            raise


def measure(a: argparse.Namespace, repo: str, executors: int = 1, seconds: float = 10.0) -> tuple[float, float, float]:
    """The capacity of `executors` executors on this host: the answers per second a closed loop of 32
    clients (each waiting out a refusal's retry hint) gets from a mesh of that many, after 2 s of
    warm-up; the capacity of one executor the leader computes from the profile it learned meanwhile;
    and the executors' start time the mesh measured."""
    mesh, address = _mesh(a, repo, executors, "", 30.0)
    try:
        goodput = asyncio.run(_closed_loop(address, a, 2.0, seconds))
        deadline = time.monotonic() + 30
        while True:
            blob = mesh.store.demand()
            demand = pb.MeshDemand.FromString(blob) if blob else None
            if demand is not None and demand.models and demand.models[0].capacity > 0 and demand.executor_start_s:
                return goodput, demand.models[0].capacity, demand.executor_start_s
            if time.monotonic() > deadline:
                raise SystemExit("the leader published no capacity within 30 s of the warm-up")
            time.sleep(0.5)
    finally:
        with contextlib.redirect_stdout(io.StringIO()):
            mesh.stop()


async def _closed_loop(address: str, a: argparse.Namespace, warmup_s: float, seconds: float) -> float:
    """Answers per second, counted after the warm-up."""
    async with Endpoint(address, a.model) as ep:
        pool = build_pool(a.model, await ep.inputs(), InputOptions(seq_len=a.seq_len), budget_ms=a.budget_ms)
        begin = time.monotonic() + warmup_s
        end = begin + seconds
        good = 0

        async def client(k: int) -> None:
            nonlocal good
            while (sent := time.monotonic()) < end:
                code, latency, retry_after = await ep.infer_hinted(pool.requests[k % len(pool)],
                                                                   a.budget_ms / 1000 + 1.0)
                # Capacity within the budget: sent in the window and answered in time.
                good += code == "OK" and sent >= begin and latency <= a.budget_ms / 1000
                k += 1
                if code != "OK":
                    # As the hint says: clients that resend a refusal at once measure how fast the
                    # gateway refuses, on the cores the executor needs.
                    await asyncio.sleep(retry_after or 0.01)

        await asyncio.gather(*(client(k) for k in range(32)))
        return good / seconds


def run_real(rate: Callable[[float, random.Random], float], policy: str, seed: int, a: argparse.Namespace,
             repo: str, peak_need: int, cool_down_s: float, period_s: float,
             result_type) -> tuple[object, float, float]:
    """One run of `rate` (requests/s at each second of the run); (a Result, the start time the mesh measured,
    the capacity of one executor the leader last published)."""
    low, high = (int(x) for x in a.bounds.split(":"))
    executors = peak_need if policy == "static-peak" else low
    # The scheduler reads its settings from the environment (services inherit it): the period, for predictive.
    os.environ["BATCHLINE_SCHEDULER_DEMAND_PERIOD_S"] = f"{period_s if policy == 'predictive' else 0:g}"
    try:
        mesh, address = _mesh(a, repo, executors, a.bounds if policy in ("predictive", "reactive") else "",
                              cool_down_s)
    finally:
        del os.environ["BATCHLINE_SCHEDULER_DEMAND_PERIOD_S"]
    if policy == "reactive":
        mesh.policy = QueueDepthPolicy(lambda: mesh.store.depths((a.model, "1"))[0], low, high, cool_down_s,
                                       a.keda_threshold)
    done = threading.Event()
    counts: list[tuple[float, int]] = []
    output = io.StringIO()

    def supervise() -> None:
        with contextlib.redirect_stdout(output):
            while not done.is_set():
                mesh.supervise()
                counts.append((time.monotonic(), len([s for s in mesh.supervisor.services if s.role == "executor"])))
                time.sleep(0.2)

    watcher = threading.Thread(target=supervise, daemon=True)
    watcher.start()
    try:
        r = asyncio.run(_play(address, rate, seed, a, result_type))
    finally:
        done.set()
        watcher.join(30)
        blob = mesh.store.demand()
        with contextlib.redirect_stdout(io.StringIO()):
            mesh.stop()
    r.executor_s = sum((t1 - t0) * n for (t0, n), (t1, _) in zip(counts, counts[1:]))
    r.scale_events = output.getvalue().count("scaling executors")
    demand = pb.MeshDemand.FromString(blob) if blob else pb.MeshDemand()
    return r, demand.executor_start_s, max((m.capacity for m in demand.models), default=0.0)


async def _play(address: str, rate: Callable[[float, random.Random], float], seed: int, a: argparse.Namespace,
                result_type):
    rng = random.Random(seed)
    r = result_type()
    async with Endpoint(address, a.model) as ep:
        pool = build_pool(a.model, await ep.inputs(), InputOptions(seq_len=a.seq_len), budget_ms=a.budget_ms)
        pending: set[asyncio.Task] = set()

        async def one(payload: bytes, due: float) -> None:
            # Timed from when it was due: a client that fell behind must not hide its own queue.
            late = max(0.0, time.monotonic() - due)
            code, latency, _ = await ep.infer_hinted(payload, max(0.001, a.budget_ms / 1000 + 1.0 - late))
            latency += late
            if code == "OK":
                r.answered += 1
                r.latencies.append((latency, 1))
                r.in_budget += latency <= a.budget_ms / 1000
            elif code == "RESOURCE_EXHAUSTED":
                r.refused += 1
            else:
                r.timed_out += 1  # DEADLINE_EXCEEDED, or anything else that did not answer

        start = time.monotonic()
        t = 0.0
        while t < a.real_seconds:
            now_rate = rate(t, rng)
            t += rng.expovariate(now_rate) if now_rate > 0 else 0.01
            await asyncio.sleep(max(0.0, start + t - time.monotonic()))
            task = asyncio.create_task(one(pool.requests[rng.randrange(len(pool))], start + t))
            pending.add(task)
            task.add_done_callback(pending.discard)
        await asyncio.gather(*pending)
    return r
