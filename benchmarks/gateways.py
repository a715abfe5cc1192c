"""One gateway process or two on one port (`batchline up --gateways N`), side by side.

    python benchmarks/gateways.py [--rounds 3] [--concurrency 32] [--duration 10]

Both meshes stay up for the whole run (one executor, the scheduler, and one or two gateways on a
port they share through SO_REUSEPORT); each round drives mlp unary calls, closed loop, at
--concurrency in flight on 4 connections (the kernel spreads connections, not calls, over the
gateways), on one mesh then the other, the order alternating from round to round. Prints each
round's requests/s and p99, and the median ratio two/one.
"""
from __future__ import annotations

import contextlib
import statistics
import sys

import _common
from batchline.bench import run_closed

CONNECTIONS = 4


def main() -> int:
    p = _common.arg_parser(__doc__.splitlines()[0], progress=False)
    _common.step_args(p, duration=10.0, rounds=3)
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight (default: 32)")
    args = p.parse_args()
    print(f"machine: {_common.machine()}")
    repo = _common.ensure_repository(args.model_repository)
    with contextlib.ExitStack() as stack:
        address = {n: stack.enter_context(_common.mesh(repo, gateways=n, log_level=args.log_level)) for n in (1, 2)}
        runs: dict[int, list] = {1: [], 2: []}
        for r in range(args.rounds):
            for n in ((1, 2) if r % 2 == 0 else (2, 1)):
                step = run_closed(address[n], "mlp", args.concurrency, args.duration, warmup=args.warmup,
                                  budget_ms=_common.CAPACITY_BUDGET_MS, connections=CONNECTIONS)
                runs[n].append(step)
                print(f"round {r + 1}, {n} gateway{'s' if n > 1 else ''}: {step.throughput_rps:.0f} req/s, "
                      f"p99 {_common.f((step.latency_ms or {}).get('p99'))} ms", flush=True)
    ratios = [two.throughput_rps / one.throughput_rps for one, two in zip(runs[1], runs[2]) if one.throughput_rps]
    p99 = {n: statistics.median((s.latency_ms or {}).get("p99", float("nan")) for s in runs[n]) for n in (1, 2)}
    print()
    print(f"mlp unary, {args.concurrency} in flight: "
          f"1 gateway {statistics.median(s.throughput_rps for s in runs[1]):.0f} "
          f"req/s (p99 {p99[1]:.1f} ms), 2 gateways {statistics.median(s.throughput_rps for s in runs[2]):.0f} req/s "
          f"(p99 {p99[2]:.1f} ms); two/one {statistics.median(ratios):.2f}x (median of {len(ratios)} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
