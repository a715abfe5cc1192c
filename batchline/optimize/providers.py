"""Where each variant is judged and timed, and which may become the version: by the execution
providers this host's ONNX Runtime offers, and the one that serves the model here.

A variant is built for one provider: the INT8 and graph variants for CPU executors, FP16 for CUDA,
TensorRT's INT8 for TensorRT. It is judged and timed there, against FP32 on the same provider, or
skipped with the reason where this host lacks it. Only a variant for the kind of device the model is
served on here (CPU or GPU) may become the version: a CPU INT8 model is no faster on a GPU executor.
"""
from __future__ import annotations

from dataclasses import dataclass

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
TENSORRT = "TensorrtExecutionProvider"
GPU = (TENSORRT, CUDA)
# The provider each variant is built for.
TARGETS = {"graph": CPU, "int8-dynamic": CPU, "int8-static": CPU, "fp16": CUDA, "tensorrt-int8": TENSORRT}


def _unavailable(variant: str, target: str, available: list[str]) -> str:
    offered = ", ".join(available)
    if target == TENSORRT:
        return (f"TensorRT is not available here (ONNX Runtime offers {offered}): on a GPU host with onnxruntime-gpu "
                "and TensorRT this variant is the FP32 model served with trt_int8_enable and the calibration table "
                "written beside it")
    return (f"{variant} is for GPU executors and is judged and timed on {target}, which this host lacks (ONNX "
            f"Runtime offers {offered}): a CPU runs half precision through casts, slower than FP32")


def device(provider: str) -> str:
    return "GPU" if provider in GPU else "CPU"


def serving(configured: list[str], available: list[str]) -> str:
    """The provider that serves the model on this host: the first of its providers (config.toml's, or
    the executor's defaults) that ONNX Runtime offers here, else the CPU."""
    return next((p for p in configured if p in available), CPU)


@dataclass(frozen=True)
class Step:
    variant: str
    provider: str | None  # judged and timed on it; None: skipped
    skipped: str = ""     # why, when skipped
    choosable: bool = False  # may become the version: built for the device that serves the model here


def plan(variants: list[str] | tuple[str, ...], available: list[str], serves_on: str) -> list[Step]:
    """Per variant, in order: the provider it is judged and timed on, or why it is skipped; and
    whether it may be chosen."""
    steps = []
    for name in variants:
        target = TARGETS[name]
        if target not in available:
            steps.append(Step(name, None, _unavailable(name, target, available)))
            continue
        steps.append(Step(name, target, choosable=device(target) == device(serves_on)))
    return steps


def session_providers(provider: str, options: dict | None = None) -> list:
    """The providers list for a session on `provider` (with its options), and behind it those that
    take the ops it lacks, as an executor lists them: CUDA behind TensorRT, the CPU behind both."""
    first = (provider, options) if options else provider
    return [first] + {TENSORRT: [CUDA, CPU], CUDA: [CPU], CPU: []}[provider]


def choose(results: list[dict], largest: str, min_gain: float, serves_on: str) -> tuple[str | None, str]:
    """The fastest variant at the largest batch size that passed the gate and was judged on the kind
    of device (CPU or GPU) of `serves_on`, the provider that serves the model, if it is faster
    enough than FP32 on its own provider."""
    eligible = [r for r in results if "gate" in r and r["gate"]["passed"]
                and device(r["provider"]) == device(serves_on)]
    if not eligible:
        return None, (f"no variant for {device(serves_on)} executors passed the gate ({serves_on} serves the model "
                      "here)")
    best = max(eligible, key=lambda r: r["speed"][largest]["throughput_ratio"])
    ratio = best["speed"][largest]["throughput_ratio"]
    if ratio < min_gain:
        return None, (f"the fastest variant that passed the gate ({best['name']}) is not enough faster than FP32 "
                      f"({ratio:.2f}x, under {min_gain}x)")
    return best["name"], (f"the fastest that passed the gate: {ratio:.2f}x FP32's throughput at batch {largest} "
                          f"on {best['provider']}")
