"""Two tenants, one model under overload: weighted fair shares against one shared share.

    python benchmarks/fairness.py [--seq-len 64] [--budget-ms 200] [--heavy 5] [--light 0.3] [--rounds 2]

1. Capacity at the budget: closed loop with --budget-ms budgets at a few concurrencies; the best
   goodput among the steps where at least 99% were answered OK within the budget (as overload.py).
2. Per round, two meshes in turn, each with an auth file of two tokens:
   - "fair": the tokens belong to tenants a and b, weight 1 each (gateway/fairness.py shares the
     model between them);
   - "shared": both tokens belong to one tenant, so the mesh cannot tell them apart (what a mesh
     without tenants does).
   Tenant a sends Poisson arrivals at --heavy x capacity, tenant b at --light x capacity, at once,
   each from a `batchline bench` process of its own, both with --budget-ms budgets.
3. Per tenant: offered and goodput (OK within budget) per second, goodput / offered, p99 of the OK
   answers, and how its failures split between refusals (RESOURCE_EXHAUSTED, with a retry hint) and
   timeouts (DEADLINE_EXCEEDED).

The target (issue: tenants and fair shares): b's goodput >= 95% of what it offered, its p99 within
the budget; a refused with retry hints rather than timed out.
"""
from __future__ import annotations

import hashlib
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter

import _common
from batchline.bench import InputOptions, run_closed

TOKENS = {"a": "fairness-bench-token-a", "b": "fairness-bench-token-b"}


def auth_file(path: pathlib.Path, fair: bool) -> None:
    entries = []
    for tenant, token in TOKENS.items():
        digest = hashlib.sha256(token.encode()).hexdigest()
        entries.append(f'[[tokens]]\nsha256 = "{digest}"\ntenant = "{tenant if fair else "shared"}"\n'
                       'models = ["minilm"]\nweight = 1.0\n')
    path.write_text("\n".join(entries))


def bench(address: str, tenant: str, rate: float, args, out: pathlib.Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "batchline.cli", "bench", "--url", address, "--model", "minilm", "--mode", "open",
         "--rate", f"{rate:.1f}", "--budget-ms", str(args.budget_ms), "--duration", str(args.duration),
         "--warmup", str(args.warmup), "--seq-len", str(args.seq_len), "--int-range", "input_ids=1000:29000",
         "--seed", str(ord(tenant)), "--header", f"authorization=Bearer {TOKENS[tenant]}", "--quiet",
         "--json", str(out)], stdout=subprocess.DEVNULL)


def cpu_seconds(benches: dict[str, subprocess.Popen]) -> Counter:
    """CPU seconds so far of the services, Redis and each tenant's client (this script's own left out)."""
    out = _common.cpu_seconds({p.pid: f"client {t}" for t, p in benches.items()})
    del out["client"]
    return out


def one(repo: pathlib.Path, fair: bool, rates: dict[str, float], args, scratch: pathlib.Path) -> dict[str, dict]:
    auth = scratch / "auth.toml"
    auth_file(auth, fair)
    with _common.mesh(repo, env={"BATCHLINE_GATEWAY_AUTH_FILE": str(auth)}, log_level=args.log_level) as address:
        procs = {t: bench(address, t, rates[t], args, scratch / f"{t}.json") for t in rates}
        started, before = time.monotonic(), cpu_seconds(procs)
        after = before
        while any(p.poll() is None for p in procs.values()):
            after = cpu_seconds(procs)  # the last reading before the clients exit
            time.sleep(0.5)
        wall = time.monotonic() - started
        for t, p in procs.items():
            if p.wait(args.duration + args.warmup + 120) != 0:
                raise SystemExit(f"the bench of tenant {t} failed ({p.returncode})")
    print("  cores used: " + ", ".join(f"{k} {(after[k] - before[k]) / wall:.2f}" for k in sorted(after)), flush=True)
    out = {}
    for t in rates:
        step = json.loads((scratch / f"{t}.json").read_text())["steps"][0]
        counts = step["status_counts"]
        out[t] = {"offered": step["offered_rps"], "goodput": step["goodput_rps"],
                  "share": step["goodput_rps"] / step["offered_rps"] if step["offered_rps"] else 0.0,
                  "p99": (step.get("latency_ms") or {}).get("p99"), "refused": counts.get("RESOURCE_EXHAUSTED", 0),
                  "timed_out": counts.get("DEADLINE_EXCEEDED", 0), "counts": counts}
    return out


def main() -> int:
    p = _common.arg_parser(__doc__.splitlines()[0], progress=False)
    p.add_argument("--seq-len", type=int, default=64, help="minilm tokens per request (default: 64)")
    p.add_argument("--budget-ms", type=float, default=200.0, help="per-request budget (default: 200)")
    p.add_argument("--heavy", type=float, default=5.0, help="tenant a's offered load / capacity (default: 5)")
    p.add_argument("--light", type=float, default=0.3, help="tenant b's offered load / capacity (default: 0.3)")
    _common.step_args(p, duration=15.0, rounds=2, rounds_help="alternating rounds of fair and shared")
    args = p.parse_args()
    repo = _common.ensure_repository(args.model_repository)
    inputs = InputOptions(seq_len=args.seq_len, int_ranges={"input_ids": (1000, 29000)})
    print(f"machine: {_common.machine()}; minilm {args.seq_len} tokens, budget {args.budget_ms:g} ms")

    with _common.mesh(repo, log_level=args.log_level) as address:
        steps = [run_closed(address, "minilm", c, args.duration, warmup=args.warmup, inputs=inputs,
                            budget_ms=args.budget_ms) for c in (2, 4, 8, 12)]
    meeting = [s for s in steps if s.sent and s.good / s.sent >= 0.99]
    if not meeting:
        print("no concurrency answered 99% within the budget")
        return 1
    capacity = max(s.goodput_rps for s in meeting)
    rates = {"a": args.heavy * capacity, "b": args.light * capacity}
    print(f"capacity at the budget: {capacity:.0f} req/s; tenant a offers {rates['a']:.0f}/s, b {rates['b']:.0f}/s",
          flush=True)

    results: dict[str, list[dict]] = {"fair": [], "shared": []}
    with tempfile.TemporaryDirectory(prefix="batchline-fairness-") as tmp:
        for r in range(args.rounds):
            for mode in ("fair", "shared"):
                res = one(repo, mode == "fair", rates, args, pathlib.Path(tmp))
                results[mode].append(res)
                print(f"round {r + 1} {mode}: " + "; ".join(
                    f"{t}: goodput {v['goodput']:.0f}/s of {v['offered']:.0f}/s ({100 * v['share']:.1f}%), "
                    f"p99 {_common.f(v['p99'])} ms, {v['counts']}" for t, v in res.items()), flush=True)

    rows = [["mesh", "tenant", "offered/s", "goodput/s", "goodput / offered", "p99 OK ms", "refused", "timed out"]]
    for mode, runs in results.items():
        for t in rates:
            med = {k: statistics.median(run[t][k] or 0.0 for run in runs)
                   for k in ("offered", "goodput", "share", "p99", "refused", "timed_out")}
            rows.append([mode, t, f"{med['offered']:.0f}", f"{med['goodput']:.0f}", f"{100 * med['share']:.1f}%",
                         _common.f(med["p99"]), f"{med['refused']:.0f}", f"{med['timed_out']:.0f}"])
    print(f"\nmedian of {args.rounds} rounds:")
    print(_common.table(rows))
    b = statistics.median(run["b"]["share"] for run in results["fair"])
    a = results["fair"]
    refused = statistics.median(run["a"]["refused"] / max(1, run["a"]["refused"] + run["a"]["timed_out"]) for run in a)
    print(f"\nfair: b's goodput / offered {100 * b:.1f}% (target >= 95%); a's failures refused up front "
          f"{100 * refused:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
