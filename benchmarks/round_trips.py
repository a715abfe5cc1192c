"""What each request and each batch costs in Redis traffic, counted, and in CPU, per process.

    python benchmarks/round_trips.py [--requests 6000] [--concurrency 32] [--rounds 1] [--json PATH]

Starts a mesh serving mlp (a model so small that the mesh's own work is the whole cost), sends a
warm-up, then exactly --requests requests closed loop at --concurrency in flight, and counts over
them: each service's Redis round trips and the commands they carry, by the code that made them
(benchmarks/_redis_count, loaded into the services only here), the commands Redis ran (INFO
commandstats, a script's own calls included), the scheduler's steps (one queue scan each), the
batches run; and, in rounds without the counting hook, the CPU time of each process per request
and the throughput. Counts do not drift with the host's speed; CPU and throughput do (a shared
host), so the rounds alternate with nothing else and the median is printed.
"""
from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter

import psutil

import _common
import batchline
from batchline import eventloop
from batchline.bench import Endpoint, build_pool
from batchline.bench.inputs import InputOptions
from batchline.mesh import Mesh
from batchline.redis_client import connect_sync

HOOK = pathlib.Path(__file__).resolve().parent / "_redis_count"
# The code measured: the checkout whose batchline this Python imports (a run may measure another
# worktree's services with this script).
CODE_ROOT = pathlib.Path(batchline.__file__).resolve().parent.parent
SERVICES = {"-m gateway": "gateway", "-m scheduler": "scheduler", "-m executor": "executor"}


def _services() -> dict[int, str]:
    out = {}
    for child in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(child.cmdline())
        except psutil.Error:
            continue
        for sign, name in SERVICES.items():
            if sign in cmd:
                out[child.pid] = name
    return out


def _snapshot(count_dir: str | None, redis) -> dict:
    """The counts so far: each service's round trips and commands by call site, Redis's commands."""
    snap: dict = {"trips": {}, "commands": {}, "redis": {}}
    if count_dir:
        pids = _services()
        for pid in pids:
            with_path = os.path.join(count_dir, f"{pid}.json")
            if os.path.exists(with_path):
                os.unlink(with_path)
            os.kill(pid, signal.SIGUSR2)
        deadline = time.monotonic() + 10
        for pid, name in pids.items():
            path = os.path.join(count_dir, f"{pid}.json")
            while not os.path.exists(path):
                if time.monotonic() > deadline:
                    raise SystemExit(f"{name} (pid {pid}) wrote no counts: is the hook on its PYTHONPATH?")
                time.sleep(0.01)
            data = json.loads(pathlib.Path(path).read_text())
            for kind in ("trips", "commands"):
                c = snap[kind].setdefault(name, Counter())
                c.update(data[kind])
    for key, fields in redis.info("commandstats").items():
        snap["redis"][key.removeprefix("cmdstat_")] = fields["calls"]
    return snap


async def _load(address: str, requests: int, concurrency: int) -> tuple[float, Counter]:
    """Send exactly `requests` requests, `concurrency` at a time; the seconds it took and the codes."""
    async with Endpoint(address, "mlp") as ep:
        pool = build_pool("mlp", await ep.inputs(), InputOptions(), budget_ms=_common.CAPACITY_BUDGET_MS)
        left = [requests]
        codes: Counter = Counter()

        async def worker(k: int) -> None:
            i = k
            while left[0] > 0:
                left[0] -= 1
                code, _ = await ep.infer(pool.requests[i % len(pool)], 60)
                codes[code] += 1
                i += concurrency

        start = time.perf_counter()
        await asyncio.gather(*(worker(k) for k in range(concurrency)))
        return time.perf_counter() - start, codes


async def _batches(address: str) -> tuple[int, int]:
    async with Endpoint(address, "mlp") as ep:
        return await ep.counts()


def one_mesh(args, counting: bool) -> dict:
    count_dir = tempfile.mkdtemp(prefix="batchline-count-") if counting else None
    env = {}
    if counting:
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(HOOK), os.environ.get("PYTHONPATH")])),
               "BATCHLINE_REDIS_COUNT_DIR": count_dir, "BATCHLINE_REDIS_COUNT_ROOT": str(CODE_ROOT)}
    m = Mesh(_common.mesh_args(args.model_repository, args.log_level), env=env)
    try:
        address = m.start()
        redis = connect_sync(m.redis_url, 5)
        eventloop.run(_load(address, args.warmup_requests, args.concurrency))
        time.sleep(args.settle)
        before = _snapshot(count_dir, redis), _common.cpu_seconds(), eventloop.run(_batches(address))
        seconds, codes = eventloop.run(_load(address, args.requests, args.concurrency))
        after_cpu = _common.cpu_seconds()
        time.sleep(args.settle)
        after = _snapshot(count_dir, redis), eventloop.run(_batches(address))
    finally:
        m.stop()
    (snap0, cpu0, (inf0, exe0)), (snap1, (inf1, exe1)) = before, after
    out = {
        "requests": args.requests, "codes": dict(codes), "seconds": seconds,
        "inferences": inf1 - inf0, "batches": exe1 - exe0,
        "cpu_ms": {k: (after_cpu[k] - cpu0[k]) * 1e3 for k in after_cpu},
    }
    if counting:
        out["trips"] = {s: dict(Counter(snap1["trips"][s]) - Counter(snap0["trips"].get(s, {})))
                        for s in snap1["trips"]}
        out["commands"] = {s: dict(Counter(snap1["commands"][s]) - Counter(snap0["commands"].get(s, {})))
                           for s in snap1["commands"]}
        redis_cmds = Counter(snap1["redis"]) - Counter(snap0["redis"])
        for mine in ("info",):  # this script's own
            redis_cmds.pop(mine, None)
        out["redis"] = dict(redis_cmds)
    return out


def summary(runs: list[dict], counted: dict | None) -> str:
    lines = []
    if counted:
        n, b = counted["requests"], counted["batches"]
        lines.append(f"counted: {n} requests in {b} batches (mean {counted['inferences'] / max(1, b):.2f} rows), "
                     f"answers {counted['codes']}")
        steps = counted["trips"].get("scheduler", {}).get("scheduler/service.py:_scan", 0)
        lines.append(f"scheduler steps per batch: {steps / max(1, b):.2f}")
        rows = [["service", "round trips / request", "/ batch", "client commands / request", "/ batch"]]
        for s in ("gateway", "scheduler", "executor"):
            t, c = sum(counted["trips"].get(s, {}).values()), sum(counted["commands"].get(s, {}).values())
            rows.append([s, f"{t / n:.3f}", f"{t / b:.2f}", f"{c / n:.3f}", f"{c / b:.2f}"])
        total = sum(counted["redis"].values())
        rows.append(["Redis ran (scripts' calls included)", "", "", f"{total / n:.3f}", f"{total / b:.2f}"])
        lines.append(_common.table(rows))
        lines.append("")
        rows = [["call site", "round trips / batch", "commands / batch"]]
        for s in ("gateway", "scheduler", "executor"):
            for site, t in sorted(counted["trips"].get(s, {}).items(), key=lambda kv: -kv[1]):
                rows.append([f"{s}: {site}", f"{t / b:.3f}", f"{counted['commands'][s].get(site, 0) / b:.3f}"])
        lines.append(_common.table(rows))
        lines.append("")
        rows = [["Redis command", "calls / batch"]]
        for cmd, calls in sorted(counted["redis"].items(), key=lambda kv: -kv[1]):
            rows.append([cmd, f"{calls / b:.3f}"])
        lines.append(_common.table(rows))
    if runs:
        lines.append("")
        procs = ["client", "gateway", "redis", "scheduler", "executor"]
        rows = [["round", "req/s", "mean batch", *(f"{p} CPU ms/req" for p in procs), "total"]]
        for i, r in enumerate(runs):
            per = [r["cpu_ms"].get(p, 0) / r["requests"] for p in procs]
            rows.append([str(i + 1), f"{r['requests'] / r['seconds']:.0f}",
                         f"{r['inferences'] / max(1, r['batches']):.2f}",
                         *(f"{x:.3f}" for x in per), f"{sum(per):.3f}"])
        med = [statistics.median(r["cpu_ms"].get(p, 0) / r["requests"] for r in runs) for p in procs]
        rows.append(["median", f"{statistics.median(r['requests'] / r['seconds'] for r in runs):.0f}",
                     f"{statistics.median(r['inferences'] / max(1, r['batches']) for r in runs):.2f}",
                     *(f"{x:.3f}" for x in med), f"{sum(med):.3f}"])
        lines.append(_common.table(rows))
    return "\n".join(lines)


def main() -> int:
    p = _common.arg_parser(__doc__.splitlines()[0], progress=False)
    p.add_argument("--requests", type=int, default=6000, help="requests counted (default: 6000)")
    p.add_argument("--warmup-requests", type=int, default=2000, help="requests before counting (default: 2000)")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight (default: 32)")
    p.add_argument("--rounds", type=int, default=1, help="meshes without the counting hook, for CPU (default: 1)")
    p.add_argument("--no-count", action="store_true", help="skip the counted mesh")
    p.add_argument("--settle", type=float, default=0.5, help="idle seconds around the counted requests")
    p.add_argument("--json", help="write every run's figures here")
    args = p.parse_args()
    args.model_repository = str(_common.ensure_repository(args.model_repository))
    print(f"machine: {_common.machine()}")
    print(f"code: {CODE_ROOT}")
    counted = None if args.no_count else one_mesh(args, counting=True)
    runs = [one_mesh(args, counting=False) for _ in range(args.rounds)]
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"code": str(CODE_ROOT), "counted": counted, "runs": runs},
                                                      indent=1))
    print(summary(runs, counted))
    return 0


if __name__ == "__main__":
    sys.exit(main())
