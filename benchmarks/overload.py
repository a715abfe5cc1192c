"""Twice the load the mesh can serve within the budget: deadline-aware scheduling vs plain FIFO batching.

    python benchmarks/overload.py [--model-repository PATH] [--seq-len 32] [--budget-ms 200] [--streaming]

1. Capacity at the budget, the way Triton's perf_analyzer reports throughput under a latency
   limit: closed loop with --budget-ms budgets at each --concurrency-sweep value; the capacity is
   the best goodput among the steps where at least 99% of the requests were answered OK within the
   budget. While the last step's admitted requests still meet that and it gains goodput, the sweep
   goes on (half as many in flight again, at least 4 more, up to --concurrency), so that a fast
   host's capacity is not understated. A refused request's worker waits out its retry-after hint
   before it sends again. It also prints the capacity over admitted
   requests only (the best goodput where 99% of those not refused with RESOURCE_EXHAUSTED made it),
   and goodput / that: counting refusals as misses rewards a stricter admission control with a
   lower capacity. For reference it also prints the throughput without a deadline (closed loop,
   --concurrency in flight, 60 s budgets), which a --budget-ms budget cannot reach when one full
   batch takes about as long as the budget.
2. Open-loop Poisson arrivals at --factor x the larger of the two capacities with --budget-ms
   budgets, on a fresh mesh per scheduler policy (BATCHLINE_SCHEDULER_POLICY=deadline, then fifo):
   goodput / capacity (both), the share of admitted requests (not refused at admission with
   RESOURCE_EXHAUSTED) answered OK within the budget, p99 of admitted requests' answers (any
   status) and of OK answers, counts by status, and how late the load generator sent (p99; large
   values mean the client fell behind).
3. gRPC's floor (grpc_floor.py, measured first, before any mesh): the CPU a bare grpc.aio server
   that refuses everything and the bench's client spend per call. If the capacity C fills the
   cores (k = cores / C CPU ms a request) and every refusal costs at least that floor c, offering
   --factor f x C leaves goodput / capacity at most (k - f c) / (k - c): the cap it prints.
4. Where the cores went: CPU ms per request sent (answered or refused) of the load generator
   (this process), the gateway, Redis, the scheduler and the executor, in the capacity's step and
   in each open-loop run, and the cores they used in all.

Requests are unary ModelInfer calls, or with --streaming messages on ModelStreamInfer streams
throughout (capacity and overload alike): a refusal is then a message on an open stream rather than
a whole gRPC call, whose cost on gateway and load generator comes out of the model's cores.

A scheduler without the `policy` setting runs once, as it is, and the report says so.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Callable

import _common
import grpc_floor
from batchline.bench import InputOptions, StepResult, run_closed, run_open

POLICIES = ["deadline", "fifo"]
ROLES = ["client", "gateway", "redis", "scheduler", "executor"]


def with_cpu(run, duration: float) -> tuple[StepResult, dict[str, float], float]:
    """A step, the CPU ms each process spent per request it sent, and the cores used in all. The
    warm-up's CPU is in the deltas too: spread over the requests of both windows at the step's rate."""
    before, t0 = _common.cpu_seconds(), time.monotonic()
    step = run()
    after, elapsed = _common.cpu_seconds(), time.monotonic() - t0
    requests = max(1.0, step.sent / duration * elapsed)
    spent = {k: after[k] - before.get(k, 0.0) for k in after}
    return step, {k: v * 1e3 / requests for k, v in spent.items()}, sum(spent.values()) / elapsed


def policy_supported() -> bool:
    from scheduler.settings import SchedulerSettings

    return "policy" in SchedulerSettings.model_fields


def in_budget(step: StepResult) -> float:
    """The share of the requests sent that were answered OK within the budget."""
    return step.good / step.sent if step.sent else 0.0


def admitted_in_budget(step: StepResult) -> float:
    """The share of the requests admitted (not refused with RESOURCE_EXHAUSTED) answered OK within the budget."""
    admitted = step.sent - step.status_counts.get("RESOURCE_EXHAUSTED", 0)
    return step.good / admitted if admitted else 0.0


def sweep_capacity(step: Callable[[int], StepResult], sweep: list[int], most: int) -> list[StepResult]:
    """`step` at each concurrency of `sweep` (extended in place). On a faster host the sweep's last
    step can still be well within the budget, and the capacity would then be understated (and
    goodput / capacity flattered): it goes on while the last step's admitted requests meet the
    budget and it still gains goodput, up to `most` in flight."""
    steps = [step(c) for c in sweep]
    while (admitted_in_budget(steps[-1]) >= 0.99 and sweep[-1] < most
           and (len(steps) < 2 or steps[-1].goodput_rps > steps[-2].goodput_rps)):
        sweep.append(min(most, sweep[-1] + max(4, sweep[-1] // 2)))
        steps.append(step(sweep[-1]))
    return steps


def capacity_of(steps: list[StepResult]) -> tuple[StepResult | None, float]:
    """The step of the capacity at the budget (the best goodput with 99% of the requests sent answered
    OK in budget; None if none did), and the capacity over admitted requests only: counting a refusal
    as a miss makes a stricter admission control lower the capacity and so raise goodput / capacity,
    which the capacity over admitted requests does not reward."""
    meeting = [st for st in steps if in_budget(st) >= 0.99]
    if not meeting:
        return None, 0.0
    cap = max(meeting, key=lambda r: r.goodput_rps)
    return cap, max((st.goodput_rps for st in steps if admitted_in_budget(st) >= 0.99), default=cap.goodput_rps)


def main() -> int:
    p = _common.arg_parser(__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=32, help="minilm tokens per request (default: 32)")
    p.add_argument("--concurrency", type=int, default=64,
                   help="closed-loop concurrency for the throughput without a deadline, "
                        "and the most the capacity sweep goes to "
                        "(default: 64)")
    p.add_argument("--concurrency-sweep", default="2,4,8,12,16",
                   help="closed-loop concurrencies tried with --budget-ms budgets for the capacity, "
                        "extended while the last "
                        "still meets the budget and gains goodput (default: 2,4,8,12,16)")
    p.add_argument("--factor", type=float, default=2.0, help="offered load / capacity (default: 2)")
    p.add_argument("--budget-ms", type=float, default=200.0, help="per-request budget (default: 200)")
    _common.step_args(p, duration=15.0)
    p.add_argument("--streaming", action="store_true",
                   help="send every request as a message on ModelStreamInfer streams (closed loop: one per worker; "
                        "open loop: four) instead of as a unary call")
    args = p.parse_args()
    repo = _common.ensure_repository(args.model_repository)
    inputs = InputOptions(seq_len=args.seq_len, int_ranges={"input_ids": (1000, 29000)})
    calls = "ModelStreamInfer streams" if args.streaming else "unary calls"
    print(f"machine: {_common.machine()}; minilm {args.seq_len} tokens, budget {args.budget_ms:g} ms, {calls}")

    floor = grpc_floor.floor_here()["stream" if args.streaming else "unary"]
    print(f"gRPC's floor (a bare grpc.aio server and the bench's client, CPU per call): {floor:.2f} ms", flush=True)

    supported = policy_supported()
    policies = POLICIES if supported else [None]
    if not supported:
        print("NOTE: the scheduler has no `policy` setting yet: one run with the scheduler as it is")

    # Capacity with the default policy. Outside load on a shared machine only ever lowers a
    # result, so the better of two runs counts where a run is repeated.
    sweep = [int(c) for c in args.concurrency_sweep.split(",")]
    with _common.mesh(repo, log_level=args.log_level) as address:
        unbounded = max((run_closed(address, "minilm", args.concurrency, args.duration, warmup=args.warmup,
                                    inputs=inputs, budget_ms=_common.CAPACITY_BUDGET_MS, progress=args.progress,
                                    streaming=args.streaming)
                         for _ in range(2)), key=lambda r: r.throughput_rps)
        cpu: dict[int | str, tuple[dict[str, float], float]] = {}  # by concurrency, then by policy

        def step(c: int) -> StepResult:
            st, per_request, cores = with_cpu(lambda: run_closed(
                address, "minilm", c, args.duration, warmup=args.warmup, inputs=inputs, budget_ms=args.budget_ms,
                progress=args.progress, streaming=args.streaming), args.duration)
            cpu[c] = (per_request, cores)
            return st

        steps = sweep_capacity(step, sweep, args.concurrency)
    print(f"throughput without a deadline: {unbounded.throughput_rps:.0f} req/s (closed loop, {args.concurrency} "
          f"in flight, 60 s budgets, mean batch {_common.f(unbounded.mean_batch_size)})")
    for c, st in zip(sweep, steps):
        print(f"  {c} in flight, {args.budget_ms:g} ms budgets: goodput {st.goodput_rps:.0f}/s, "
              f"{100 * in_budget(st):.1f}% OK within budget, mean batch {_common.f(st.mean_batch_size)}, "
              f"{st.status_counts}")
    cap, admitted_cap = capacity_of(steps)
    if cap is None:
        print(f"no concurrency in {sweep} answered 99% within {args.budget_ms:g} ms: lower --concurrency-sweep")
        return 1
    capacity = cap.goodput_rps
    # Offered: twice the larger of the two, so that a sweep whose refusals pulled the first one
    # down does not make the overload lighter than twice what the mesh was seen to serve.
    rate = args.factor * max(capacity, admitted_cap)
    print(f"capacity at the budget: {capacity:.0f} req/s ({cap.concurrency} in flight, "
          f"p99 {_common.f((cap.latency_ms or {}).get('p99'))} ms, mean batch {_common.f(cap.mean_batch_size)})")
    print(f"capacity over admitted requests only (refusals not counted as misses): {admitted_cap:.0f} req/s")
    print(f"offered: Poisson {rate:.0f} req/s ({args.factor:g} x the larger capacity)", flush=True)

    results: dict[str, StepResult] = {}
    for policy in policies:
        env = {"BATCHLINE_SCHEDULER_POLICY": policy} if policy else {}
        with _common.mesh(repo, env=env, log_level=args.log_level) as address:
            s, per_request, cores = with_cpu(lambda: run_open(
                address, "minilm", rate, args.duration, warmup=args.warmup, budget_ms=args.budget_ms, inputs=inputs,
                progress=args.progress, streaming=args.streaming), args.duration)
        results[policy or "(no policy setting)"] = s
        cpu[policy or "(no policy setting)"] = (per_request, cores)
        print(f"  {policy or 'as is'}: goodput {s.goodput_rps:.0f}/s, {s.status_counts}", flush=True)

    rows = [["policy", "offered/s", "goodput/s", "goodput/capacity", "goodput/capacity over admitted",
             "admitted OK in budget",
             "p99 admitted ms", "p99 OK ms", "rejected (RESOURCE_EXHAUSTED)", "DEADLINE_EXCEEDED", "other",
             "client lag p99 ms"]]
    for name, s in results.items():
        c = s.status_counts
        rejected = c.get("RESOURCE_EXHAUSTED", 0)
        other = sum(v for k, v in c.items() if k not in ("OK", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"))
        rows.append([
            name, f"{s.offered_rps:.0f}", f"{s.goodput_rps:.0f}", f"{s.goodput_rps / capacity:.2f}",
            f"{s.goodput_rps / admitted_cap:.2f}",
            f"{100 * admitted_in_budget(s):.1f}%" if s.sent > rejected else "-",
            _common.f((s.admitted_latency_ms or {}).get("p99")), _common.f((s.latency_ms or {}).get("p99")),
            str(rejected), str(c.get("DEADLINE_EXCEEDED", 0)), str(other), _common.f(s.send_lag_p99_ms),
        ])
    print()
    print(_common.table(rows))
    request_ms = len(os.sched_getaffinity(0)) * 1e3 / capacity
    print(f"gRPC's floor alone ({floor:.2f} ms a refusal; {request_ms:.2f} ms a request if the capacity fills the "
          f"cores) caps goodput/capacity at {grpc_floor.overload_cap(request_ms, floor, args.factor):.2f} here")
    rows = [["run", *ROLES, "total", "cores used"]]
    for name, key in [(f"capacity ({cap.concurrency} in flight)", cap.concurrency), *((n, n) for n in results)]:
        per_request, cores = cpu[key]
        rows.append([name, *(f"{per_request.get(r, 0.0):.3f}" for r in ROLES),
                     f"{sum(per_request.get(r, 0.0) for r in ROLES):.3f}", f"{cores:.2f}"])
    print("\nCPU ms per request sent (answered or refused), by process:")
    print(_common.table(rows))
    if "deadline" in results and "fifo" in results and results["fifo"].goodput_rps > 0:
        print(f"goodput deadline/fifo = {results['deadline'].goodput_rps / results['fifo'].goodput_rps:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
