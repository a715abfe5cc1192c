"""A decoupled model's answers: one response per row of its outputs' first dim, each its own
Reply (partial, numbered), then a final Reply that carries no response, only the end (or the
request's error). The responses go to the gateway ahead of the batch's own write
(docs/design/decoupled.md)."""
from __future__ import annotations

from batchline.codec import encode_array
from batchline.errors import Internal, InvalidArgument, status_value
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import internal_pb2 as pb
from executor.repository import LoadedModel
from executor.running import Member


def replies(model: LoadedModel, m: Member) -> tuple[list[pb.Reply], pb.Reply]:
    """The member's responses, and the final Reply that ends them."""
    request_id = m.entry.request_id
    if m.error is not None or m.outputs is None:
        error = m.error or Internal("the model produced no output for this request")
        return [], pb.Reply(request_id=request_id, code=status_value(error), message=str(error))
    wanted = [o.name for o in m.request.outputs] or [o.name for o in model.info.outputs]
    scalars = [name for name in wanted if not m.outputs[name].ndim]
    if scalars:
        error = InvalidArgument(f"decoupled model '{model.name}' gave the scalar output(s) {scalars}: each row of a "
                                "decoupled model's outputs' first dim is one response, so a scalar is none")
        return [], pb.Reply(request_id=request_id, code=status_value(error), message=str(error))
    counts = {name: m.outputs[name].shape[0] for name in wanted}
    if len(set(counts.values())) > 1:
        error = InvalidArgument(f"decoupled model '{model.name}' gave outputs with different numbers of responses "
                                f"(rows of their first dim): {counts}")
        return [], pb.Reply(request_id=request_id, code=status_value(error), message=str(error))
    n = next(iter(counts.values()), 0)
    partial = []
    for i in range(n):
        response = ipb.ModelInferResponse(model_name=model.name, model_version=model.version, id=m.request.id)
        for name in wanted:
            datatype, shape, raw = encode_array(m.outputs[name][i])
            response.outputs.add(name=name, datatype=datatype, shape=shape)
            response.raw_output_contents.append(raw)
        partial.append(pb.Reply(request_id=request_id, code=0, response=response, partial=True, index=i))
    return partial, pb.Reply(request_id=request_id, code=0, index=n)
