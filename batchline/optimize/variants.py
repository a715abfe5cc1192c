"""The optimized variants `batchline optimize` tries, each written from the FP32 model to a file.

- graph: ONNX Runtime's offline graph optimizations (fusions), saved.
- int8-dynamic: weights quantized to 8 bits ahead of time, activations at run time. The default
  quantizes MatMul weights only, per channel: quantizing every op, or per tensor, costs minilm's
  embeddings enough accuracy to spoil a search index (cosine 0.87-0.93 against 0.99).
- int8-static: weights and activations quantized in QDQ form, activation ranges calibrated on
  the calibration inputs (only when some are given).
- fp16: weights and activations in half precision, for GPU executors: measured on CPU, never
  chosen there.
"""
from __future__ import annotations

import pathlib
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnxruntime as ort

from batchline.optimize import VARIANTS


@dataclass(frozen=True)
class Int8Options:
    op_types: tuple[str, ...] = ("MatMul",)  # () = every op type the quantizer knows
    per_channel: bool = True
    # QUInt8: on minilm and real sentences, QInt8 weights run 1.5x FP32 against QUInt8's 1.25x, but
    # move each embedding's nearest neighbours by more (0.8996 of the top 10 kept against 0.902).
    weight_type: str = "QUInt8"              # QInt8 | QUInt8


@dataclass
class Variant:
    name: str
    path: pathlib.Path
    gpu_only: bool = False  # measured on CPU, chosen only on a GPU executor
    notes: list[str] = field(default_factory=list)


def build(name: str, source: pathlib.Path, out: pathlib.Path, int8: Int8Options,
          calibration: Callable[[], list[dict[str, np.ndarray]]] | None) -> Variant | None:
    """Write variant `name` of the model at `source` into the directory `out` (None: it does not
    apply, e.g. int8-static without calibration inputs)."""
    path = out / f"{name}.onnx"
    if name == "graph":
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.optimized_model_filepath = str(path)
        ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
        return Variant(name, path)
    if name == "int8-dynamic":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        # MatMuls of two activations (attention's Q·K) stay in float: only weights are quantized ahead.
        quantize_dynamic(source, path, op_types_to_quantize=list(int8.op_types) or None, per_channel=int8.per_channel,
                         weight_type=getattr(QuantType, int8.weight_type), extra_options={"MatMulConstBOnly": True})
        return Variant(name, path, notes=[f"op types {list(int8.op_types) or 'all'}, "
                                          f"{'per channel' if int8.per_channel else 'per tensor'}, {int8.weight_type}"])
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
        quantize_static(source, path, Reader(), quant_format=QuantFormat.QDQ, op_types_to_quantize=list(int8.op_types) or None,
                        per_channel=int8.per_channel, activation_type=QuantType.QUInt8,
                        weight_type=getattr(QuantType, int8.weight_type))
        return Variant(name, path, notes=["QDQ, activation ranges calibrated (MinMax) on the calibration inputs"])
    if name == "fp16":
        import onnx
        from onnxruntime.transformers.float16 import convert_float_to_float16

        model = convert_float_to_float16(onnx.load(str(source)), keep_io_types=True)
        onnx.save(model, str(path))
        return Variant(name, path, gpu_only=True,
                       notes=["half precision for GPU executors: CPUs run FP16 through casts, so it is not chosen here"])
    raise ValueError(f"unknown variant {name!r} (known: {', '.join(VARIANTS)})")
