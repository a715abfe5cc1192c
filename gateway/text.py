"""Text in: a request that sends a model's `text` input is tokenized here, into the token-id
inputs the graph takes, before it is validated, admitted and queued.

Here rather than on the executor because the cost model prices a request by its real token
length, and the gateway needs that length to admit it and the scheduler to batch it; the
tokenizer (Hugging Face `tokenizers`, Rust) takes tens of microseconds a sentence, less than
the gRPC call that carries it (docs/guides/model-repository.md#text-inputs has the numbers).
The tokenizer travels from the executor that loaded it through Redis (keys.tokenizer),
so a gateway needs no copy of the repository.
"""
from __future__ import annotations

import numpy as np
from batchline.contract.gateway_store import GatewayStore
from tokenizers import Tokenizer

from batchline import metrics
from batchline.codec import decode_inputs
from batchline.errors import InvalidArgument, Unavailable
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import internal_pb2 as pb
from batchline.redis_client import REDIS_ERRORS, unreachable
from batchline.text_inputs import configured, first_too_long, fixed_width, token_arrays
from gateway.validation import check_raw_or_typed


# The answer's parameter that says how many of a request's texts were cut to the model's max_length
# (present only when some were).
TRUNCATED_KEY = "text_truncated"


class Tokenizers:
    """Tokenizers by the SHA-256 of their tokenizer.json, read from Redis once each."""

    def __init__(self, store: GatewayStore) -> None:
        self.store = store
        self._loaded: dict[tuple[str, int, bool], Tokenizer] = {}

    async def get(self, model: pb.ModelInfo) -> Tokenizer:
        """The model's tokenizer, set to truncate at its max_length (or not to truncate), never to pad."""
        text = model.text
        sha = text.tokenizer_sha256
        key = (sha, text.max_length, text.truncate)
        tokenizer = self._loaded.get(key)
        if tokenizer is None:
            try:
                blob = await self.store.tokenizer(sha)
            except REDIS_ERRORS as exc:
                raise Unavailable(unreachable(exc)) from None
            if blob is None:
                raise Unavailable(f"the tokenizer of model '{model.name}' is not in Redis yet (its executor publishes "
                                  "it when it loads the model): retry")
            tokenizer = configured(blob.decode(), text)
            self._loaded[key] = tokenizer
        return tokenizer

    async def convert(self, request: ipb.ModelInferRequest, model: pb.ModelInfo) -> tuple[ipb.ModelInferRequest, int]:
        """`request` with its text tokenized into the model's token-id inputs (as it is if it sends no
        text), and how many of its texts were cut to the model's max_length."""
        text = model.text
        if not text.name or not any(t.name == text.name for t in request.inputs):
            return request, 0
        strings = _strings(request, model)
        tokenizer = await self.get(model)
        encodings = tokenizer.encode_batch(strings)
        too_long = first_too_long(encodings, text)
        if too_long:
            i, n = too_long
            raise InvalidArgument(f"input '{text.name}': element {i} is {n} tokens, more than the {text.max_length} "
                                  f"model '{model.name}' takes (its [tokenizer] does not truncate)")
        cut = sum(1 for e in encodings if e.overflowing) if text.truncate else 0
        if cut:
            metrics.TEXT_TRUNCATED.labels(model.name, model.version).inc(cut)
        return _with_inputs(request, token_arrays(encodings, text, fixed_width(model))), cut


def _strings(request: ipb.ModelInferRequest, model: pb.ModelInfo) -> list[str]:
    """The request's text elements, checked: BYTES, [batch] or [batch, 1], valid UTF-8, not empty."""
    text = model.text
    if len(request.inputs) != 1:
        others = sorted(t.name for t in request.inputs if t.name != text.name)
        raise InvalidArgument(f"input '{text.name}' of model '{model.name}' is sent alone (the model tokenizes it "
                              f"into {text.ids_input!r} and {text.mask_input!r}); the request also has {others}")
    tensor = request.inputs[0]
    if tensor.datatype != "BYTES":
        raise InvalidArgument(f"input '{text.name}' of model '{model.name}' must be BYTES, "
                              f"got {tensor.datatype or 'no datatype'}")
    shape = list(tensor.shape)
    if not (len(shape) == 1 or (len(shape) == 2 and shape[1] == 1)) or shape[0] < 1:
        raise InvalidArgument(f"input '{text.name}' must have shape ['batch'] or ['batch', 1], got {shape}")
    if model.max_batch_size and shape[0] > model.max_batch_size:
        raise InvalidArgument(f"input '{text.name}': batch size {shape[0]} is outside 1..{model.max_batch_size} "
                              f"(max_batch_size of model '{model.name}')")
    # As every request is checked (gateway/validation.py): the text request is rebuilt before that.
    check_raw_or_typed(request, model)
    items = decode_inputs(request)[text.name].reshape(-1)
    strings = []
    for i, item in enumerate(items):
        try:
            s = bytes(item).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidArgument(f"input '{text.name}': element {i} is not valid UTF-8 "
                                  f"({exc.reason} at byte {exc.start})") from None
        if not s.strip():
            raise InvalidArgument(f"input '{text.name}': element {i} is empty")
        strings.append(s)
    return strings


def _with_inputs(request: ipb.ModelInferRequest, arrays: list[tuple[str, np.ndarray]]) -> ipb.ModelInferRequest:
    out = ipb.ModelInferRequest(model_name=request.model_name, model_version=request.model_version, id=request.id)
    for key, value in request.parameters.items():
        out.parameters[key].CopyFrom(value)
    out.outputs.extend(request.outputs)
    for name, array in arrays:
        out.inputs.add(name=name, datatype="INT64", shape=list(array.shape))
        out.raw_input_contents.append(array.tobytes())
    return out


def text_spec(model: pb.ModelInfo) -> pb.TensorSpec | None:
    """The text input as metadata shows it (None: the model takes none)."""
    if not model.text.name:
        return None
    return pb.TensorSpec(name=model.text.name, datatype="BYTES", shape=[-1, 1] if model.max_batch_size else [1])
