"""The mesh's own overhead: mlp, a model so small that Redis, gRPC and Python are all the cost.

    python benchmarks/mlp_overhead.py [--model-repository PATH] [--concurrency 32]

Starts a mesh and drives mlp closed-loop with one request in flight (the round trip through
gateway, Redis, scheduler and executor) and with --concurrency in flight (requests/s the mesh
sustains when batching can amortise it), first as unary ModelInfer calls, then as messages on
ModelStreamInfer streams (one per slot, like perf_analyzer --streaming: no HTTP/2 stream to open
and close per request, on either side); prints requests/s, latency percentiles, mean batch size.
"""
from __future__ import annotations

import sys

import _common
from batchline.bench import format_table, run_closed


def main() -> int:
    p = _common.arg_parser(__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight (default: 32)")
    _common.step_args(p, duration=10.0)
    args = p.parse_args()
    print(f"machine: {_common.machine()}")
    with _common.mesh(_common.ensure_repository(args.model_repository), log_level=args.log_level) as address:
        steps = [run_closed(address, "mlp", c, args.duration, warmup=args.warmup,
                            budget_ms=_common.CAPACITY_BUDGET_MS, progress=args.progress, streaming=streaming)
                 for c, streaming in ((1, False), (args.concurrency, False), (args.concurrency, True))]
    print()
    print(format_table(steps))
    one, many, streamed = steps
    print(f"mlp: {many.throughput_rps:.0f} req/s at {args.concurrency} in flight, "
          f"p99 {_common.f((many.latency_ms or {}).get('p99'))} ms; "
          f"one in flight: p50 {_common.f((one.latency_ms or {}).get('p50'))} ms round trip")
    print(f"mlp over streams: {streamed.throughput_rps:.0f} req/s at {args.concurrency} in flight, "
          f"p99 {_common.f((streamed.latency_ms or {}).get('p99'))} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
