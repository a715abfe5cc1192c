"""A generative model's requests at the gateway: admission against their two-part budget, and the
answer to a unary ModelInfer, its token responses joined into one.

Admission (docs/design/generation.md#admission): a request's budget is a time to first token and a
time per output token (request parameters `ttft_ms` and `tpot_ms`, else the model's `[generation]`
defaults; 0 or absent: none). Each executor registers, for the model, its free slots and its
learned costs: a prefilled token's time and a decode step's at its running batch. The request is
admitted if some executor with a free slot is predicted to meet both: its first token after its
prompt's prefill (its token ids, or its text's UTF-8 bytes: an upper bound of a byte-level BPE's
tokens) and one decode step, each later token a decode step. Otherwise it is refused at once, RESOURCE_EXHAUSTED
with a retry hint. Until an executor has measured its costs, requests are admitted.

On ModelStreamInfer each output token is a response of its own; a ModelInfer waits for them all
and answers the whole text and every token id at once.
"""
from __future__ import annotations

import numpy as np

from batchline.codec import decode_inputs, decode_tensor, encode_array
from batchline.errors import InvalidArgument, ResourceExhausted
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import internal_pb2 as pb

TEXT_OUTPUT = "text_output"
TOKENS_OUTPUT = "token_ids"
TEXT_INPUT = "text_input"
IDS_INPUT = "input_ids"
# A refused request is told to retry after this many decode steps (sequences leave the running
# batch as they end; a few steps free a slot or shorten the batch at the load it was refused at).
RETRY_STEPS = 8


def budget_s(request: ipb.ModelInferRequest, name: str, default_ms: float) -> float:
    """The request's `name` budget (milliseconds, an integer or a number as text) in seconds; 0: none."""
    if name not in request.parameters:
        return default_ms / 1000
    param = request.parameters[name]
    kind = param.WhichOneof("parameter_choice")
    try:
        value = float(getattr(param, kind)) if kind in ("int64_param", "uint64_param", "double_param",
                                                          "string_param") else -1.0
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise InvalidArgument(f"parameter '{name}' must be milliseconds >= 0 (0: no budget), got "
                              f"{getattr(param, kind) if kind else 'nothing'!r}")
    return value / 1000


def admit(request: ipb.ModelInferRequest, model: pb.ModelInfo, placed: list[pb.ModelInfo]) -> None:
    """Refuse (ResourceExhausted) a request no executor is predicted to meet the budget of; `placed`:
    the model's ModelInfo as each executor serving it registered it."""
    ttft, tpot = budget_s(request, "ttft_ms", model.ttft_ms), budget_s(request, "tpot_ms", model.tpot_ms)
    if not (ttft or tpot) or not placed or any(not p.decode_step_s for p in placed):
        return
    inputs = decode_inputs(request)
    text, ids = inputs.get(TEXT_INPUT), inputs.get(IDS_INPUT)
    prompt = ids.size if ids is not None else len(text.reshape(-1)[0]) if text is not None and text.size else 1
    best: tuple[float, float] | None = None
    for p in placed:
        if p.generation_running + p.generation_waiting >= p.generation_slots:
            continue
        first, per = prompt * p.prefill_token_s + p.decode_step_s, p.decode_step_s
        if (not ttft or first <= ttft) and (not tpot or per <= tpot):
            return
        best = min(best or (first, per), (first, per))
    step = min(p.decode_step_s for p in placed)
    retry = max(0.01, RETRY_STEPS * step)
    if best is None:
        why = f"every executor of model '{model.name}' has all its {placed[0].generation_slots} sequences' cache in use"
    else:
        why = (f"model '{model.name}' is predicted to take {best[0] * 1e3:.0f} ms to the first token and "
               f"{best[1] * 1e3:.1f} ms per token, over the budget of " +
               " and ".join(f"{label} {b * 1e3:g} ms" for label, b in (("ttft_ms", ttft), ("tpot_ms", tpot)) if b))
    raise ResourceExhausted(f"{why}: retry in {retry * 1e3:.0f} ms, or with a larger budget", retry_after_s=retry)


def joined(responses: list[ipb.ModelInferResponse], model: pb.ModelInfo, request_id: str) -> ipb.ModelInferResponse:
    """One response of `responses`' text (joined) and token ids (in order)."""
    text, tokens = [], []
    for response in responses:
        for i, out in enumerate(response.outputs):
            array = decode_tensor(out.name, out.datatype, list(out.shape), response.raw_output_contents[i], None)
            if out.name == TEXT_OUTPUT:
                text += [bytes(t) for t in array.reshape(-1)]
            elif out.name == TOKENS_OUTPUT:
                tokens += array.reshape(-1).tolist()
    answer = ipb.ModelInferResponse(model_name=model.name, model_version=model.version, id=request_id)
    for name, array in ((TEXT_OUTPUT, np.array([b"".join(text)], dtype=object)),
                        (TOKENS_OUTPUT, np.array(tokens, dtype=np.int64))):
        datatype, shape, raw = encode_array(array)
        answer.outputs.add(name=name, datatype=datatype, shape=shape)
        answer.raw_output_contents.append(raw)
    return answer
