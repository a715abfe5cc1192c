"""benchmarks/gpu.py's results as tables a person reads (gpu.txt, and the end of its output)."""
from __future__ import annotations

import _common

KINDS = ("client", "gateway", "scheduler", "executor", "redis", "total")


def _n(x, fmt: str = ".0f") -> str:
    return "-" if x is None or isinstance(x, str) or x != x else format(x, fmt)


def step_line(step: dict) -> str:
    if "error" in step:
        return f"failed: {step['error']}"
    cpu = step["cpu_ms_per_request"]
    return (f"{step['throughput']:.0f}/s, p50 {_n(step['p50_ms'], '.1f')} ms, p99 {_n(step['p99_ms'], '.1f')} ms, "
            f"batch {_n(step['mean_batch'], '.1f')}, {step['statuses']}; CPU ms/request "
            + ", ".join(f"{k} {_n(cpu.get(k), '.3f')}" for k in KINDS))


def _ceiling(results: dict) -> list[str]:
    c = results.get("ceiling")
    if not c:
        return []
    lines = [f"ONNX Runtime alone on {results.get('environment', {}).get('provider', '?')} "
             f"(sequences/s; the ceiling: the best at batch <= {c['max_batch_size']}):"]
    rows = [["model", "way"] + [f"b{b}" for b in next(iter(next(iter(c['curves'].values())).values()))] + ["ceiling"]]
    for label, curves in c["curves"].items():
        best = c["best"][label]
        for way, per_batch in curves.items():
            rows.append([label, way] + [_n(v) for v in per_batch.values()]
                        + [f"{best['seq_per_s']:.0f} (b{best['batch']})" if way == best["way"] else ""])
    lines.append(_common.table(rows))
    for seq in (16, 128):
        a, b = c["best"].get(f"fp32 {seq}"), c["best"].get(f"fp16 {seq}")
        if a and b and a["seq_per_s"]:
            lines.append(f"FP16/FP32, {seq} tokens, ONNX Runtime alone: {b['seq_per_s'] / a['seq_per_s']:.2f}x")
    return lines


def _options(results: dict) -> list[str]:
    o = results.get("cuda_options")
    if not o:
        return []
    names = list(dict.fromkeys(k for row in o.values() for k in row))
    rows = [["model"] + names]
    for label, row in o.items():
        plain = row.get("plain")
        rows.append([label] + [(f"{v:.0f} ({v / plain:.2f}x)" if isinstance(v, float) and plain else str(v)[:60])
                               if k in row else "" for k, v in ((k, row.get(k)) for k in names)])
    lines = ["CUDA provider options, minilm 128 tokens at the max batch (sequences/s, against the plain run):",
             _common.table(rows)]
    if "fp16_vs_cpu_fp32_max_abs" in results:
        lines.append(f"FP16 on CUDA against FP32 on the CPU, largest absolute difference in an embedding: "
                     f"{results['fp16_vs_cpu_fp32_max_abs']:.2e}")
    return lines


def _optimize(results: dict) -> list[str]:
    o = results.get("optimize")
    if not o:
        return []
    lines = ["batchline optimize --variants fp16:"]
    for seq in ("16", "128"):
        r = o.get(seq)
        if not r:
            continue
        for v in r["variants"]:
            if "skipped" in v:
                lines.append(f"  {seq} tokens: {v['name']} skipped ({v['skipped']})")
                continue
            speed = ", ".join(f"batch {b}: {s['throughput_ratio']:.2f}x FP32" for b, s in v.get("speed", {}).items())
            gate = v.get("gate", {})
            lines.append(f"  {seq} tokens: {v['name']} on {v.get('provider')}: gate "
                         f"{'passed' if gate.get('passed') else 'failed'}; {speed}")
        lines.append(f"  {seq} tokens: wrote {r['written_version'] or 'nothing'}: {r['why']}")
    if "placed_by_script" in o:
        lines.append(f"  {o['placed_by_script']}")
    return lines


def _mesh(results: dict) -> list[str]:
    m = results.get("mesh")
    if not m:
        return []
    best = (results.get("ceiling", {}).get("best", {}).get("fp16 128")
            or results.get("ceiling", {}).get("best", {}).get("fp32 128") or {})
    ceiling = best.get("seq_per_s")
    lines = [f"providers (batchline status): {m.get('providers')}",
             f"mesh, minilm {'FP16 ' if 'fp16 128' in results.get('ceiling', {}).get('best', {}) else ''}128 tokens, "
             f"closed loop ({m['duration_s']:g} s per step after {m['warmup_s']:g} s), against the ceiling "
             f"{_n(ceiling)} seq/s:"]
    rows = [["gateways", "executors", "calls", "rows a request", "in flight", "seq/s", "mesh/ceiling", "p50 ms",
             "p99 ms", "batch"] + [f"{k} ms/seq" for k in KINDS]]
    for s in m["steps"]:
        if "error" in s:
            rows.append([str(s.get("gateways", "?")), str(s.get("executors", "?")), "", "", "", s["error"][:40]]
                        + [""] * 10)
            continue
        cpu = s["cpu_ms_per_request"]
        rows.append([str(s["gateways"]), str(s["executors"]), "streams" if s.get("streaming") else "unary",
                     str(s.get("rows", 1)), str(s["in_flight"]), _n(s["throughput"]),
                     _n(s["throughput"] / ceiling, ".2f") if ceiling else "-", _n(s["p50_ms"], ".1f"),
                     _n(s["p99_ms"], ".1f"), _n(s["mean_batch"], ".1f")] + [_n(cpu.get(k), ".3f") for k in KINDS])
    lines.append(_common.table(rows))
    return lines


def _scaling(results: dict) -> list[str]:
    sc = results.get("cpu_scaling")
    if not sc or not sc["steps"]:
        return []
    base: dict[str, float] = {}
    rows = [["model", "cores", "gateways", "executors", "req/s", "vs fewest cores", "p99 ms", "batch",
             "CPU ms/req", "clients share cores"]]
    for s in sc["steps"]:
        if "error" in s:
            rows.append([s.get("model", "?"), str(s.get("cores", "?")), "", "", s["error"][:40], "", "", "", "", ""])
            continue
        base.setdefault(s["model"], s["throughput"])
        rows.append([s["model"], str(s["cores"]), str(s["gateways"]), str(s["executors"]), _n(s["throughput"]),
                     _n(s["throughput"] / base[s["model"]], ".2f") if base[s["model"]] else "-", _n(s["p99_ms"], ".1f"),
                     _n(s["mean_batch"], ".1f"), _n(s["cpu_ms_per_request"].get("total"), ".3f"),
                     "yes" if s.get("clients_share_cores") else "no"])
    return ["CPU provider scale-out (the mesh pinned to the cores; minilm at 16 tokens):", _common.table(rows)]


def render(results: dict) -> str:
    lines = [f"environment: {results.get('environment')}"]
    for part in (_ceiling, _options, _optimize, _mesh, _scaling):
        try:
            block = part(results)
        except Exception as exc:  # noqa: BLE001 - a partial result still renders the rest
            block = [f"({part.__name__[1:]}: cannot render: {type(exc).__name__}: {exc})"]
        if block:
            lines += [""] + block
    if results.get("tests"):
        lines += ["", f"gpu tests: {results['tests']}"]
    for key in ("skipped", "errors"):
        for name, why in results.get(key, {}).items():
            lines.append(f"{key[:-1] if key == 'errors' else 'skipped'} {name}: "
                         f"{why.strip().splitlines()[-1] if why else ''}")
    return "\n".join(lines)
