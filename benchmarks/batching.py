"""What dynamic batching buys: the mesh as configured vs the same models with max_batch_size = 1.

    python benchmarks/batching.py [--model-repository PATH] [--concurrency 32]

Runs two meshes one after the other: the repository as is, then a temporary copy whose
config.toml files say max_batch_size = 1. Each is driven closed-loop at the same concurrency
with minilm (16 tokens) and mlp; prints throughput and p99 of both and their ratios.
"""
from __future__ import annotations

import sys

import _common
from batchline.bench import InputOptions, StepResult, run_closed

WORKLOADS = [
    ("minilm", "minilm 16 tokens", InputOptions(seq_len=16, int_ranges={"input_ids": (1000, 29000)})),
    ("mlp", "mlp", InputOptions()),
]


def drive(address: str, args) -> dict[str, StepResult]:
    out = {}
    for model, label, inputs in WORKLOADS:
        s = run_closed(address, model, args.concurrency, args.duration, warmup=args.warmup, inputs=inputs,
                       budget_ms=_common.CAPACITY_BUDGET_MS, progress=args.progress)
        out[label] = s
        print(f"  {label}: {s.throughput_rps:.0f} req/s, p99 {_common.f((s.latency_ms or {}).get('p99'))} ms, "
              f"mean batch {_common.f(s.mean_batch_size)}, {s.status_counts}", flush=True)
    return out


def main() -> int:
    p = _common.arg_parser(__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight (default: 32)")
    _common.step_args(p, duration=10.0)
    args = p.parse_args()
    repo = _common.ensure_repository(args.model_repository)
    print(f"machine: {_common.machine()}; {args.concurrency} in flight")

    print("batching (repository as configured):")
    with _common.mesh(repo, log_level=args.log_level) as address:
        batched = drive(address, args)
    print("no batching (max_batch_size = 1):")
    unbatched_cfg = {model: {"max_batch_size": "1"} for model, _, _ in WORKLOADS}
    with _common.repository_copy(repo, unbatched_cfg) as copy, _common.mesh(copy, log_level=args.log_level) as address:
        single = drive(address, args)

    rows = [["workload", "req/s batched", "req/s bs=1", "throughput x", "p99 ms batched", "p99 ms bs=1",
             "p99 bs=1/batched", "mean batch"]]
    for label in batched:
        b, s = batched[label], single[label]
        bp99, sp99 = (b.latency_ms or {}).get("p99"), (s.latency_ms or {}).get("p99")
        rows.append([label, f"{b.throughput_rps:.0f}", f"{s.throughput_rps:.0f}",
                     _common.f(b.throughput_rps / s.throughput_rps if s.throughput_rps else None, ".2f"),
                     _common.f(bp99), _common.f(sp99), _common.f(sp99 / bp99 if bp99 and sp99 else None, ".2f"),
                     _common.f(b.mean_batch_size)])
    print()
    print(_common.table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
