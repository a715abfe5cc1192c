"""A request's tensors in the client's shared-memory regions, which the gateway referenced in
place of their bytes (this executor shares its /dev/shm: batchline/regions.py): its inputs read
from them, its outputs written into them. A region this executor cannot open fails the request
with RegionUnreadable, which its gateway answers by queueing it again with the bytes
(docs/design/shared-memory.md)."""
from __future__ import annotations

import numpy as np

from batchline.codec import decode_tensor
from batchline.protocol import inference_pb2 as ipb
from batchline.regions import REF, WRITTEN, Ref, too_small


def read_inputs(request: ipb.ModelInferRequest) -> dict[str, np.ndarray] | None:
    """The inputs the request references, read and decoded (None: it references none). The
    regions of its outputs are opened too, so that one this executor cannot write fails the
    request before it runs rather than after."""
    arrays: dict[str, np.ndarray] | None = None
    for tensor in request.inputs:
        if REF in tensor.parameters:
            ref = Ref.decode(tensor.parameters[REF].string_param)
            data = ref.read(f"input '{tensor.name}'")
            if arrays is None:
                arrays = {}
            arrays[tensor.name] = decode_tensor(tensor.name, tensor.datatype, list(tensor.shape), data, None)
    for out in request.outputs:
        if REF in out.parameters:
            Ref.decode(out.parameters[REF].string_param).check(writable=True)
    return arrays


def writes_outputs(request: ipb.ModelInferRequest | None) -> bool:
    """Whether the request has outputs to write into regions."""
    return request is not None and any(REF in o.parameters for o in request.outputs)


def write_outputs(request: ipb.ModelInferRequest, response: ipb.ModelInferResponse) -> None:
    """Write the outputs the request references into their regions; the answer keeps how many
    bytes each took instead of them. Raises InvalidArgument for a region too small (or shrunk)."""
    refs = {o.name: o.parameters[REF].string_param for o in request.outputs if REF in o.parameters}
    if not refs:
        return
    raw = response.raw_output_contents
    for i, out in enumerate(response.outputs):
        if out.name not in refs:
            continue
        ref, data = Ref.decode(refs[out.name]), raw[i]
        if len(data) > ref.size:
            raise too_small(out.name, ref.size, len(data))
        ref.write(f"output '{out.name}'", data)
        out.parameters[WRITTEN].int64_param = len(data)
        raw[i] = b""
