"""A GPT-2 written as an ONNX graph whose attention updates the key/value cache in place.

Each layer's attention is ONNX Runtime's `GroupQueryAttention` (com.microsoft) with the past and
present sharing one buffer: ``past.<layer>.key|value`` is [batch, heads, max_context, head_dim],
row b holding its sequence's positions from 0, and the run writes the new positions' keys and
values into that same buffer (the engine binds the present output to the past input's memory).
So a decode step reads the cache where it lies and copies none of it, where a graph that takes
the past as a tensor of exactly the cached length needs it gathered from the slots every step
(23% of a step on GPT-2 small's shape at 32 sequences, docs/design/generation.md).

`GroupQueryAttention` takes no mask: each row's length comes from the attention mask, which here
must hold a row's positions as ones from the first (right padding), and attention is causal. It
runs on the CPU provider in float32 and on CUDA in float16 (``dtype``).

The graph is written from the model's weights rather than traced: transformers' attention does not
export to this operator. Its inputs and outputs keep the traced graph's names and meanings
(demo_decoder), except that the cache tensors are the whole buffers.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnx
    import torch

OPSET = 17


def in_place_graph(model: "torch.nn.Module", max_context: int, dtype: str = "float32") -> "onnx.ModelProto":
    """GPT2LMHeadModel `model` as a graph with an in-place cache of `max_context` positions."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    config = model.config
    heads, width = config.n_head, config.n_embd
    head_dim = width // heads
    np_dtype = np.dtype(dtype)
    elem = helper.np_dtype_to_tensor_dtype(np_dtype)
    weights = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
    initializers: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []

    def const(name: str, value, as_dtype=None) -> str:
        initializers.append(numpy_helper.from_array(np.asarray(value, as_dtype or np_dtype), name))
        return name

    def node(op: str, inputs: list[str], outputs: list[str] | str, domain: str = "", **attrs) -> str:
        outs = [outputs] if isinstance(outputs, str) else outputs
        nodes.append(helper.make_node(op, inputs, outs, name=outs[0], domain=domain, **attrs))
        return outs[0]

    def linear(x: str, prefix: str, out: str) -> str:
        # GPT-2's Conv1D keeps its weight as [in, out]: x @ W + b.
        y = node("MatMul", [x, const(f"{prefix}.weight", weights[f"{prefix}.weight"])], f"{out}.mm")
        return node("Add", [y, const(f"{prefix}.bias", weights[f"{prefix}.bias"])], out)

    def norm(x: str, prefix: str, out: str) -> str:
        return node("LayerNormalization", [x, const(f"{prefix}.weight", weights[f"{prefix}.weight"]),
                                           const(f"{prefix}.bias", weights[f"{prefix}.bias"])], out,
                    axis=-1, epsilon=float(config.layer_norm_epsilon))

    # Each row's length less one, and the longest row's length, as GroupQueryAttention takes them.
    mask_sum = node("ReduceSum", ["attention_mask", const("axis1", [1], np.int64)], "mask_sum", keepdims=0)
    last = node("Sub", [mask_sum, const("one", [1], np.int64)], "last_position")
    seqlens = node("Cast", [last], "seqlens_k", to=TensorProto.INT32)
    total = node("Shape", ["attention_mask"], "total_1d", start=1, end=2)
    total = node("Cast", [node("Squeeze", [total], "total_i64")], "total_sequence_length", to=TensorProto.INT32)

    wte = const("transformer.wte.weight", weights["transformer.wte.weight"])
    hidden = node("Add", [node("Gather", [wte, "input_ids"], "tokens", axis=0),
                          node("Gather", [const("transformer.wpe.weight", weights["transformer.wpe.weight"]),
                                          "position_ids"], "positions", axis=0)], "h0")
    cache_inputs, cache_outputs = [], []
    for i in range(config.n_layer):
        p = f"transformer.h.{i}"
        x = norm(hidden, f"{p}.ln_1", f"l{i}.ln1")
        qkv = linear(x, f"{p}.attn.c_attn", f"l{i}.qkv")
        q, k, v = f"l{i}.q", f"l{i}.k", f"l{i}.v"
        node("Split", [qkv, const(f"l{i}.split", [width] * 3, np.int64)], [q, k, v], axis=2)
        past = [f"past.{i}.key", f"past.{i}.value"]
        present = [f"present.{i}.key", f"present.{i}.value"]
        attended = node("GroupQueryAttention", [q, k, v, *past, seqlens, total], [f"l{i}.attn", *present],
                        domain="com.microsoft", num_heads=heads, kv_num_heads=heads)
        hidden = node("Add", [hidden, linear(attended, f"{p}.attn.c_proj", f"l{i}.attn_out")], f"l{i}.h1")
        x = norm(hidden, f"{p}.ln_2", f"l{i}.ln2")
        up = node("MatMul", [x, const(f"{p}.mlp.c_fc.weight", weights[f"{p}.mlp.c_fc.weight"])], f"l{i}.fc")
        # gelu_new, GPT-2's tanh approximation, is FastGelu's formula; the bias goes in with it.
        up = node("FastGelu", [up, const(f"{p}.mlp.c_fc.bias", weights[f"{p}.mlp.c_fc.bias"])], f"l{i}.gelu",
                  domain="com.microsoft")
        hidden = node("Add", [hidden, linear(up, f"{p}.mlp.c_proj", f"l{i}.mlp_out")], f"l{i}.h2")
        cache_inputs += past
        cache_outputs += present
    final = norm(hidden, "transformer.ln_f", "ln_f")
    node("MatMul", [final, const("lm_head.weight_t", weights["lm_head.weight"].T.copy())], "logits")

    cache_shape = ["batch", heads, max_context, head_dim]
    graph = helper.make_graph(
        nodes, "gpt2_in_place_cache",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
         helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "sequence"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"]),
         *(helper.make_tensor_value_info(n, elem, cache_shape) for n in cache_inputs)],
        [helper.make_tensor_value_info("logits", elem, ["batch", "sequence", config.vocab_size]),
         *(helper.make_tensor_value_info(n, elem, cache_shape) for n in cache_outputs)],
        initializers)
    onnx_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                         helper.make_opsetid("com.microsoft", 1)])
    onnx_model.ir_version = 8
    onnx.checker.check_model(onnx_model)
    return onnx_model
