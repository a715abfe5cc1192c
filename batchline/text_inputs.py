"""Text to the token-id inputs a model takes, as its config.toml `[tokenizer]` table says
(`pb.TextInput`, set by executor/repository.py when it loads the model).

One copy for everything that tokenizes for a model: the gateway's text requests (gateway/text.py)
and `batchline optimize --texts` (batchline/optimize/inputs.py), so that a variant is judged on
the token ids it will be served.
"""
from __future__ import annotations

import numpy as np
from tokenizers import Encoding, Tokenizer

from batchline.protocol import internal_pb2 as pb


def configured(tokenizer_json: str, text: pb.TextInput) -> Tokenizer:
    """The tokenizer of `tokenizer_json`, set to truncate at the model's max_length (or not to
    truncate), never to pad: the padding is token_arrays', to the longest text of a batch, whatever
    tokenizer.json says."""
    tokenizer = Tokenizer.from_str(tokenizer_json)
    tokenizer.no_padding()
    if text.truncate:
        tokenizer.enable_truncation(text.max_length)
    else:
        tokenizer.no_truncation()
    return tokenizer


def first_too_long(encodings: list[Encoding], text: pb.TextInput) -> tuple[int, int] | None:
    """(index, tokens) of the first text over max_length, which the model does not take; None if none.
    Only a tokenizer that does not truncate yields one."""
    for i, e in enumerate(encodings):
        if len(e.ids) > text.max_length:
            return i, len(e.ids)
    return None


def fixed_width(info: pb.ModelInfo) -> int:
    """The token inputs' length when the graph fixes it (exported at, say, 128 tokens); 0: any."""
    spec = next((s for s in info.inputs if s.name == info.text.ids_input), None)
    return spec.shape[1] if spec is not None and len(spec.shape) == 2 and spec.shape[1] > 0 else 0


def token_arrays(encodings: list[Encoding], text: pb.TextInput, width: int = 0) -> list[tuple[str, np.ndarray]]:
    """The graph's token inputs for `encodings`, INT64, padded with zeros (masked) to the longest,
    or to `width` where the graph fixes the length (fixed_width): ids, attention mask, and token
    types (zeros) when the model takes them."""
    lengths = [len(e.ids) for e in encodings]
    width = max(*lengths, width)
    ids = np.zeros((len(encodings), width), np.int64)
    mask = np.zeros((len(encodings), width), np.int64)
    for i, (e, n) in enumerate(zip(encodings, lengths)):
        ids[i, :n] = e.ids[:n]
        mask[i, :n] = 1
    return [(text.ids_input, ids), (text.mask_input, mask)] + (
        [(text.type_ids_input, np.zeros_like(ids))] if text.type_ids_input else [])
