"""Checking a ModelInferRequest against the model's metadata before it is queued.

Everything that can be known to be wrong at the door is refused here with
INVALID_ARGUMENT and a message that names the input and what was expected,
so a bad request never reaches a batch.
"""
from __future__ import annotations

from batchline.codec import check_raw_size, decode_inputs
from batchline import contract
from batchline.errors import InvalidArgument
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import internal_pb2 as pb
from batchline.regions import REF, Ref
from batchline.sizing import row_length
from gateway.sequences import check_sequence

# Layouts kept per model at most: a client sending ever new shapes must not grow the gateway.
LAYOUTS_PER_MODEL = 256
# Request parameters whose values the checks read (gateway/sequences.py).
_SEQUENCE_PARAMETERS = ("sequence_id", "sequence_start", "sequence_end")
# Datatypes whose bytes, not just their count, are checked (BOOL's values, BYTES' length prefixes).
_CHECKED_BYTES = ("BOOL", "BYTES")


def _param_int(param: ipb.InferParameter, name: str) -> int:
    kind = param.WhichOneof("parameter_choice")
    if kind in ("int64_param", "uint64_param"):
        return getattr(param, kind)
    raise InvalidArgument(f"parameter '{name}' must be an integer, got {kind or 'nothing'}")

def request_timeout_us(request: ipb.ModelInferRequest) -> int | None:
    """The `timeout` parameter (microseconds, Triton's convention); None or 0 = not set."""
    if "timeout" not in request.parameters:
        return None
    value = _param_int(request.parameters["timeout"], "timeout")
    if value < 0:
        raise InvalidArgument(f"parameter 'timeout' must be >= 0 microseconds, got {value}")
    return value or None


def request_priority(request: ipb.ModelInferRequest, model: pb.ModelInfo) -> int:
    """Priority level, 1 highest; 0 or absent means the model's default."""
    value = 0
    if "priority" in request.parameters:
        value = _param_int(request.parameters["priority"], "priority")
    if value < 0:
        raise InvalidArgument(f"parameter 'priority' must be >= 0, got {value}")
    if value == 0:
        return max(1, model.default_priority)
    levels = model.priority_levels or contract.CLIENT_PRIORITY_LEVELS
    if value > levels:
        raise InvalidArgument(
            f"priority {value} is out of range for model '{model.name}': levels are 1 (highest) to {levels}"
        )
    return value


def check_raw_or_typed(request: ipb.ModelInferRequest, model: pb.ModelInfo) -> None:
    """InvalidArgument for a request with raw and typed contents both (Triton's words)."""
    if request.raw_input_contents:
        typed = [t.name for t in request.inputs if t.HasField("contents")]
        if typed:
            raise InvalidArgument(
                f"contents field must not be specified when using raw_input_contents for '{typed[0]}' for model "
                f"'{model.name}': send every input raw (raw_input_contents) or every input typed (contents), not both")


def validate(request: ipb.ModelInferRequest, model: pb.ModelInfo) -> int:
    """Check the request against `model`; return its batch size (rows)."""
    specs = {s.name: s for s in model.inputs}
    given = [t.name for t in request.inputs]
    missing = [n for n in specs if n not in given]
    if model.generation and len(missing) < len(specs):
        missing = []  # a generative model's prompt comes as text or as token ids: either input
    if model.generation and len(given) > 1:
        raise InvalidArgument(f"model '{model.name}' takes its prompt as one of {list(specs)}, not both")
    if missing:
        raise InvalidArgument(
            f"model '{model.name}' expects inputs {list(specs)}; missing {missing}"
        )
    unknown = [n for n in given if n not in specs]
    if unknown:
        raise InvalidArgument(f"model '{model.name}' has no input(s) {unknown}; its inputs are {list(specs)}")

    check_raw_or_typed(request, model)

    batched = model.max_batch_size > 0
    rows = None
    for tensor in request.inputs:
        spec = specs[tensor.name]
        if tensor.datatype != spec.datatype:
            raise InvalidArgument(
                f"input '{tensor.name}' of model '{model.name}' must be {spec.datatype}, "
                f"got {tensor.datatype or 'no datatype'}"
            )
        shape = list(tensor.shape)
        if len(shape) != len(spec.shape) or any(s != -1 and s != d for s, d in zip(spec.shape, shape)):
            expected = ["batch" if (batched and i == 0) else (d if d != -1 else "any")
                        for i, d in enumerate(spec.shape)]
            raise InvalidArgument(f"input '{tensor.name}' must have shape {expected}, got {shape}")
        if batched:
            n = shape[0]
            if n < 1 or n > model.max_batch_size:
                raise InvalidArgument(
                    f"input '{tensor.name}': batch size {n} is outside 1..{model.max_batch_size} "
                    f"(max_batch_size of model '{model.name}')"
                )
            if rows is not None and n != rows:
                raise InvalidArgument(f"inputs disagree on the batch size: '{tensor.name}' has {n}, others {rows}")
            rows = n

    if len(model.padded_inputs) > 1:
        # Padded inputs are padded each to the batch's longest: ids and a mask of different lengths
        # would be evened out by a neighbour's length, answered where alone they fail. Compared at
        # the axes every one of them leaves variable (features [B, T, 80] and a mask [B, T] share T).
        specs = {s.name: list(s.shape) for s in model.inputs}
        padded = {t.name: list(t.shape) for t in request.inputs if t.name in model.padded_inputs}
        axes = [i for i in range(1, min((len(specs[n]) for n in padded), default=0))
                if all(specs[n][i] == -1 for n in padded)]
        if len({tuple(shape[i] for i in axes) for shape in padded.values()}) > 1:
            raise InvalidArgument(f"model '{model.name}' pads {sorted(padded)} together: they must have one length "
                                  f"along the axes they share, got {padded}")

    for out in request.outputs:
        if out.name not in {s.name for s in model.outputs}:
            raise InvalidArgument(
                f"model '{model.name}' has no output '{out.name}'; its outputs are {[s.name for s in model.outputs]}"
            )

    # Sizes: decoding checks byte counts against shapes without copying the data; an input left in
    # shared memory (gateway/shared_memory.py), the size of the bytes it references.
    referenced = [t for t in request.inputs if REF in t.parameters]
    decode_inputs(request, dict.fromkeys(t.name for t in referenced))
    for tensor in referenced:
        check_raw_size(tensor.name, tensor.datatype, list(tensor.shape),
                       Ref.decode(tensor.parameters[REF].string_param).size)
    rows = rows if rows is not None else 1
    check_sequence(request, model, rows)
    return rows


def checked(request: ipb.ModelInferRequest, model: pb.ModelInfo) -> tuple[int, int]:
    """(rows, length) of a valid request (`validate`, batchline.sizing.row_length); InvalidArgument
    naming what is wrong with an invalid one."""
    return validate(request, model), row_length(model, {t.name: t.shape for t in request.inputs})


class CheckedLayouts:
    """The layouts of requests already found valid, per model, with their rows and length.

    Checking a request reads every input in Python, about a fifth of the CPU a refusal costs the
    gateway; under overload most requests are refused right after it, on the cores the model needs. A
    request laid out like one found valid for the same model (the same inputs in the same order
    with the same datatypes, shapes and byte counts, the same outputs asked for) passes the same
    checks, so it is not checked again. Only layouts whose validity the layout alone decides are
    kept: every input raw, none with parameters of its own (a shared-memory reference is checked
    against its region), no sequence parameters (a sequence model's requests all carry them), and
    a model that takes no BOOL or BYTES input (their bytes are checked). A model read again from
    the registry starts with no layouts.
    """

    def __init__(self, limit: int = LAYOUTS_PER_MODEL) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self.limit = limit
        # Per model name and version (at most `limit` of them too): the ModelInfo its layouts were
        # checked against, and those layouts (None: its inputs' bytes are checked, nothing is kept).
        self._models: dict[tuple[str, str], tuple[pb.ModelInfo, dict[tuple, tuple[int, int]] | None]] = {}

    def __len__(self) -> int:
        """Layouts kept, over every model."""
        return sum(len(layouts) for _, layouts in self._models.values() if layouts is not None)

    def facts(self, request: ipb.ModelInferRequest, model: pb.ModelInfo) -> tuple[int, int]:
        """What `checked` answers, from the layouts kept when the request's is among them."""
        layouts = self._layouts(model)
        layout = None if layouts is None else _layout(request)
        if layouts is None or layout is None:
            return checked(request, model)
        known = layouts.get(layout)
        if known is None:
            known = checked(request, model)  # an invalid request raises here: its layout is not kept
            if len(layouts) >= self.limit:
                layouts.clear()
            layouts[layout] = known
        return known

    def _layouts(self, model: pb.ModelInfo) -> dict[tuple, tuple[int, int]] | None:
        key = (model.name, model.version)
        entry = self._models.get(key)
        if entry is None or entry[0] is not model:
            if len(self._models) >= self.limit:
                self._models.clear()  # models that come and go: start over rather than grow
            kept = not any(s.datatype in _CHECKED_BYTES for s in model.inputs)
            entry = self._models[key] = (model, {} if kept else None)
        return entry[1]


def _layout(request: ipb.ModelInferRequest) -> tuple | None:
    """What a request's validity depends on, when that is its layout alone (None otherwise)."""
    raw = request.raw_input_contents
    if not raw or len(raw) != len(request.inputs):
        return None
    parameters = request.parameters
    if any(name in parameters for name in _SEQUENCE_PARAMETERS):
        return None
    layout: list = []
    for tensor, data in zip(request.inputs, raw):
        if tensor.parameters or tensor.HasField("contents"):
            return None
        layout.append((tensor.name, tensor.datatype, tuple(tensor.shape), len(data)))
    layout.append(tuple(out.name for out in request.outputs))
    return tuple(layout)
