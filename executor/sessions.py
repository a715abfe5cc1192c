"""Execution providers and ONNX Runtime sessions: which providers a model asks for, in what order
and with which options, how many threads a run gets, and a session that comes up on the first of
them that works.

Apart from executor/repository.py because the generation engine (executor/generation_model.py)
opens its decoder's sessions the same way without the repository's config.toml and metadata.
"""
from __future__ import annotations

import logging
import os
import pathlib
import shutil
from typing import Any

import onnxruntime as ort

from batchline.optimize import tensorrt
from executor import providers as gpu

log = logging.getLogger(__name__)


def choose_providers(
    preferred: list[str], options: dict[str, dict[str, Any]], available: list[str]
) -> list[tuple[str, dict[str, Any]]]:
    """Providers to ask ONNX Runtime for, in order, keeping only those this build has."""
    chosen = [(p, dict(options.get(p, {}))) for p in preferred if p in available]
    if not any(p == "CPUExecutionProvider" for p, _ in chosen):
        chosen.append(("CPUExecutionProvider", {}))
    return chosen


def tensorrt_options(configured: dict[str, Any], model: str, version: str, version_dir: pathlib.Path,
                     trt_cache_dir: str) -> dict[str, Any]:
    """The TensorRT provider's options for one version: the model's own (config.toml) over FP16, an
    engine cache, and INT8 with the calibration table `batchline optimize` wrote beside the model."""
    trt = dict(configured)
    trt.setdefault("trt_fp16_enable", True)
    trt.setdefault("trt_engine_cache_enable", True)
    # A shared cache directory gets a folder per version: TensorRT names a cached engine by the
    # graph's file name and structure, not its weights, so a retrained version of the same
    # architecture would run on the last one's engine.
    cache = pathlib.Path(trt_cache_dir) / model / version if trt_cache_dir else version_dir / "trt_cache"
    trt.setdefault("trt_engine_cache_path", str(cache))
    if (version_dir / tensorrt.TABLE).exists():
        trt.setdefault("trt_int8_enable", True)
        # Named per version: a cache directory may be shared by every model.
        trt.setdefault("trt_int8_calibration_table_name", f"{model}-{version}-{tensorrt.TABLE}")
    return trt


def place_calibration_table(trt: dict[str, Any], version_dir: pathlib.Path) -> None:
    """TensorRT reads the calibration table from its engine cache directory: put the version's there."""
    table = version_dir / tensorrt.TABLE
    name = trt.get("trt_int8_calibration_table_name")
    if trt.get("trt_int8_enable") and name and table.exists():
        cache = pathlib.Path(trt["trt_engine_cache_path"])
        cache.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(table, cache / name)


def intra_op_threads_for(instances: int, configured: int = 0, cores: int = 0) -> int:
    """Intra-op threads of one run when `instances` runs of the model go at once (0: ONNX Runtime's default).

    `configured` (the executor's intra_op_threads) wins; else the runs share `cores` (the
    executor's cpu_cores; 0: the cores this process may run on). Two runs that each spread over
    every core only contend; and one run spread over cores that other processes also use stalls
    at each operator's barrier whenever one of its threads is preempted. Runs on a share of the
    cores each avoid both.
    """
    if configured:
        return configured
    if not cores and instances <= 1:
        return 0
    return max(1, (cores or len(os.sched_getaffinity(0))) // instances)


def create_session(
    path: pathlib.Path, providers: list[tuple[str, dict[str, Any]]], intra_op_threads: int, allow_spinning: bool = True,
    label: str = "",
) -> ort.InferenceSession:
    """A session on the first of `providers` that comes up. One a GPU provider cannot use is dropped
    with its options kept for the rest, and the session's log names (`label`, else the path) which
    it runs on instead and why."""
    def options() -> ort.SessionOptions:
        opts = ort.SessionOptions()
        if intra_op_threads:
            opts.intra_op_num_threads = intra_op_threads
        if not allow_spinning:
            # ORT's worker threads otherwise busy-wait after every run, taking cores
            # from the gateway and scheduler when they share a host.
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
            opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
        return opts

    if [p for p, _ in providers] == [gpu.CPU]:
        return ort.InferenceSession(str(path), sess_options=options(), providers=providers)
    available = ort.get_available_providers()
    if any(p in gpu.GPU and p in available for p, _ in providers):
        gpu.preload_cuda_libraries()
    remaining, errors = list(providers), {}
    while True:
        try:
            # ORT's own fallback would retry without any provider's options, and print why to stdout.
            session = ort.InferenceSession(str(path), sess_options=options(), providers=remaining, enable_fallback=0)
            break
        except Exception as exc:  # GPU provider libraries missing or broken
            if [p for p, _ in remaining] == [gpu.CPU]:
                raise
            errors[remaining[0][0]] = " ".join(str(exc).split())
            remaining = remaining[1:] or [(gpu.CPU, {})]
    if hasattr(session, "enable_fallback"):
        session.enable_fallback()  # a provider failing in a run still falls back, as before
    warning = gpu.fallback_warning(label or str(path), [p for p, _ in providers], session.get_providers(), available,
                                   errors)
    if warning:
        log.warning("%s", warning)
    return session
