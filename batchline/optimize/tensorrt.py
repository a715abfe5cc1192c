"""TensorRT's own INT8, for GPU executors: the FP32 model served with `trt_int8_enable` and a
calibration table of its activation ranges on the user's inputs.

The table (`calibration.flatbuffers`, ONNX Runtime's format for the TensorRT execution provider)
is computed on the CPU, so `optimize` writes it on any host; the variant can be judged and timed
only where TensorRT runs. Executors load a version directory holding such a table with
`trt_int8_enable` (executor/sessions.py: tensorrt_options)."""
from __future__ import annotations

import pathlib
import shutil
import tempfile
from typing import Callable

import numpy as np

PROVIDER = "TensorrtExecutionProvider"
TABLE = "calibration.flatbuffers"


def write_table(source: pathlib.Path, batches: Callable[[], list[dict[str, np.ndarray]]],
                out: pathlib.Path) -> pathlib.Path:
    """Calibrate the FP32 model at `source` on `batches` (MinMax) and write its TensorRT calibration
    table into the directory `out`; returns the table's path."""
    from onnxruntime.quantization.calibrate import CalibrationDataReader, create_calibrator
    from onnxruntime.quantization.quant_utils import write_calibration_table

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._feeds = iter(batches())

        def get_next(self):
            return next(self._feeds, None)

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="batchline-trt-calibration-") as tmp:
        calibrator = create_calibrator(source, augmented_model_path=str(pathlib.Path(tmp) / "augmented.onnx"),
                                       providers=["CPUExecutionProvider"])
        calibrator.collect_data(Reader())
        ranges = calibrator.compute_data()
        write_calibration_table(ranges, dir=tmp)
        shutil.copyfile(pathlib.Path(tmp) / TABLE, out / TABLE)
    return out / TABLE

