"""The optimized variants `batchline optimize` tries, each written from the FP32 model to a file.

- graph: ONNX Runtime's offline graph optimizations (fusions), saved.
- int8-dynamic: weights quantized to 8 bits ahead of time, activations at run time. The default
  quantizes MatMul weights only, per channel: quantizing every op, or per tensor, costs minilm's
  embeddings enough accuracy to spoil a search index (cosine 0.87-0.93 against 0.99). Nodes named
  in `exclude` stay in FP32 (search.py finds which).
- int8-static: weights and activations quantized in QDQ form, activation ranges calibrated on
  the calibration inputs (only when some are given).
- fp16: weights and activations in half precision, for GPU executors (judged where CUDA runs:
  providers.py).
- tensorrt-int8 (batchline/optimize/tensorrt.py, not built here): the FP32 model with TensorRT's
  calibration table, judged only where TensorRT runs.
"""
from __future__ import annotations

import pathlib
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnxruntime as ort

from batchline.optimize import VARIANTS
from batchline.optimize.inputs import CALIBRATION_ROWS


# CPU flags of x86 instructions that multiply unsigned by signed 8-bit values into 32-bit sums
# exactly (VNNI, AMX). Without them ONNX Runtime's u8 x s8 kernels sum pairs into saturating 16-bit
# values, which costs accuracy.
EXACT_INT8_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


def cpu_flags() -> set[str]:
    """This host's CPU flags (Linux; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def auto_weight_type(flags: set[str] | None = None) -> tuple[str, str]:
    """The INT8 weight type for this host, and why. Measured on minilm with real sentences: on a
    CPU with VNNI, QInt8 weights ran 2.1x FP32 and passed the default gate (0.9045 of the top-10
    neighbours kept) where QUInt8 ran 1.04x; on one without, QInt8 ran 1.5x but kept 0.8996, under
    the gate, and QUInt8 1.25x with 0.902."""
    found = sorted(set(EXACT_INT8_FLAGS) & (cpu_flags() if flags is None else flags))
    if found:
        return "QInt8", f"this CPU multiplies 8-bit values exactly ({', '.join(found)}): signed weights run fastest"
    return "QUInt8", "this CPU has no VNNI: unsigned weights avoid the saturating 16-bit sums of signed ones"


@dataclass(frozen=True)
class Int8Options:
    op_types: tuple[str, ...] = ("MatMul",)  # () = every op type the quantizer knows
    per_channel: bool = True
    weight_type: str = "auto"                # QInt8 | QUInt8 | auto (auto_weight_type)
    search: bool = True                      # int8-dynamic failing the gate: keep its most harmful nodes in FP32

    def resolved_weight_type(self) -> tuple[str, str]:
        """(weight type, why) with auto resolved for this host."""
        if self.weight_type == "auto":
            return auto_weight_type()
        return self.weight_type, "chosen with --weight-type"


@dataclass
class Variant:
    name: str
    path: pathlib.Path
    notes: list[str] = field(default_factory=list)


def build(name: str, source: pathlib.Path, out: pathlib.Path, int8: Int8Options,
          calibration: Callable[[], list[dict[str, np.ndarray]]] | None, exclude: list[str] = (),
          path: pathlib.Path | None = None) -> Variant | None:
    """Write variant `name` of the model at `source` into the directory `out` (or to `path`); None:
    it does not apply, e.g. int8-static without calibration inputs."""
    path = path or out / f"{name}.onnx"
    if name == "graph":
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.optimized_model_filepath = str(path)
        ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
        return Variant(name, path)
    if name == "int8-dynamic":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        weight_type, why = int8.resolved_weight_type()
        # MatMuls of two activations (attention's Q·K) stay in float: only weights are quantized ahead.
        quantize_dynamic(source, path, op_types_to_quantize=list(int8.op_types) or None, per_channel=int8.per_channel,
                         weight_type=getattr(QuantType, weight_type), nodes_to_exclude=list(exclude),
                         extra_options={"MatMulConstBOnly": True})
        return Variant(name, path, notes=[f"op types {list(int8.op_types) or 'all'}, "
                                          f"{'per channel' if int8.per_channel else 'per tensor'}, {weight_type} "
                                          f"({why})"])
    if name == "int8-static":
        if calibration is None:
            return None
        from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

        class Reader(CalibrationDataReader):
            def __init__(self) -> None:
                self._feeds = iter(calibration())

            def get_next(self):
                return next(self._feeds, None)

        # Unsigned activations: ONNX Runtime's CPU kernels take them with either weight type.
        quantize_static(source, path, Reader(), quant_format=QuantFormat.QDQ,
                        op_types_to_quantize=list(int8.op_types) or None,
                        per_channel=int8.per_channel, activation_type=QuantType.QUInt8,
                        weight_type=getattr(QuantType, int8.resolved_weight_type()[0]))
        return Variant(name, path, notes=[f"QDQ, activation ranges calibrated (MinMax) on the calibration inputs "
                                          f"(at most {CALIBRATION_ROWS} rows, spread over them)"])
    if name == "fp16":
        import onnx
        from onnxruntime.transformers.float16 import convert_float_to_float16

        model = convert_float_to_float16(onnx.load(str(source)), keep_io_types=True)
        onnx.save(model, str(path))
        return Variant(name, path, notes=["half precision, inputs and outputs kept FP32, for GPU executors"])
    raise ValueError(f"unknown variant {name!r} (known: {', '.join(VARIANTS)})")
