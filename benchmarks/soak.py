"""Soak test: steady open-loop load with faults injected on a schedule, watching for leaks.

    python benchmarks/soak.py --minutes 10            # capacity measured first, then 70 % of it
    python benchmarks/soak.py --minutes 1 --rate 150  # a fixed rate (requests/s)

Runs the real services as subprocesses (batchline/testing/processes.py: a private Redis,
N executors, one scheduler, one gateway), measures what the mesh serves in a
closed loop for --capacity-s seconds (unless --rate), then sends mlp requests
at --load-fraction of that, open loop, for --minutes. Meanwhile, every
--fault-interval-s (60 s, or a quarter of a short run) an executor is
SIGKILLed and restarted; once the scheduler is SIGKILLed and restarted, and
once Redis is (it comes back empty).

Every --sample-s (10 s) it samples the RSS of every service process, Redis
DBSIZE and `used_memory`, and what the requests did, prints a row and finally
writes everything to JSON. At the end it compares each service's RSS, the
Redis memory with their value after warm-up (in the same process: a
restarted service is judged from its restart), and the key count at rest
after the load with the one at rest before it (under load the count moves
with the requests in flight, whose keys all expire), and calls them flat
when end <= --flat-factor x baseline. Exit status 1 when something did
not stay flat, an answer was wrong, or a call outlived its budget.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import signal
import sys
import tempfile
import threading
import time
from collections import Counter

from batchline.testing.load import LoadClient, Record, summarize
from batchline.testing.polling import MeshError
from batchline.testing.processes import ProcessMesh

ROOT = pathlib.Path(__file__).resolve().parent.parent

MB = 1024 * 1024


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--minutes", type=float, default=10.0,
                   help="length of the soak, after the capacity run (default: 10)")
    p.add_argument("--rate", type=float, default=0.0,
                   help="requests per second, open loop (default: --load-fraction of the measured capacity)")
    p.add_argument("--load-fraction", type=float, default=0.7, help="share of the capacity to send (default: 0.7)")
    p.add_argument("--capacity-s", type=float, default=15.0,
                   help="length of the closed-loop capacity run (default: 15)")
    p.add_argument("--capacity-concurrency", type=int, default=16,
                   help="requests in flight while measuring (default: 16)")
    p.add_argument("--executors", type=int, default=3, help="executor processes (default: 3)")
    p.add_argument("--budget-s", type=float, default=10.0, help="latency budget of each request (default: 10)")
    p.add_argument("--fault-interval-s", type=float, default=0.0,
                   help="seconds between executor kills (default: 60, or a quarter of a run shorter than 4 minutes)")
    p.add_argument("--sample-s", type=float, default=10.0, help="seconds between samples (default: 10)")
    p.add_argument("--warmup-s", type=float, default=0.0,
                   help="samples before this are not baselines (default: a quarter of the run, at most 60 s)")
    p.add_argument("--flat-factor", type=float, default=1.2,
                   help="flat means end <= this x warm-up value (default: 1.2)")
    p.add_argument("--model-repository", default="",
                   help="demo model repository (default: model_repository/ or .cache/model_repository/ at the "
                        "project root, built if neither exists)")
    p.add_argument("--log-dir", default="", help="service logs and the JSON report go here (default: a new temp dir)")
    p.add_argument("--json", default="", help="where to write the JSON report (default: <log-dir>/soak.json)")
    p.add_argument("--log-level", default="WARNING", help="log level of the services (default: WARNING)")
    return p.parse_args(argv)


def repository(arg: str) -> pathlib.Path:
    if arg:
        path = pathlib.Path(arg)
    else:
        candidates = [ROOT / "model_repository", ROOT / ".cache" / "model_repository"]
        path = next((c for c in candidates if (c / "mlp").exists()), candidates[0])
    if not (path / "mlp").exists():
        from batchline.demo_models import build_repository

        print(f"building the demo model repository in {path} ...", flush=True)
        build_repository(path)
    return path


# -- faults ------------------------------------------------------------------------------


class Faults(threading.Thread):
    """Injects the schedule's faults at their times (seconds from the start of the soak)."""

    def __init__(self, mesh: ProcessMesh, schedule: list[tuple[float, str]], t0: float):
        super().__init__(name="faults", daemon=True)
        self.mesh = mesh
        self.schedule = schedule
        self.t0 = t0
        self.events: list[dict] = []
        self.stop_event = threading.Event()
        self._victims = 0

    def run(self) -> None:
        for at, kind in self.schedule:
            if self.stop_event.wait(max(0.0, self.t0 + at - time.monotonic())):
                return
            started = time.monotonic()
            try:
                detail = getattr(self, f"_{kind}")()
                ok = True
            except MeshError as exc:
                detail, ok = str(exc).splitlines()[0], False
            event = {"t": round(started - self.t0, 1), "fault": kind, "detail": detail, "ok": ok,
                     "took_s": round(time.monotonic() - started, 2)}
            self.events.append(event)
            print(f"  [t={event['t']:>6.1f}s] {kind}: {detail} ({event['took_s']} s)", flush=True)

    def _kill_executor(self) -> str:
        names = self.mesh.executors
        victim = names[self._victims % len(names)]
        self._victims += 1
        held = self.mesh.probe.held_batches(victim)
        self.mesh.kill(victim, signal.SIGKILL)
        self.mesh.wait_exit(victim, 10)
        self.mesh.probe.wait_executor_gone(victim)
        self.mesh.restart(victim)
        self.mesh.probe.wait_for_executors(len(names), 60)
        return f"SIGKILLed {victim} (holding {held} batches), restarted"

    def _kill_scheduler(self) -> str:
        name = self.mesh.schedulers[0]
        self.mesh.kill(name, signal.SIGKILL)
        self.mesh.wait_exit(name, 10)
        self.mesh.restart(name)
        return f"SIGKILLed {name}, restarted"

    def _restart_redis(self) -> str:
        self.mesh.restart_redis()
        self.mesh.probe.wait_for_executors(len(self.mesh.executors), 60)
        return "SIGKILLed Redis, started it again (empty); executors registered again"


def fault_schedule(duration: float, interval: float) -> list[tuple[float, str]]:
    """An executor kill every `interval`, the scheduler kill after the first and the Redis
    restart after the second, all at least half an interval before the end."""
    last = duration - interval / 2
    schedule = [(k * interval, "kill_executor") for k in range(1, int(duration // interval) + 1)
                if k * interval <= last]
    for at, kind in ((1.5 * interval, "kill_scheduler"), (2.5 * interval, "restart_redis")):
        if at <= last:
            schedule.append((at, kind))
    return sorted(schedule)


# -- sampling ----------------------------------------------------------------------------


def sample(mesh: ProcessMesh, load: LoadClient, t0: float, since: float) -> dict:
    now = time.monotonic()
    recent = [r for r in load.snapshot() if since <= r.end < now]
    s = summarize(recent)
    redis_info = {"keys": None, "used_memory": None}
    try:
        redis_info["keys"] = mesh.probe.redis.dbsize()
        redis_info["used_memory"] = int(mesh.probe.redis.info("memory")["used_memory"])
    except Exception:  # noqa: BLE001 - Redis may be restarting right now
        pass
    pids = mesh.pids()
    rss = mesh.rss()
    return {
        "t": round(now - t0, 1),
        "rate": round(len(recent) / max(1e-9, now - since), 1),
        "ok": s["ok"],
        "failed": s["sent"] - s["ok"],
        "by_status": s["by_status"],
        "ok_p99_ms": s["ok_p99_ms"],
        "in_flight": load.in_flight,
        "rss": rss,
        "pids": pids,
        **redis_info,
    }


def print_header(services: list[str]) -> None:
    cols = "".join(f"{n[:10]:>11}" for n in services)
    print(f"{'t(s)':>7}{'req/s':>8}{'ok':>7}{'failed':>7}{'p99ms':>8}{'inflt':>6}{cols}{'keys':>8}{'redisMB':>9}",
          flush=True)


def print_row(row: dict, services: list[str]) -> None:
    cols = "".join(f"{row['rss'][n] / MB:>10.1f}M" if n in row["rss"] else f"{'-':>11}" for n in services)
    p99 = f"{row['ok_p99_ms']:.0f}" if row["ok_p99_ms"] is not None else "-"
    keys = row["keys"] if row["keys"] is not None else "-"
    mem = f"{row['used_memory'] / MB:.1f}" if row["used_memory"] is not None else "-"
    print(f"{row['t']:>7.1f}{row['rate']:>8.1f}{row['ok']:>7}{row['failed']:>7}{p99:>8}{row['in_flight']:>6}{cols}"
          f"{keys:>8}{mem:>9}", flush=True)


SETTLE_S = 30.0


def flatness(samples: list[dict], warmup_s: float, factor: float, services: list[str],
             keys_at_rest: tuple[int | None, int | None] = (None, None)) -> dict:
    """Per series: the first sample after warm-up in the same process as the last sample, and
    at least SETTLE_S after that process appeared (a Redis restarted empty, or a service restarted
    cold, is not a baseline until it has settled), against the last sample."""

    def judge(values: list[tuple[float, int | None, float | None]]) -> dict:
        values = [v for v in values if v[2] is not None]
        if not values:
            return {"verdict": "n/a (no samples)"}
        t_end, pid_end, end = values[-1]
        born = next(t for t, pid, _ in values if pid == pid_end)
        base = next(((t, v) for t, pid, v in values if t >= max(warmup_s, born + SETTLE_S) and pid == pid_end), None)
        if base is None or base[0] == t_end:
            return {"end": end, "verdict": "n/a (restarted too late to judge)"}
        flat = end <= factor * base[1]
        return {"baseline_t": base[0], "baseline": base[1], "end": end,
                "ratio": round(end / base[1], 3) if base[1] else None,
                "flat": flat, "verdict": "flat" if flat else "GREW"}

    out = {}
    for name in services + ["redis"]:
        out[f"rss:{name}"] = judge([(s["t"], s["pids"].get(name), s["rss"].get(name)) for s in samples])
    redis_pid = [(s["t"], s["pids"].get("redis")) for s in samples]
    before, after = keys_at_rest
    if before and after is not None:
        flat = after <= factor * before
        out["redis:keys at rest"] = {"baseline": before, "end": after, "ratio": round(after / before, 3), "flat": flat,
                                     "verdict": "flat" if flat else "GREW"}
    else:
        out["redis:keys at rest"] = {"verdict": "n/a (no count at rest)"}
    out["redis:used_memory"] = judge([(t, pid, s["used_memory"]) for (t, pid), s in zip(redis_pid, samples)])
    return out


# -- main ----------------------------------------------------------------------------------


def measure_capacity(address: str, model: pathlib.Path, seconds: float, concurrency: int, budget_s: float) -> float:
    client = LoadClient(address, model, concurrency=concurrency, budget_s=budget_s, seed=1)
    client.start()
    time.sleep(2.0)  # warm the connections and the latency profile; not counted
    start = time.monotonic()
    time.sleep(seconds)
    end = time.monotonic()
    records = client.stop()
    ok = [r for r in records if r.code == "OK" and start <= r.end < end]
    return len(ok) / (end - start)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    repo = repository(args.model_repository)
    model = repo / "mlp" / "1" / "model.onnx"
    log_dir = pathlib.Path(args.log_dir or tempfile.mkdtemp(prefix="batchline-soak-"))
    json_path = pathlib.Path(args.json) if args.json else log_dir / "soak.json"
    duration = args.minutes * 60
    interval = args.fault_interval_s or (60.0 if duration >= 240 else duration / 4)
    warmup_s = args.warmup_s or min(60.0, duration / 4)

    mesh = ProcessMesh(repo, log_dir, log_level=args.log_level)
    print(f"soak: logs in {log_dir}", flush=True)
    try:
        mesh.start(executors=args.executors)
        address = mesh.probe.gateway_address()
        services = list(mesh.services)
        print(f"soak: mesh up at {address}: {', '.join(f'{n}={p}' for n, p in mesh.pids().items())}", flush=True)

        capacity = None
        rate = args.rate
        if not rate:
            capacity = measure_capacity(address, model, args.capacity_s, args.capacity_concurrency, args.budget_s)
            rate = args.load_fraction * capacity
            print(f"soak: capacity {capacity:.1f} req/s (closed loop, {args.capacity_concurrency} in flight); "
                  f"soaking at {rate:.1f} req/s", flush=True)
        else:
            # Some requests before the count of keys at rest, as the capacity run gives: the keys a
            # model that has served keeps (its statistics, profile, load view) are then in it.
            measure_capacity(address, model, 0.5, args.capacity_concurrency, args.budget_s)

        schedule = fault_schedule(duration, interval)
        print(f"soak: {args.minutes:g} min at {rate:.1f} req/s open loop, budget {args.budget_s:g} s; "
              f"warm-up {warmup_s:g} s; "
              f"faults at {', '.join(f'{at:g}s {kind}' for at, kind in schedule) or 'none'}", flush=True)
        load = LoadClient(address, model, rate=rate, budget_s=args.budget_s, seed=2)
        samples: list[dict] = []
        keys_before = mesh.probe.redis.dbsize()  # at rest: what the mesh keeps (registrations, lease, profiles)
        t0 = time.monotonic()
        load.start()
        faults = Faults(mesh, schedule, t0)
        faults.start()
        print_header(services + ["redis"])
        last = t0
        try:
            while True:
                next_at = min(last + args.sample_s, t0 + duration)
                time.sleep(max(0.0, next_at - time.monotonic()))
                row = sample(mesh, load, t0, last)
                last = next_at
                samples.append(row)
                print_row(row, services + ["redis"])
                if time.monotonic() >= t0 + duration:
                    break
        finally:
            faults.stop_event.set()
            records: list[Record] = load.stop()
            faults.join(60)
        final = sample(mesh, load, t0, t0 + duration)  # after the last calls ended: RSS and keys at rest
        samples.append({**final, "rate": None, "ok": 0, "failed": 0, "by_status": {}, "ok_p99_ms": None,
                        "after_load": True})

        totals = summarize(records)
        hung = [r for r in records if r.latency > args.budget_s + 2.0]
        wrong = totals["wrong_output"]
        judged = flatness([s for s in samples if not s.get("after_load")], warmup_s, args.flat_factor, services,
                          (keys_before, final["keys"]))
        report = {
            "args": vars(args), "capacity_rps": capacity, "rate_rps": rate, "duration_s": duration,
            "warmup_s": warmup_s, "schedule": schedule, "faults": faults.events, "samples": samples,
            "requests": totals, "hung_calls": len(hung), "flatness": judged,
            "restarts": {n: s.starts - 1 for n, s in mesh.services.items()},
            "by_status": dict(Counter(r.code for r in records)),
        }
        json_path.write_text(json.dumps(report, indent=2))

        print("\nsoak: requests", json.dumps(totals), flush=True)
        print(f"soak: calls past budget + 2 s: {len(hung)}; wrong answers: {wrong}", flush=True)
        print(f"soak: {'series':<22}{'baseline':>14}{'end':>14}{'ratio':>8}  verdict", flush=True)
        for name, j in judged.items():
            scale = MB if "keys" not in name else 1
            base = f"{j['baseline'] / scale:.1f}" if "baseline" in j else "-"
            end = f"{j['end'] / scale:.1f}" if "end" in j else "-"
            print(f"soak: {name:<22}{base:>14}{end:>14}{str(j.get('ratio', '-')):>8}  {j['verdict']}", flush=True)
        print(f"soak: at rest after the load: keys={final['keys']} redis used_memory="
              f"{(final['used_memory'] or 0) / MB:.1f} MB", flush=True)
        print(f"soak: report written to {json_path}", flush=True)
        grew = [n for n, j in judged.items() if j.get("flat") is False]
        failed_faults = [e for e in faults.events if not e["ok"]]
        if grew:
            print(f"soak: NOT FLAT: {', '.join(grew)}", flush=True)
        if failed_faults:
            print(f"soak: {len(failed_faults)} fault(s) did not complete: {failed_faults}", flush=True)
        return 1 if grew or hung or wrong or failed_faults else 0
    finally:
        codes = mesh.stop()
        print(f"soak: stopped ({codes})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
