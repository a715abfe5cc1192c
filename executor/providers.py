"""Why a model does not run on the GPU execution provider it asked for, and the CUDA libraries of
pip's nvidia-* packages, loaded once before any GPU session.

onnxruntime-gpu lists TensorRT and CUDA as available whether or not their libraries load: a session
asked for them comes up on the next provider, and ONNX Runtime's own account of why goes to stderr
(or, for TensorRT, to stdout with its fallback), away from the executor's log. The reasons here are
found again the way the dynamic loader finds them, so the executor's warning can say which library
is missing.
"""
from __future__ import annotations

import ctypes
import logging
import threading

import onnxruntime as ort

from batchline.optimize.providers import CPU, CUDA, GPU, TENSORRT  # the executor's names for them

log = logging.getLogger(__name__)


def build() -> tuple[str, str, str]:
    """This ONNX Runtime's package name, version and the CUDA version it was built with ("" for a CPU build)."""
    try:
        from onnxruntime.capi.onnxruntime_validation import get_package_name_and_version_info

        name, version, cuda = get_package_name_and_version_info()
    except Exception:  # noqa: BLE001 - a private module: the version alone still says enough
        name, version, cuda = "onnxruntime", ort.__version__, ""
    return name or "onnxruntime", version or ort.__version__, cuda or ""


def libraries(provider: str, cuda_version: str) -> list[str]:
    """The shared libraries `provider`'s ONNX Runtime library needs (its DT_NEEDED entries in
    onnxruntime-gpu 1.31; cuDNN too for CUDA, whose kernels need it), each as the loader looks it
    up. Those named after CUDA's major version are left out when it is unknown (a CPU build)."""
    major = cuda_version.split(".")[0]
    cudart, cublas_lt, cublas = ([f"libcudart.so.{major}"], [f"libcublasLt.so.{major}"], [f"libcublas.so.{major}"]) \
        if major else ([], [], [])
    if provider == TENSORRT:
        return ["libnvinfer.so.10", "libnvonnxparser.so.10", *cudart, *cublas, "libcudnn.so.9"]
    if provider == CUDA:
        return ["libcuda.so.1", *cudart, *cublas_lt, *cublas, "libcurand.so.10", "libcudnn.so.9"]
    return []


def unloadable(names: list[str]) -> list[tuple[str, str]]:
    """Those of `names` the dynamic loader cannot load into this process, each with its error.
    A library already loaded (by ONNX Runtime, or by preload_dlls from pip's nvidia packages)
    is found by its name, as it is for ONNX Runtime's provider library."""
    failed = []
    for name in names:
        try:
            ctypes.CDLL(name)
        except OSError as exc:
            failed.append((name, str(exc)))
    return failed


def why_unavailable(provider: str, available: list[str] | None = None) -> str:
    """Why ONNX Runtime cannot run `provider` in this process, as far as it can be told from
    outside: a build without it, and which of its libraries cannot be loaded, and the loader's
    error for each."""
    available = ort.get_available_providers() if available is None else available
    package, version, cuda_version = build()
    reasons = []
    if provider not in available:
        reasons.append(f"{package} {version} is built without it"
                       + (" (onnxruntime-gpu has it)" if provider in GPU else ""))
    wanted = libraries(provider, cuda_version)
    failed = unloadable(wanted)
    reasons += [f"{name} cannot be loaded ({error})" for name, error in failed]
    if wanted and not failed and provider in available:
        reasons.append(f"its libraries load ({', '.join(wanted)})")
    return "; ".join(reasons) or "no reason found"


def usable(available: list[str]) -> list[str]:
    """Those of `available` (what ONNX Runtime lists) whose libraries load in this process: what a
    session asked for them would run on. onnxruntime-gpu lists TensorRT without its libraries."""
    cuda_version = build()[2]
    if cuda_version and any(p in GPU for p in available):  # a CPU build has no CUDA libraries to load
        preload_cuda_libraries()
    return [p for p in available if p == CPU or not unloadable(libraries(p, cuda_version))]


def fallback_warning(label: str, requested: list[str], running: list[str], available: list[str],
                     errors: dict[str, str] | None = None) -> str | None:
    """The warning for a session (`label`) that runs on `running[0]` although it asked first for
    providers this build offers; None when it runs on the first it asked for that is available.
    `errors`: what creating the session with a provider raised, by provider."""
    errors = errors or {}
    lost = [p for p in requested if p != CPU and p in available and p not in running]
    if not lost:
        return None
    reasons = []
    for provider in lost:
        why = why_unavailable(provider, available)
        if provider in errors:
            why += f"; creating the session with it failed: {errors[provider]}"
        reasons.append(f"{provider}: {why}")
    return (f"{label} runs on {running[0] if running else '?'}, not {' nor '.join(lost)}, which ONNX Runtime offers "
            f"here but could not use. {' | '.join(reasons)}")


_preload = threading.Lock()
_preloaded = False


def preload_cuda_libraries() -> None:
    """Load the CUDA and cuDNN libraries of pip's nvidia-* packages (onnxruntime.preload_dlls,
    ONNX Runtime 1.21+) once per process: the providers' libraries carry no path to them, so
    without it they are found only on the library path. A failure is logged, not raised: the
    session then says what it runs on."""
    global _preloaded
    with _preload:
        if _preloaded:
            return
        _preloaded = True
        preload = getattr(ort, "preload_dlls", None)
        if preload is None:
            return
        try:
            preload()
        except Exception as exc:  # noqa: BLE001 - e.g. a directory it expects is missing
            log.warning("onnxruntime.preload_dlls() failed (%s): the CUDA libraries are looked for on the library path "
                        "only", exc)
