"""A request's sequence flags (Triton's `sequence_id`, `sequence_start`, `sequence_end`
parameters), read the same way by the gateway, which checks them, and the executor, which runs
the step. A sequence id is an integer or a string; 0 and "" mean none. An integer id is Triton's
correlation id, an unsigned 64-bit number: an INT64 `sequence_id` of -1 names the same sequence as
a UINT64 one of 2^64 - 1, as Triton reads it."""
from __future__ import annotations

from dataclasses import dataclass

from batchline.errors import InvalidArgument
from batchline.protocol import inference_pb2 as ipb


@dataclass(frozen=True, slots=True)
class SequenceFlags:
    id: int | str          # as the client gave it: 0 or "" when it gave none
    start: bool = False
    end: bool = False

    @property
    def given(self) -> bool:
        return self.id not in (0, "")

    @property
    def key(self) -> str:
        """The id as a Redis key part: 7 and "7" are different sequences, as in Triton."""
        return f"i:{self.id % 2**64}" if isinstance(self.id, int) else f"s:{self.id}"

    def corrid(self, datatype: str) -> int | str:
        """The id as a CORRID input of `datatype` takes it: the correlation id's 64 bits read as the
        type reads them (2^64 - 1 is -1 to an INT64 input); other types take the id as given."""
        if isinstance(self.id, int):
            if datatype == "UINT64":
                return self.id % 2**64
            if datatype == "INT64":
                return (self.id + 2**63) % 2**64 - 2**63
        return self.id


def sequence_key(flags: SequenceFlags, tenant: str) -> str:
    """The sequence's key: its id within its tenant's (a tenant's token), so that another tenant
    sending the same id can neither read, continue nor end it."""
    return f"t{len(tenant)}:{tenant}:{flags.key}" if tenant else flags.key


def _flag(request: ipb.ModelInferRequest, name: str) -> bool:
    if name not in request.parameters:
        return False
    param = request.parameters[name]
    kind = param.WhichOneof("parameter_choice")
    if kind != "bool_param":
        raise InvalidArgument(f"parameter '{name}' must be a bool, got {kind or 'nothing'}")
    return param.bool_param


def sequence_flags(request: ipb.ModelInferRequest) -> SequenceFlags:
    """The request's sequence flags; InvalidArgument when one has the wrong type."""
    seq_id: int | str = 0
    if "sequence_id" in request.parameters:
        param = request.parameters["sequence_id"]
        kind = param.WhichOneof("parameter_choice")
        if kind in ("int64_param", "uint64_param"):
            seq_id = getattr(param, kind)
        elif kind == "string_param":
            seq_id = param.string_param
        else:
            raise InvalidArgument(f"parameter 'sequence_id' must be an integer or a string, got {kind or 'nothing'}")
    return SequenceFlags(seq_id, _flag(request, "sequence_start"), _flag(request, "sequence_end"))
