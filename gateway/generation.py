"""A generative model's answer to a unary ModelInfer: its token responses joined into one.

On ModelStreamInfer each output token is a response of its own (docs/design/generation.md); a
ModelInfer waits for them all and answers the whole text and every token id at once.
"""
from __future__ import annotations

import numpy as np

from batchline.codec import decode_tensor, encode_array
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import internal_pb2 as pb

TEXT_OUTPUT = "text_output"
TOKENS_OUTPUT = "token_ids"


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
