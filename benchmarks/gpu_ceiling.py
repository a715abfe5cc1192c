"""ONNX Runtime alone, for benchmarks/gpu.py: the ceiling the mesh is measured against, and which of the
CUDA provider's options change it.

The ceiling is what the executor could do with its inputs already in host memory (they come from Redis):
plain `session.run` with numpy inputs and outputs, the host-device copies included, one run at a time
or two sessions at once (the executor's two lanes for minilm), at the batch sizes the scheduler forms.
The options are measured at one batch size against that plain run: IO binding with the inputs and
outputs left on the device (the copies' share), a CUDA graph replayed through IO binding (the kernel
launches' share), and TF32 matrix products for FP32.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnxruntime as ort

from batchline.optimize.providers import CPU, CUDA
ONE_RUN, TWO_SESSIONS = "one run at a time", "two sessions at once"


def feed(rows: int, seq_len: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(1000, 29000, size=(rows, seq_len), dtype=np.int64),
            "attention_mask": np.ones((rows, seq_len), dtype=np.int64)}


def session(path, provider: str, options: dict | None = None, threads: int = 0) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    first = (provider, options) if options else provider
    providers = [first, CPU] if provider != CPU else [CPU]
    s = ort.InferenceSession(str(path), sess_options=opts, providers=providers)
    if s.get_providers()[0] != provider:
        raise RuntimeError(f"{path}: asked for {provider}, ONNX Runtime runs it on {s.get_providers()[0]}")
    return s


def _rate(run, rows: int, seconds: float) -> float:
    """Rows per second of `run()` repeated for about `seconds` (after one untimed run)."""
    run()
    n, start = 0, time.perf_counter()
    while True:
        run()
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return n * rows / elapsed


def curve(sessions: list[ort.InferenceSession], seq_len: int, batches: list[int], seconds: float) -> dict:
    """Rows/s per batch size, one run at a time on sessions[0] and, with two sessions, both at once."""
    out: dict[str, dict[int, float]] = {ONE_RUN: {}}
    if len(sessions) > 1:
        out[TWO_SESSIONS] = {}
    with ThreadPoolExecutor(len(sessions)) as pool:
        for b in batches:
            f = feed(b, seq_len)
            out[ONE_RUN][b] = _rate(lambda: sessions[0].run(None, f), b, seconds)
            if len(sessions) > 1:
                rates = pool.map(lambda s: _rate(lambda: s.run(None, f), b, seconds), sessions)
                out[TWO_SESSIONS][b] = sum(rates)
    return out


def best(curves: dict[str, dict[int, float]], up_to: int) -> tuple[float, int, str]:
    """The ceiling: the best rows/s at a batch size the scheduler may form, its batch and way."""
    return max(((rate, b, way) for way, c in curves.items() for b, rate in c.items() if b <= up_to),
               default=(0.0, 0, ""))


def _bound_rate(s: ort.InferenceSession, f: dict[str, np.ndarray], rows: int, seconds: float,
                device_outputs: bool = True) -> float:
    """Rows/s with the inputs copied to the device once and the outputs left there."""
    binding = s.io_binding()
    values = {k: ort.OrtValue.ortvalue_from_numpy(v, "cuda", 0) for k, v in f.items()}
    for k, v in values.items():
        binding.bind_ortvalue_input(k, v)
    for o in s.get_outputs():
        if device_outputs:
            binding.bind_output(o.name, "cuda", 0)
        else:
            binding.bind_output(o.name)

    def run() -> None:
        s.run_with_iobinding(binding)

    return _rate(run, rows, seconds)


def _graph_rate(path, f: dict[str, np.ndarray], rows: int, seconds: float) -> float:
    """Rows/s of a CUDA graph captured on the first run and replayed (fixed shapes and addresses)."""
    s = session(path, CUDA, {"enable_cuda_graph": "1"})
    binding = s.io_binding()
    values = {k: ort.OrtValue.ortvalue_from_numpy(v, "cuda", 0) for k, v in f.items()}
    for k, v in values.items():
        binding.bind_ortvalue_input(k, v)
    outputs = {}
    for o in s.get_outputs():
        # A graph replays into the addresses it captured: the outputs are preallocated.
        shape = [rows if not isinstance(d, int) or d < 0 else d for d in o.shape]
        if len(shape) >= 1:
            shape[0] = rows
        outputs[o.name] = ort.OrtValue.ortvalue_from_shape_and_type(shape, np.float32, "cuda", 0)
        binding.bind_ortvalue_output(o.name, outputs[o.name])

    def run() -> None:
        s.run_with_iobinding(binding)

    return _rate(run, rows, seconds)


def options(fp32_path, fp16_path, seq_len: int, rows: int, seconds: float) -> dict:
    """Each CUDA option's rows/s against the plain run at one batch size, FP32 and FP16; an option that
    fails is reported with its error rather than stopping the rest."""
    f = feed(rows, seq_len)
    out: dict[str, dict] = {}
    for label, path in (("fp32", fp32_path), ("fp16", fp16_path)):
        plain = session(path, CUDA)
        row: dict[str, float | str] = {"plain": _rate(lambda: plain.run(None, f), rows, seconds)}
        for name, measure in (
            ("io binding, outputs on the device", lambda: _bound_rate(plain, f, rows, seconds)),
            ("io binding, outputs to the host", lambda: _bound_rate(plain, f, rows, seconds, device_outputs=False)),
            ("cuda graph", lambda: _graph_rate(path, f, rows, seconds)),
        ):
            try:
                row[name] = measure()
            except Exception as exc:  # noqa: BLE001 - an option this build or model does not take
                row[name] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        if label == "fp32":
            try:
                tf32 = session(path, CUDA, {"use_tf32": "0"})
                row["use_tf32=0"] = _rate(lambda: tf32.run(None, f), rows, seconds)
            except Exception as exc:  # noqa: BLE001
                row["use_tf32=0"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        out[label] = row
    return out


def max_abs_difference(a_path, b_path, provider_a: str, provider_b: str, seq_len: int, rows: int) -> float:
    """The largest absolute difference between two sessions' first outputs on the same batch."""
    f = feed(rows, seq_len, seed=7)
    a = session(a_path, provider_a).run(None, f)[0]
    b = session(b_path, provider_b).run(None, f)[0]
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
