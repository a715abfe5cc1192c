"""One model in which any set of the quantized nodes runs in FP32 instead, chosen per run: the
quantized model with, beside each node the quantizer replaced, the original node behind an `If` on
one element of a boolean input. The exclusion search (search.py) tries dozens of sets on it without
quantizing again, and an FP32 node costs only when it is switched on."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SWITCH = "batchline_fp32_nodes"  # the input: bool[len(nodes)], true = that node in FP32


def replaced(fp32: onnx.ModelProto, quantized: onnx.ModelProto, op_types: tuple[str, ...]) -> list[onnx.NodeProto]:
    """The FP32 model's nodes that the quantizer replaced (their names are gone from the quantized
    model, and their outputs are produced there by what replaced them), in graph order."""
    names = {n.name for n in quantized.graph.node}
    produced = {o for n in quantized.graph.node for o in n.output}
    return [n for n in fp32.graph.node if n.name and n.name not in names and (not op_types or n.op_type in op_types)
            and all(o in produced for o in n.output if o)]


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    try:
        inferred = onnx.shape_inference.infer_shapes(model).graph
    except Exception:  # noqa: BLE001 - shape inference is a convenience here: FLOAT is the fallback
        return {}
    return {v.name: v.type.tensor_type.elem_type for v in [*inferred.value_info, *inferred.output]}


def build(fp32: onnx.ModelProto, quantized: onnx.ModelProto, nodes: list[onnx.NodeProto]) -> onnx.ModelProto:
    """The quantized model with a switch to FP32 for each of `nodes` (from `replaced`)."""
    model = onnx.ModelProto()
    model.CopyFrom(quantized)
    graph = model.graph
    graph.input.append(helper.make_tensor_value_info(SWITCH, TensorProto.BOOL, [len(nodes)]))
    have = {i.name for i in graph.initializer}
    fp32_weights = {i.name: i for i in fp32.graph.initializer}
    types = _elem_types(fp32)
    switched = {o for node in nodes for o in node.output if o}
    for n in graph.node:
        n.output[:] = [f"{o}/int8" if o in switched else o for o in n.output]
    position = {o: i for i, n in enumerate(graph.node) for o in n.output}
    after: dict[int, list[onnx.NodeProto]] = {}  # each switch goes right after the last of its quantized outputs
    for index, node in enumerate(nodes):
        for name in node.input:
            if name in fp32_weights and name not in have:
                graph.initializer.append(fp32_weights[name])
                have.add(name)
        outputs = [o for o in node.output if o]
        original = helper.make_node(node.op_type, list(node.input), [f"{o}/fp32" for o in outputs],
                                    name=f"{node.name}/fp32", domain=node.domain)
        original.attribute.extend(node.attribute)
        then = helper.make_graph([original], f"{node.name}/fp32", [],
                                 [helper.make_tensor_value_info(f"{o}/fp32", types.get(o, TensorProto.FLOAT), None)
                                  for o in outputs])
        otherwise = helper.make_graph(
            [helper.make_node("Identity", [f"{o}/int8"], [f"{o}/kept"]) for o in outputs], f"{node.name}/int8", [],
            [helper.make_tensor_value_info(f"{o}/kept", types.get(o, TensorProto.FLOAT), None) for o in outputs])
        graph.initializer.append(numpy_helper.from_array(np.array(index, np.int64), f"{SWITCH}/{index}"))
        after.setdefault(max(position[f"{o}/int8"] for o in outputs), []).extend([
            helper.make_node("Gather", [SWITCH, f"{SWITCH}/{index}"], [f"{node.name}/use_fp32"]),
            helper.make_node("If", [f"{node.name}/use_fp32"], outputs, name=f"{node.name}/switch",
                             then_branch=then, else_branch=otherwise)])
    ordered = []
    for i, n in enumerate(graph.node):
        ordered += [n, *after.get(i, [])]
    del graph.node[:]
    graph.node.extend(ordered)
    return model
