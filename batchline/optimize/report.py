"""What `batchline optimize` leaves behind: the new version, whole or not at all, with its report
(optimize.json), and the report's summary as a person reads it."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile

REPORT = "optimize.json"


def write_version(model_dir: pathlib.Path, report: dict, model_file: pathlib.Path,
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


def _measured(verdict: dict) -> str:
    return "; ".join(", ".join(f"{k} {v:.4f}" for k, v in m.items() if isinstance(v, float))
                     for m in verdict["outputs"].values())


def _line(r: dict) -> str:
    speeds = ", ".join(f"batch {k}: {v['throughput_ratio']:.2f}x" for k, v in r["speed"].items())
    gate_text = "passed" if r["gate"]["passed"] else "failed: " + "; ".join(r["gate"]["failed"])
    where = f" on {r['provider']}" + ("" if r["choosable"] else " (not the device that serves the model here)")
    return f"{speeds} FP32's throughput{where}; gate {gate_text} ({_measured(r['gate'])})"


def summary(report: dict) -> str:
    """The report as a person reads it: one line per variant, then the verdict."""
    kinds = ", ".join(f"{k} as {v['kind']}" for k, v in report["outputs"].items())
    lines = [f"model {report['model']} version {report['source_version']}; inputs: {report['inputs']}; "
             f"outputs judged: {kinds}; served here on {report['serves_on']}"]
    for r in report["variants"]:
        if "skipped" in r:
            lines.append(f"  {r['name']}: skipped ({r['skipped']})")
            continue
        found = r.get("search")
        if found and found["fp32_nodes"]:
            everything = {**found["all_quantized"], "provider": r["provider"], "choosable": r["choosable"]}
            lines.append(f"  {r['name']}: every node quantized: {_line(everything)}")
            lines.append(f"  {r['name']}: {len(found['fp32_nodes'])} of {found['quantized_nodes']} nodes kept in FP32 "
                         f"({', '.join(found['fp32_nodes'])}; searched in {found['seconds']:.0f} s): {_line(r)}")
        else:
            lines.append(f"  {r['name']}: {_line(r)}")
    written = (f"wrote version {report['written_version']} ({report['chosen']}): {report['why']}"
               if report["written_version"] else f"wrote nothing: {report['why']}")
    lines += [written, f"variants kept in {report['scratch']}; {report['seconds']:.0f} s"]
    return "\n".join(lines)
