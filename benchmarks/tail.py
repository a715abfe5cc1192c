"""Where the closed-loop tail comes from: each service stage's quantiles beside the client's.

    python benchmarks/tail.py [--rounds 3] [--duration 15] [--workloads mlp 16 128] [--protocol grpc|http]

Starts one mesh (metrics on known ports) and drives the demo models closed loop with 60 s budgets:
mlp unary at 32 in flight, minilm at 16 and at 128 tokens at 32 in flight, over gRPC unary calls
or, with --protocol http, over the REST port with binary tensors. Each step is warmed up
first, then the gateway's, the scheduler's and the executor's /metrics are scraped before and
after the measured window, and each stage's p50/p90/p99 is read from its histogram's delta
(batchline_stage_*_seconds: enqueue, queue, dispatch, execute, reply; interpolated within a bucket,
as Prometheus' histogram_quantile does) and printed beside the client's end-to-end p50/p99 and the
gateway's (batchline_request_duration_seconds). The stage whose p99 / p50 is largest, and whose p99
is a large share of the client's, is where the tail comes from. --rounds repeats every workload and
prints each round and the medians (the host's speed drifts: compare within a round). Each step also
prints how many batches the scheduler dispatched of each size (batchline_batch_size).

--compare runs two meshes side by side, batches evened over the lanes (the default) and each lane
taking everything queued (BATCHLINE_SCHEDULER_EVEN_LANES_BATCHING=false), in alternating order each
round, and prints each one's tables and the medians of the rounds' ratios.
"""
from __future__ import annotations

import contextlib
import statistics
import sys
import urllib.request

import _common
from batchline.bench import InputOptions, run_closed
from prometheus_client.parser import text_string_to_metric_families

STAGES = ("enqueue", "queue", "dispatch", "execute", "reply")
QUANTILES = (0.5, 0.9, 0.99)
WORKLOADS = {  # name: (model, tokens or None, in flight)
    "mlp unary, 32 in flight": ("mlp", None, 32),
    "minilm 16 tokens, 32 in flight": ("minilm", 16, 32),
    "minilm 128 tokens, 32 in flight": ("minilm", 128, 32),
}
# The mesh's metrics endpoints from the base port: the gateway, the scheduler, the executor.
ENDPOINTS = 3
MODES = {"even lanes": {}, "whole queue": {"BATCHLINE_SCHEDULER_EVEN_LANES_BATCHING": "false"}}
# Batch sizes as batchline_batch_size buckets them (upper bounds, rows).
SIZE_BOUNDS = (1, 2, 4, 8, 16, 32, 64)

Buckets = dict[str, dict[float, float]]  # histogram -> upper bound -> cumulative count (SUM: the sum)
SUM = -1.0


def scrape(ports: list[int], model: str) -> Buckets:
    """The stage histograms and the gateway's request duration of `model`, summed over versions and endpoints."""
    wanted = ({f"batchline_stage_{s}_seconds" for s in STAGES}
              | {"batchline_request_duration_seconds", "batchline_batch_size"})
    out: Buckets = {}
    for port in ports:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        for family in text_string_to_metric_families(text):
            if family.name not in wanted:
                continue
            for s in family.samples:
                if s.labels.get("model") != model:
                    continue
                h = out.setdefault(family.name, {})
                if s.name.endswith("_bucket"):
                    le = float(s.labels["le"])
                    h[le] = h.get(le, 0.0) + s.value
                elif s.name.endswith("_sum"):
                    h[SUM] = h.get(SUM, 0.0) + s.value
    return out


def quantile(q: float, before: dict[float, float], after: dict[float, float]) -> float | None:
    """The q-quantile (s) of what a histogram counted between two scrapes; None when it counted nothing."""
    bounds = sorted(b for b in after if b != SUM)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for b, c in zip(bounds, counts):
        if c >= rank:
            if b == float("inf"):
                return lower_bound
            return lower_bound + (b - lower_bound) * (rank - lower_count) / max(c - lower_count, 1e-12)
        lower_bound, lower_count = b, c
    return lower_bound


def step(address: str, ports: list[int], name: str, args) -> dict:
    model, tokens, in_flight = WORKLOADS[name]
    inputs = InputOptions(seq_len=tokens) if tokens else InputOptions()
    # Warmed up in a step of its own, so that the scrapes bracket the measured window alone.
    run_closed(address, model, in_flight, args.warmup, warmup=0.0, budget_ms=_common.CAPACITY_BUDGET_MS, inputs=inputs,
               protocol=args.protocol)
    before = scrape(ports, model)
    result = run_closed(address, model, in_flight, args.duration, warmup=0.0,
                        budget_ms=_common.CAPACITY_BUDGET_MS, inputs=inputs, protocol=args.protocol)
    after = scrape(ports, model)
    row = {"req/s": result.throughput_rps, "batch": result.mean_batch_size}
    lat = result.latency_ms or {}
    row["client p50"], row["client p99"] = lat.get("p50"), lat.get("p99")
    for stage in (*STAGES, "request_duration"):
        metric = f"batchline_stage_{stage}_seconds" if stage in STAGES else "batchline_request_duration_seconds"
        for q in QUANTILES:
            v = quantile(q, before.get(metric, {}), after.get(metric, {}))
            row[f"{stage} p{round(q * 100)}"] = None if v is None else v * 1e3
        b, a = before.get(metric, {}), after.get(metric, {})
        n = a.get(float("inf"), 0.0) - b.get(float("inf"), 0.0)
        row[f"{stage} mean"] = (a.get(SUM, 0.0) - b.get(SUM, 0.0)) / n * 1e3 if n else None
    row["client mean"] = lat.get("mean")
    b, a = before.get("batchline_batch_size", {}), after.get("batchline_batch_size", {})
    row["sizes"] = {bound: a.get(float(bound), 0.0) - b.get(float(bound), 0.0) for bound in SIZE_BOUNDS}
    return row


def sizes_text(sizes: dict[int, float]) -> str:
    """Batches dispatched per size range, from cumulative bucket counts."""
    parts, below, lower = [], 0.0, 0
    for bound in SIZE_BOUNDS:
        n = sizes.get(bound, 0.0) - below
        below = sizes.get(bound, 0.0)
        label = str(bound) if bound == lower + 1 else f"{lower + 1}-{bound}"
        lower = bound
        if n:
            parts.append(f"{label}: {n:.0f}")
    return ", ".join(parts)


def report(name: str, rows: list[dict]) -> str:
    def med(key: str) -> float | None:
        vals = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    def spread(key: str) -> str:
        vals = [r[key] for r in rows if r.get(key) is not None]
        return f"{min(vals):.1f}–{max(vals):.1f}" if len(vals) > 1 else "-"

    lines = [f"{name}: {med('req/s'):.0f} req/s, mean batch {_common.f(med('batch'))}, client p50 "
             f"{_common.f(med('client p50'))} ms, p99 {_common.f(med('client p99'))} ms "
             f"(rounds: {spread('client p99')}), "
             f"p99/p50 {_common.f(_ratio(med('client p99'), med('client p50')), '.2f')}"]
    table = [["stage (ms, median of rounds)", "mean", "p50", "p90", "p99", "p99/p50", "p99 rounds"]]
    for stage in (*STAGES, "request_duration"):
        p50, p90, p99 = (med(f"{stage} p{q}") for q in (50, 90, 99))
        # Its buckets are coarser (batchline.metrics.LATENCY_BUCKETS): its mean is exact, its quantiles rough.
        label = "gateway end to end (coarse)" if stage == "request_duration" else stage
        table.append([label, _common.f(med(f"{stage} mean")), _common.f(p50), _common.f(p90), _common.f(p99),
                      _common.f(_ratio(p99, p50), ".2f"), spread(f"{stage} p99")])
    table.append(["client end to end", _common.f(med("client mean")), _common.f(med("client p50")), "-",
                  _common.f(med("client p99")), _common.f(_ratio(med("client p99"), med("client p50")), ".2f"),
                  spread("client p99")])
    return "\n".join(lines) + "\n" + _common.table(table)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compare(name: str, rows: dict[str, list[dict]]) -> str:
    """The modes' medians side by side, and the medians of each round's ratio to the last mode."""
    modes = list(rows)
    table = [[name, "req/s", "client p50", "client p99", "p99/p50"]]
    for mode in modes:
        def med(key: str, m: str = mode) -> float | None:
            vals = [r[key] for r in rows[m] if r.get(key) is not None]
            return statistics.median(vals) if vals else None
        ratios = [_ratio(r["client p99"], r["client p50"]) for r in rows[mode]]
        table.append([mode, _common.f(med("req/s"), ".0f"), _common.f(med("client p50")), _common.f(med("client p99")),
                      _common.f(statistics.median([x for x in ratios if x is not None]), ".2f")])
    base = modes[-1]
    for mode in modes[:-1]:
        cells = [f"{mode} / {base}, median of rounds"]
        for key in ("req/s", "client p50", "client p99"):
            rs = [_ratio(a.get(key), b.get(key)) for a, b in zip(rows[mode], rows[base])]
            rs = [x for x in rs if x is not None]
            cells.append(_common.f(statistics.median(rs), ".2f") if rs else "-")
        table.append(cells + ["-"])
    return _common.table(table)


def main() -> int:
    p = _common.arg_parser(__doc__.splitlines()[0], progress=False)
    _common.step_args(p, duration=15.0, rounds=3, rounds_help="rounds of every workload")
    p.add_argument("--workloads", nargs="*", default=["mlp", "16", "128"],
                   help="only the workloads whose name contains one of these (default: mlp 16 128)")
    p.add_argument("--compare", action="store_true",
                   help="batches evened over the lanes against each lane taking everything queued, "
                        "two meshes in alternating rounds")
    p.add_argument("--protocol", choices=["grpc", "http"], default="grpc",
                   help="the clients' protocol: gRPC unary calls, or the REST port with binary tensors (default: grpc)")
    args = p.parse_args()
    print(f"machine: {_common.machine()}")
    names = [n for n in WORKLOADS if any(k in n for k in args.workloads)]
    repo = _common.ensure_repository(args.model_repository)
    modes = MODES if args.compare else {"as configured": {}}
    rows: dict[str, dict[str, list[dict]]] = {m: {n: [] for n in names} for m in modes}
    with contextlib.ExitStack() as stack:
        meshes = {}
        for mode, env in modes.items():
            base = _common.free_base(ENDPOINTS)
            address = stack.enter_context(_common.mesh(repo, env=env, log_level=args.log_level, metrics_port=base,
                                                       protocol=args.protocol))
            meshes[mode] = (address, [base + i for i in range(ENDPOINTS)])
        for r in range(args.rounds):
            for name in names:
                for mode in (list(modes) if r % 2 == 0 else list(modes)[::-1]):
                    row = step(*meshes[mode], name, args)
                    rows[mode][name].append(row)
                    label = f"{mode}, " if args.compare else ""
                    print(f"round {r + 1}, {label}{name}: {row['req/s']:.0f} req/s, client p50 "
                          f"{_common.f(row['client p50'])} p99 {_common.f(row['client p99'])} ms; stage p99s (ms): "
                          + ", ".join(f"{s} {_common.f(row[f'{s} p99'])}" for s in STAGES)
                          + f"; batches of {sizes_text(row['sizes'])}", flush=True)
    for mode in modes:
        for name in names:
            print()
            print(f"{mode}: " + report(name, rows[mode][name]) if args.compare else report(name, rows[mode][name]))
    if args.compare:
        for name in names:
            print()
            print(compare(name, {m: rows[m][name] for m in modes}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
