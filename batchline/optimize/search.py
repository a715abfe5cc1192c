"""INT8 that keeps quality, found rather than hoped for: when quantizing every MatMul fails the
gate, keep the most harmful ones in FP32, the fewest that pass.

As Intel Neural Compressor's tuning does: measure each quantized node's harm (every node quantized
but that one, on a subset of the inputs: how much nearer FP32 the outputs come, by
gate.distance), rank them, then find the fewest of the most harmful to keep in FP32 for the whole
gate to pass on every input: doubling the count until it passes, then bisecting, each count a
model built with quantize_dynamic's nodes_to_exclude and judged as any variant is. The ranking's
dozens of trials run on one model (switchable.py) where a boolean input picks the nodes in FP32,
so nothing is quantized again for them.
"""
from __future__ import annotations

import pathlib
import time
from typing import Callable

import numpy as np
import onnx
import onnxruntime as ort

from batchline.optimize import gate, inputs, switchable

# Rows the harm of each node is measured on: on minilm the two most harmful ranked the same on 64,
# 128 and 256 rows, and ranking all 36 on 128 takes about 20 s on two cores.
RANKING_ROWS = 128


def _outputs(session: ort.InferenceSession, batches: list, switch: np.ndarray) -> dict[str, np.ndarray]:
    names = [o.name for o in session.get_outputs()]
    runs = [session.run(names, {**b, switchable.SWITCH: switch}) for b in batches]
    return {n: np.concatenate([r[i] for r in runs]) for i, n in enumerate(names)}


def exclusions(source: pathlib.Path, quantized: pathlib.Path, op_types: tuple[str, ...], scratch: pathlib.Path,
               batches: list[dict[str, np.ndarray]], reference: dict[str, np.ndarray], kinds: dict[str, str],
               attempt: Callable[[list[str]], dict]) -> dict:
    """The search's record: the nodes to keep in FP32 ("fp32_nodes"), how every node ranked, and each
    set tried. `attempt(names)` builds the model with `names` in FP32 and judges it on every input:
    {"gate": verdict, ...}; the record's "chosen" is the attempt that passed with the fewest (None if
    none passed, even with every node in FP32)."""
    started = time.perf_counter()
    fp32 = onnx.load(str(source))
    nodes = switchable.replaced(fp32, onnx.load(str(quantized)), op_types)
    ranking, measured = _ranking(fp32, quantized, nodes, scratch, batches, reference, kinds)
    tried: dict[int, dict] = {}

    def passes(count: int) -> bool:
        if count not in tried:
            tried[count] = attempt([r["node"] for r in ranking[:count]])
        return tried[count]["gate"]["passed"]

    # Doubling, then bisecting: a few models are built and judged on every input, not one per node.
    low, high = 0, 1
    while high < len(nodes) and not passes(high):
        low, high = high, min(2 * high, len(nodes))
    if not nodes or not passes(high):
        high = None
    else:
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if passes(middle) else (middle, high)
    return {"fp32_nodes": [r["node"] for r in ranking[:high or 0]], "quantized_nodes": len(nodes),
            **measured, "ranking": ranking, "chosen": None if high is None else tried[high],
            "tried": [{"fp32_nodes": k, "passed": t["gate"]["passed"], "outputs": t["gate"]["outputs"]}
                      for k, t in sorted(tried.items())],
            "seconds": round(time.perf_counter() - started, 1)}


def _ranking(fp32: onnx.ModelProto, quantized: pathlib.Path, nodes: list, scratch: pathlib.Path,
             batches: list[dict[str, np.ndarray]], reference: dict[str, np.ndarray],
             kinds: dict[str, str]) -> tuple[list[dict], dict]:
    """Every replaced node, the most harmful first: how much nearer FP32 the outputs come on a subset
    of the inputs when it alone is in FP32 ("effect", in gate.distance); and what it was measured on."""
    if not nodes:
        return [], {}
    path = scratch / "int8-dynamic-switchable.onnx"
    onnx.save(switchable.build(fp32, onnx.load(str(quantized)), nodes), str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    picked = inputs.spread(batches, RANKING_ROWS)
    starts = np.cumsum([0] + [len(next(iter(b.values()))) for b in batches])
    rows = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in picked])
    few, few_reference = [batches[i] for i in picked], {k: v[rows] for k, v in reference.items()}

    def distance_with(index: int | None) -> float:
        switch = np.zeros(len(nodes), bool)
        if index is not None:
            switch[index] = True
        return gate.distance(few_reference, _outputs(session, few, switch), kinds)

    everything = distance_with(None)
    effects = [everything - distance_with(i) for i in range(len(nodes))]
    order = sorted(range(len(nodes)), key=lambda i: -effects[i])
    return ([{"node": nodes[i].name, "effect": effects[i]} for i in order],
            {"ranked_on_rows": int(len(rows)), "distance_all_quantized": everything})
