"""`batchline optimize MODEL`: try the variants, gate them against FP32, time them, and write the
fastest that passes as the model's next version, with its report (optimize.json)."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import onnxruntime as ort

from batchline.optimize import DEFAULT_VARIANTS, MIN_GAIN, VARIANTS, gate, inputs, speed, tensorrt
from batchline.optimize.inputs import InputsError  # noqa: F401 (raised through optimize())
from batchline.optimize.variants import Int8Options, build
from executor.repository import RepositoryError, load_model, read_config

REPORT = "optimize.json"
GATE_BATCH = 16  # rows per run when judging: a batch, but one any batched model takes
TENSORRT_INT8 = "tensorrt-int8"
NO_INPUTS = "no calibration inputs (--calibration or --texts)"


class OptimizeError(ValueError):
    """Nothing can be optimized as asked: the message says why."""


@dataclass
class Options:
    model: str
    repository: pathlib.Path
    variants: tuple[str, ...] = DEFAULT_VARIANTS
    calibration: pathlib.Path | None = None
    texts: pathlib.Path | None = None
    thresholds: gate.Thresholds = field(default_factory=gate.Thresholds)
    int8: Int8Options = field(default_factory=Int8Options)
    scratch: pathlib.Path | None = None
    rounds: int = 3
    min_gain: float = MIN_GAIN  # write the fastest passing variant only if it serves this many times FP32


def _latest(model_dir: pathlib.Path) -> pathlib.Path:
    versions = [p for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit() and (p / "model.onnx").exists()]
    if not versions:
        raise OptimizeError(f"model '{model_dir.name}' has no version directory with a model.onnx in {model_dir}")
    return max(versions, key=lambda p: int(p.name))


def _session(path: pathlib.Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _outputs(session: ort.InferenceSession, batches: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    names = [o.name for o in session.get_outputs()]
    runs = [session.run(names, b) for b in batches]
    return {n: np.concatenate([r[i] for r in runs]) for i, n in enumerate(names)}


def optimize(o: Options) -> dict:
    """Run it; the report (also written as optimize.json beside the new version, if one is written)."""
    started = time.perf_counter()
    unknown = [v for v in o.variants if v not in VARIANTS]
    if unknown:
        raise OptimizeError(f"unknown variant(s) {unknown} (known: {', '.join(VARIANTS)})")
    model_dir = o.repository / o.model
    if not model_dir.is_dir():
        known = sorted(p.name for p in o.repository.iterdir() if p.is_dir() and not p.name.startswith(".")) \
            if o.repository.is_dir() else []
        raise OptimizeError(f"model '{o.model}' is not in {o.repository} (models there: {', '.join(known) or 'none'})")
    source = _latest(model_dir)
    try:
        info = load_model(model_dir, source, read_config(model_dir), ["CPUExecutionProvider"], "", 0, True, 0).info
    except RepositoryError as exc:
        raise OptimizeError(str(exc)) from None
    if info.max_batch_size == 0:
        raise OptimizeError(f"model '{o.model}' has no batch dimension (max_batch_size 0): its variants are judged "
                            "and timed on batches")
    batch = min(GATE_BATCH, info.max_batch_size)
    if o.calibration is not None:
        data = inputs.from_npz(o.calibration, info, batch)
    elif o.texts is not None:
        data = inputs.from_texts(o.texts, model_dir, info, batch)
    else:
        data = inputs.generated(info, batch)
    scratch = o.scratch or pathlib.Path(tempfile.mkdtemp(prefix=f"batchline-optimize-{o.model}-"))
    scratch.mkdir(parents=True, exist_ok=True)
    fp32 = _session(source / "model.onnx")
    reference = _outputs(fp32, data.batches)
    sizes = sorted({batch, info.max_batch_size})
    calibration = (lambda: data.batches) if (o.calibration or o.texts) else None
    results = []
    for name in o.variants:
        if name == TENSORRT_INT8:
            results.append(_tensorrt_int8(source / "model.onnx", calibration, scratch, data.batches, reference,
                                          sizes, o))
            continue
        variant = build(name, source / "model.onnx", scratch, o.int8, calibration)
        if variant is None:
            results.append({"name": name, "skipped": NO_INPUTS})
            continue
        session = _session(variant.path)
        verdict = gate.judge(reference, _outputs(session, data.batches), o.thresholds)
        timing = speed.compare(fp32, session, data.batches[0], sizes, o.rounds)
        results.append({"name": name, "notes": variant.notes, "gpu_only": variant.gpu_only, "gate": verdict,
                        "speed": timing, "file": str(variant.path)})
    chosen, why = _choose(results, str(info.max_batch_size), o.min_gain)
    report = {"model": o.model, "source_version": source.name, "written_version": None, "chosen": chosen,
              "why": why, "inputs": data.source, "provider": "CPUExecutionProvider",
              "thresholds": asdict(o.thresholds), "int8": asdict(o.int8), "variants": results,
              "scratch": str(scratch), "seconds": 0.0}
    if chosen is not None:
        report["written_version"] = str(int(source.name) + 1)
    report["seconds"] = round(time.perf_counter() - started, 1)
    report = json.loads(json.dumps(report))  # as optimize.json holds it
    if chosen is not None:
        written = next(r for r in results if r.get("name") == chosen)
        _write_version(model_dir, report, pathlib.Path(written["file"]), [pathlib.Path(f) for f in written.get("extra_files", [])])
    return report


def _tensorrt_int8(source: pathlib.Path, calibration, scratch: pathlib.Path, batches: list, reference: list,
                   sizes: list[int], o: Options) -> dict:
    """TensorRT's INT8: the FP32 model with a calibration table, judged and timed against FP32 on
    TensorRT where it runs; elsewhere the table is written to the scratch directory and the variant
    reported as skipped, with the reason."""
    if calibration is None:
        return {"name": TENSORRT_INT8, "skipped": NO_INPUTS}
    out = scratch / TENSORRT_INT8
    table = tensorrt.write_table(source, calibration, out)
    if not tensorrt.available():
        return {"name": TENSORRT_INT8, "skipped": tensorrt.unavailable_reason(), "calibration_table": str(table)}
    cache = {"trt_engine_cache_enable": True, "trt_engine_cache_path": str(out)}
    int8 = ort.InferenceSession(str(source), providers=[
        (tensorrt.PROVIDER, {"trt_int8_enable": True, "trt_int8_calibration_table_name": tensorrt.TABLE, **cache}),
        "CUDAExecutionProvider", "CPUExecutionProvider"])
    fp32 = ort.InferenceSession(str(source), providers=[(tensorrt.PROVIDER, cache), "CUDAExecutionProvider",
                                                        "CPUExecutionProvider"])
    verdict = gate.judge(reference, _outputs(int8, batches), o.thresholds)
    return {"name": TENSORRT_INT8, "notes": ["FP32 model served with trt_int8_enable and its calibration table; "
                                             "timed against FP32 on TensorRT"],
            "gpu_only": False, "gate": verdict, "speed": speed.compare(fp32, int8, batches[0], sizes, o.rounds),
            "file": str(source), "extra_files": [str(table)]}


def _choose(results: list[dict], largest: str, min_gain: float) -> tuple[str | None, str]:
    """The fastest variant at the largest batch size that passed the gate and runs here, if faster than FP32."""
    eligible = [r for r in results if "gate" in r and r["gate"]["passed"] and not r["gpu_only"]]
    if not eligible:
        return None, "no variant that runs on this host's provider passed the gate"
    best = max(eligible, key=lambda r: r["speed"][largest]["throughput_ratio"])
    ratio = best["speed"][largest]["throughput_ratio"]
    if ratio < min_gain:
        return None, (f"the fastest variant that passed the gate ({best['name']}) is not enough faster than FP32 "
                      f"({ratio:.2f}x, under {min_gain}x)")
    return best["name"], f"the fastest that passed the gate: {ratio:.2f}x FP32's throughput at batch {largest}"


def _write_version(model_dir: pathlib.Path, report: dict, model_file: pathlib.Path,
                   extra_files: list[pathlib.Path] = ()) -> None:
    """The new version appears whole or not at all: written beside the repository's models under a
    name no loader takes for a model, then renamed into place."""
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".batchline-optimize-{model_dir.name}-", dir=model_dir.parent))
    try:
        shutil.copyfile(model_file, staging / "model.onnx")
        for extra in extra_files:  # e.g. TensorRT's calibration table, which executors look for beside the model
            shutil.copyfile(extra, staging / extra.name)
        (staging / REPORT).write_text(json.dumps(report, indent=2) + "\n")
        os.rename(staging, model_dir / report["written_version"])
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def summary(report: dict) -> str:
    """The report as a person reads it: one line per variant, then the verdict."""
    lines = [f"model {report['model']} version {report['source_version']}; inputs: {report['inputs']}"]
    for r in report["variants"]:
        if "skipped" in r:
            lines.append(f"  {r['name']}: skipped ({r['skipped']})")
            continue
        speeds = ", ".join(f"batch {k}: {v['throughput_ratio']:.2f}x" for k, v in r["speed"].items())
        gate_text = "passed" if r["gate"]["passed"] else "failed: " + "; ".join(r["gate"]["failed"])
        measured = "; ".join(", ".join(f"{k} {v:.4f}" for k, v in m.items() if isinstance(v, float))
                             for m in r["gate"]["outputs"].values())
        lines.append(f"  {r['name']}: {speeds} FP32's throughput; gate {gate_text} ({measured})"
                     + (" [GPU only]" if r["gpu_only"] else ""))
    written = (f"wrote version {report['written_version']} ({report['chosen']}): {report['why']}"
               if report["written_version"] else f"wrote nothing: {report['why']}")
    lines += [written, f"variants kept in {report['scratch']}; {report['seconds']:.0f} s"]
    return "\n".join(lines)
