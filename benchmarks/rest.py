"""The REST port against gRPC, and against Triton's HTTP endpoint: mlp, binary tensors, closed loop.

    python benchmarks/rest.py [--rounds 3] [--duration 10] [--concurrency 32] [--no-sweep] [--quick]
                              [--peer-python /work/peers/triton/bin/python]

One mesh serves gRPC and REST from the same gateway; each round measures mlp at --concurrency in
flight over gRPC unary ModelInfer, over REST with Triton's binary tensor data extension (the same
pool of requests, `batchline bench --protocol http`), and, when the peer's virtualenv is there
(benchmarks/vs_triton.py says how to make it), over Triton's own HTTP endpoint (pytriton, ONNX
Runtime in its Python backend) at its best setting on this host: first vs_triton.py's sweep of
Triton's settings for mlp (every layout at every max_queue_delay; measured over HTTP), printed,
then the rounds with the sweep's pick (--no-sweep: batchline's config.toml settings), the order
rotating from round to round. It prints each round, with the CPU per request of the client, the
server (the gateway, or Triton) and the rest of the mesh (psutil, the warm-up included at the
step's rate), and the medians of each round's REST / gRPC (target >= 0.8) and REST / Triton HTTP
(target >= 1.0). --quick is one short round,
to see that the script runs.
"""
from __future__ import annotations

import os
import statistics
import sys

import _common
from batchline.bench import run_closed
from batchline.mesh import Mesh

TARGETS = {"grpc": 0.8, "triton-http": 1.0}


def main() -> int:
    p = _common.arg_parser(__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight (default: 32)")
    p.add_argument("--peer-python", default="/work/peers/triton/bin/python",
                   help="the Python of the virtualenv with nvidia-pytriton; Triton is left out when it is not there "
                        "(default: /work/peers/triton/bin/python)")
    p.add_argument("--no-sweep", action="store_true", help="Triton with batchline's config.toml settings, unswept")
    p.add_argument("--sweep-duration", type=float, default=5.0, help="measured seconds per sweep step (default: 5)")
    p.add_argument("--sweep-warmup", type=float, default=2.0, help="warm-up seconds per sweep step (default: 2)")
    p.add_argument("--quick", action="store_true", help="one round of 2 s (warm-up 0.5 s): does the script run")
    _common.step_args(p, duration=10.0, rounds=3)
    args = p.parse_args()
    if args.quick:
        args.rounds, args.duration, args.warmup = 1, 2.0, 0.5
        args.sweep_duration, args.sweep_warmup = 1.0, 0.5
    print(f"machine: {_common.machine()}")
    repository = _common.ensure_repository(args.model_repository)
    mesh = Mesh(_common.mesh_args(repository, args.log_level, http_port=0))
    peer = None
    try:
        address = mesh.start()
        targets = {"grpc": (address, "grpc"), "rest": (f"127.0.0.1:{mesh.http_port}", "http")}
        if os.path.exists(args.peer_python):
            from vs_triton import AS_CONFIGURED, Triton, Workload, sweep

            peer = Triton(repository, args.peer_python)
            best = AS_CONFIGURED
            if not args.no_sweep:
                best, steps = sweep(peer, Workload("mlp binary over HTTP", "mlp", args.concurrency, protocol="http"),
                                    args)
                print(f"Triton's best setting for mlp here: {best.name} (of {len(steps)} tried)")
            peer.serve(("--models", "mlp", *best.flags))
            targets["triton-http"] = (peer.http_address, "http")
        else:
            print(f"Triton left out: no {args.peer_python} (benchmarks/vs_triton.py says how to make it)")
        runs: dict[str, list[float]] = {name: [] for name in targets}
        cpu: dict[str, list[dict[str, float]]] = {name: [] for name in targets}
        names = list(targets)
        for k in range(args.rounds):
            order = names[k % len(names):] + names[:k % len(names)]
            for name in order:
                url, protocol = targets[name]
                before = _common.cpu_seconds(rest="triton")
                step = run_closed(url, "mlp", args.concurrency, args.duration, warmup=args.warmup,
                                  budget_ms=_common.CAPACITY_BUDGET_MS, progress=args.progress, protocol=protocol)
                spent = _common.cpu_seconds(rest="triton") - before
                runs[name].append(step.throughput_rps)
                answered = step.throughput_rps * (args.duration + args.warmup) or 1
                server = "triton" if name == "triton-http" else "gateway"
                ms = {"client": spent["client"] / answered * 1e3, "server": spent[server] / answered * 1e3,
                      "rest": sum(v for k, v in spent.items() if k not in ("client", server)) / answered * 1e3}
                cpu[name].append(ms)
                lat = step.latency_ms or {}
                print(f"round {k + 1} {name:12s} {step.throughput_rps:8.0f} req/s  p50 {_common.f(lat.get('p50'))} ms"
                      f"  p99 {_common.f(lat.get('p99'))} ms  CPU ms/request: client {ms['client']:.3f}, "
                      f"server {ms['server']:.3f}, rest {ms['rest']:.3f}  {step.status_counts}")
    finally:
        if peer is not None:
            peer.stop()
        mesh.stop()
    print()
    rows = [["target", "median req/s", "REST / it", "goal", "CPU ms/request: client", "server", "rest of the mesh"]]
    for name, values in runs.items():
        median = statistics.median(values)
        # The median of each round's ratio: the rounds ran side by side, each in its own spell of the host.
        ratio = statistics.median(r / v if v else float("nan") for r, v in zip(runs["rest"], values))
        rows.append([name, f"{median:.0f}", "" if name == "rest" else f"{ratio:.2f}",
                     f">= {TARGETS[name]:g}" if name in TARGETS else "",
                     *(f"{statistics.median(m[key] for m in cpu[name]):.3f}" for key in ("client", "server", "rest"))])
    print(_common.table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
