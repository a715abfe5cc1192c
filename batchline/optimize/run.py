"""`batchline optimize MODEL`: try the variants, gate them against FP32, time them, and write the
fastest that passes as the model's next version, with its report (optimize.json)."""
from __future__ import annotations

import json
import logging
import pathlib
import tempfile
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import onnxruntime as ort

from batchline.optimize import DEFAULT_VARIANTS, MIN_GAIN, VARIANTS, gate, inputs, providers, search, speed, tensorrt
from batchline.optimize.inputs import InputsError  # noqa: F401 (raised through optimize())
from batchline.optimize.report import summary, write_version  # noqa: F401 (summary: the command's)
from batchline.optimize.variants import Int8Options, build
from executor import providers as gpu
from executor.repository import RepositoryError, load_model, read_config
from executor.settings import DEFAULT_PROVIDERS

log = logging.getLogger(__name__)

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
    outputs: dict[str, str] = field(default_factory=dict)  # how to judge an output (--output), over config.toml's


def _latest(model_dir: pathlib.Path) -> pathlib.Path:
    versions = [p for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit() and (p / "model.onnx").exists()]
    if not versions:
        raise OptimizeError(f"model '{model_dir.name}' has no version directory with a model.onnx in {model_dir}")
    return max(versions, key=lambda p: int(p.name))


def _outputs(session: ort.InferenceSession, batches: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    names = [o.name for o in session.get_outputs()]
    runs = [session.run(names, b) for b in batches]
    return {n: np.concatenate([r[i] for r in runs]) for i, n in enumerate(names)}


@dataclass
class _Context:
    """What every variant is judged and timed against."""
    o: Options
    source: pathlib.Path
    scratch: pathlib.Path
    data: inputs.Inputs
    reference: dict[str, np.ndarray]
    kinds: dict[str, str]
    sizes: list[int]
    baselines: dict[str, ort.InferenceSession]  # FP32 per provider, to time against

    def calibration(self) -> list[dict[str, np.ndarray]]:
        return [self.data.batches[i] for i in inputs.spread(self.data.batches, inputs.CALIBRATION_ROWS)]

    def baseline(self, provider: str, options: dict | None = None) -> ort.InferenceSession:
        if provider not in self.baselines:
            self.baselines[provider] = ort.InferenceSession(str(self.source),
                                                            providers=providers.session_providers(provider, options))
        return self.baselines[provider]


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
        config = read_config(model_dir)
        loaded = load_model(model_dir, source, config, [providers.CPU], "", 0, True, 0)
    except RepositoryError as exc:
        raise OptimizeError(str(exc)) from None
    info, tokenizer_json = loaded.info, loaded.tokenizer_json
    del loaded  # its session runs on the executor's share of the cores: timed against, it would flatter variants
    if info.max_batch_size == 0:
        raise OptimizeError(f"model '{o.model}' has no batch dimension (max_batch_size 0): its variants are judged "
                            "and timed on batches")
    configured = (config.get("optimize") or {}).get("outputs", {})
    for where, named in ((f"{model_dir}/config.toml: [optimize] outputs", configured), ("--output", o.outputs)):
        strangers = sorted(set(named) - {s.name for s in info.outputs})
        if strangers:
            raise OptimizeError(f"{where} names {strangers}, not outputs of model '{o.model}' "
                                f"(its outputs: {sorted(s.name for s in info.outputs)})")
    declared = {name: (kind, "[optimize] outputs in config.toml") for name, kind in configured.items()}
    declared |= {name: (kind, "--output") for name, kind in o.outputs.items()}
    batch = min(GATE_BATCH, info.max_batch_size)
    if o.calibration is not None:
        data = inputs.from_npz(o.calibration, info, batch)
    elif o.texts is not None:
        data = inputs.from_texts(o.texts, tokenizer_json, info, batch)
    else:
        data = inputs.generated(info, batch)
    scratch = o.scratch or pathlib.Path(tempfile.mkdtemp(prefix=f"batchline-optimize-{o.model}-"))
    scratch.mkdir(parents=True, exist_ok=True)
    fp32 = ort.InferenceSession(str(source / "model.onnx"), providers=[providers.CPU])  # the gate's reference
    reference = _outputs(fp32, data.batches)
    kinds = {name: gate.kind_of(name, array, declared) for name, array in reference.items()}
    available = gpu.usable(ort.get_available_providers())
    serves_on = providers.serving(config["providers"] or DEFAULT_PROVIDERS, available)
    ctx = _Context(o, source / "model.onnx", scratch, data, reference, {k: v[0] for k, v in kinds.items()},
                   sorted({batch, info.max_batch_size}), {fp32.get_providers()[0]: fp32})
    steps = providers.plan(o.variants, available, serves_on)
    results = []
    for step in steps:
        begun = time.perf_counter()
        try:
            result = _tensorrt_int8(ctx, step) if step.variant == TENSORRT_INT8 else _variant(ctx, step)
        except Exception as exc:  # one variant that cannot be built is that variant's result
            log.exception("variant %s failed", step.variant)
            result = {"name": step.variant, "skipped": f"failed: {type(exc).__name__}: {exc}"}
        results.append({**result, "seconds": round(time.perf_counter() - begun, 1)} if "gate" in result else result)
    chosen, why = providers.choose(results, str(info.max_batch_size), o.min_gain, serves_on)
    report = {"model": o.model, "source_version": source.name, "written_version": None, "chosen": chosen,
              "why": why, "inputs": data.source, "reference_provider": fp32.get_providers()[0], "serves_on": serves_on,
              "outputs": {k: {"kind": kind, "why": reason} for k, (kind, reason) in kinds.items()},
              "thresholds": asdict(o.thresholds), "int8": asdict(o.int8), "variants": results,
              "scratch": str(scratch), "seconds": 0.0}
    if chosen is not None:
        report["written_version"] = str(int(source.name) + 1)
    report["seconds"] = round(time.perf_counter() - started, 1)
    report = json.loads(json.dumps(report))  # as optimize.json holds it
    if chosen is not None:
        written = next(r for r in results if r.get("name") == chosen)
        write_version(model_dir, report, pathlib.Path(written["file"]),
                      [pathlib.Path(f) for f in written.get("extra_files", [])])
    return report


def _judged(ctx: _Context, name: str, path: pathlib.Path, step: providers.Step, notes: list[str],
            timed: bool = True) -> dict:
    """A variant judged against FP32's outputs and (if `timed`) timed against FP32 on its provider."""
    session = ort.InferenceSession(str(path), providers=providers.session_providers(step.provider))
    ran_on = session.get_providers()[0]
    if ran_on != step.provider:  # onnxruntime-gpu lists CUDA where there is none, and falls back
        return {"name": name, "skipped": f"ONNX Runtime offers {step.provider} but the session runs on {ran_on}: "
                                         f"{gpu.why_unavailable(step.provider)}"}
    verdict = gate.judge(ctx.reference, _outputs(session, ctx.data.batches), ctx.o.thresholds, ctx.kinds)
    result = {"name": name, "notes": notes, "provider": ran_on, "choosable": step.choosable, "gate": verdict,
              "file": str(path)}
    if timed:
        result["speed"] = speed.compare(ctx.baseline(ran_on), session, ctx.data.timing, ctx.sizes, ctx.o.rounds)
    return result


def _variant(ctx: _Context, step: providers.Step) -> dict:
    if step.provider is None:
        return {"name": step.variant, "skipped": step.skipped}
    calibration = ctx.calibration if (ctx.o.calibration or ctx.o.texts) else None
    variant = build(step.variant, ctx.source, ctx.scratch, ctx.o.int8, calibration)
    if variant is None:
        return {"name": step.variant, "skipped": NO_INPUTS}
    result = _judged(ctx, step.variant, variant.path, step, variant.notes)
    if step.variant != "int8-dynamic" or not ctx.o.int8.search or result.get("gate", {"passed": True})["passed"]:
        return result

    def attempt(names: list[str]) -> dict:
        path = ctx.scratch / f"int8-dynamic-{len(names)}-fp32.onnx"
        kept = build(step.variant, ctx.source, ctx.scratch, ctx.o.int8, None, exclude=names, path=path)
        return _judged(ctx, step.variant, path, step, kept.notes, timed=False)

    record = search.exclusions(ctx.source, variant.path, ctx.o.int8.op_types, ctx.scratch, ctx.data.batches,
                               ctx.reference, ctx.kinds, attempt)
    chosen = record.pop("chosen")
    record["all_quantized"] = {k: result[k] for k in ("gate", "speed", "file")}
    if chosen is None:
        return {**result, "search": record}
    session = ort.InferenceSession(chosen["file"], providers=providers.session_providers(step.provider))
    chosen["speed"] = speed.compare(ctx.baseline(step.provider), session, ctx.data.timing, ctx.sizes, ctx.o.rounds)
    chosen["notes"] = chosen["notes"] + [
        f"{len(record['fp32_nodes'])} of {record['quantized_nodes']} quantized nodes kept in FP32, the most harmful "
        f"(with every one quantized: {'; '.join(result['gate']['failed'])})"]
    return {**chosen, "search": record}


def _tensorrt_int8(ctx: _Context, step: providers.Step) -> dict:
    """TensorRT's INT8: the FP32 model with a calibration table, judged and timed against FP32 on
    TensorRT where it runs; elsewhere the table is written to the scratch directory and the variant
    reported as skipped, with the reason."""
    if not (ctx.o.calibration or ctx.o.texts):
        return {"name": TENSORRT_INT8, "skipped": NO_INPUTS}
    out = ctx.scratch / TENSORRT_INT8
    table = tensorrt.write_table(ctx.source, ctx.calibration, out)
    if step.provider is None:
        return {"name": TENSORRT_INT8, "skipped": step.skipped, "calibration_table": str(table)}
    cache = {"trt_engine_cache_enable": True, "trt_engine_cache_path": str(out)}
    int8 = ort.InferenceSession(str(ctx.source), providers=providers.session_providers(tensorrt.PROVIDER, {
        "trt_int8_enable": True, "trt_int8_calibration_table_name": tensorrt.TABLE, **cache}))
    ran_on = int8.get_providers()[0]
    if ran_on != tensorrt.PROVIDER:
        return {"name": TENSORRT_INT8, "skipped": f"ONNX Runtime offers {tensorrt.PROVIDER} but the session runs on "
                                                  f"{ran_on}: {gpu.why_unavailable(tensorrt.PROVIDER)}",
                "calibration_table": str(table)}
    verdict = gate.judge(ctx.reference, _outputs(int8, ctx.data.batches), ctx.o.thresholds, ctx.kinds)
    timing = speed.compare(ctx.baseline(tensorrt.PROVIDER, cache), int8, ctx.data.timing, ctx.sizes, ctx.o.rounds)
    return {"name": TENSORRT_INT8, "notes": ["FP32 model served with trt_int8_enable and its calibration table; "
                                             "timed against FP32 on TensorRT"],
            "provider": ran_on, "choosable": step.choosable, "gate": verdict, "speed": timing,
            "file": str(ctx.source), "extra_files": [str(table)]}
