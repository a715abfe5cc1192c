"""Triton's classification extension: an output asked for with the `classification` parameter (N)
is answered with its N highest scores per row, as BYTES "score:index:label" ("score:index" for an
output without labels), best first, instead of the scores themselves."""
from __future__ import annotations

import numpy as np

from batchline.codec import DATATYPES, serialize_bytes
from batchline.errors import InvalidArgument
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import internal_pb2 as pb

PARAMETER = "classification"


def requested(request: ipb.ModelInferRequest, model: pb.ModelInfo) -> dict[str, int]:
    """Output name -> classes asked for, checked against the model (taken off the request)."""
    asked: dict[str, int] = {}
    specs = None  # built only for a request that asks for classes: this runs for every request
    for out in request.outputs:
        if PARAMETER not in out.parameters:
            continue
        if specs is None:
            specs = {s.name: s for s in model.outputs}
        param = out.parameters[PARAMETER]
        kind = param.WhichOneof("parameter_choice")
        count = getattr(param, kind) if kind in ("int64_param", "uint64_param") else 0
        if count < 1:
            raise InvalidArgument(f"output '{out.name}': parameter '{PARAMETER}' must be an integer >= 1 "
                                  "(classes to return)")
        spec = specs.get(out.name)
        if spec is not None and (spec.datatype in ("BYTES", "BOOL") or spec.datatype not in DATATYPES):
            raise InvalidArgument(f"output '{out.name}' of model '{model.name}' is {spec.datatype}: only a numeric "
                                  f"output can be classified")
        asked[out.name] = count
        del out.parameters[PARAMETER]
    return asked


def _entry(score, index: int, labels) -> bytes:
    text = f"{float(score):f}:{index}"
    return (f"{text}:{labels[index]}" if index < len(labels) else text).encode()


def classify(response: ipb.ModelInferResponse, model: pb.ModelInfo, asked: dict[str, int]) -> None:
    """Replace each output in `asked` with its top classes, in place."""
    specs = {s.name: s for s in model.outputs}
    batched = model.max_batch_size > 0
    for i, out in enumerate(response.outputs):
        if out.name not in asked or i >= len(response.raw_output_contents):
            continue
        scores = np.frombuffer(response.raw_output_contents[i], dtype=DATATYPES[out.datatype])
        rows = scores.reshape(out.shape[0], -1) if batched and out.shape else scores.reshape(1, -1)
        count = min(asked[out.name], rows.shape[1])
        labels = specs[out.name].labels if out.name in specs else []
        # Stable, best first: equal scores keep the lower index first, as Triton's sort does. Ranked
        # in float64: negating an unsigned or the lowest signed score would wrap.
        top = np.argsort(-rows.astype(np.float64), axis=1, kind="stable")[:, :count]
        entries = np.array([[_entry(row[j], int(j), labels) for j in idx] for row, idx in zip(rows, top)], dtype=object)
        response.raw_output_contents[i] = serialize_bytes(entries)
        out.datatype = "BYTES"
        del out.shape[:]
        out.shape.extend([rows.shape[0], count] if batched else [count])
