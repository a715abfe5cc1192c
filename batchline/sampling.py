"""A generative request's sampling parameters: their values checked, and read from a request's
parameters, by the gateway at the door (a bad one is refused before it is queued) and by the
executor that runs it (executor/generation_sampling.py draws the tokens by them)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from batchline.errors import InvalidArgument
from batchline.protocol import inference_pb2 as ipb


class SamplingError(ValueError):
    """A sampling parameter out of range; the message names it and its range."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: every token
    seed: int | None = None  # None: one drawn when the sequence is added
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be an integer >= 1 (got {self.max_tokens!r})")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise SamplingError(f"temperature must be a number >= 0; 0 chooses greedily (got {self.temperature!r})")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise SamplingError(f"top_p must be in (0, 1] (got {self.top_p!r})")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingError(f"top_k must be an integer >= 0; 0 keeps every token (got {self.top_k!r})")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise SamplingError(f"seed must be an integer >= 0 (got {self.seed!r})")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if not all(isinstance(s, str) and s for s in self.stop):
            raise SamplingError(f"stop must be non-empty strings (got {self.stop!r})")
        object.__setattr__(self, "stop", tuple(self.stop))


# Request parameter -> (SamplingParams field, the InferParameter kinds it may come as).
_INTS = ("int64_param", "uint64_param")
PARAMETERS = {
    "max_tokens": _INTS,
    # tritonclient sends no floats (its parameters are bool, int and str): a number as text is taken too.
    "temperature": ("double_param", *_INTS, "string_param"),
    "top_p": ("double_param", *_INTS, "string_param"),
    "top_k": _INTS,
    "seed": _INTS,
    "stop": ("string_param",),
    "ignore_eos": ("bool_param",),
}


def sampling_params(request: ipb.ModelInferRequest, request_id: str) -> SamplingParams:
    """The request's sampling parameters; InvalidArgument naming a bad one. A request without a seed
    gets one from its request id, so that an executor that continues it draws as the first would."""
    given: dict = {}
    for name, kinds in PARAMETERS.items():
        if name not in request.parameters:
            continue
        param = request.parameters[name]
        kind = param.WhichOneof("parameter_choice")
        if kind not in kinds:
            raise InvalidArgument(f"parameter '{name}' must be a {kinds[0].removesuffix('_param')}, "
                                  f"got {(kind or 'nothing').removesuffix('_param')}")
        value = getattr(param, kind)
        if name == "stop":
            value = _stop_strings(value)
        elif kind == "string_param":
            try:
                value = float(value)
            except ValueError:
                raise InvalidArgument(f"parameter '{name}' must be a number, got {value!r}") from None
        given[name] = value
    given.setdefault("seed", int(request_id[:15], 16) if request_id else 0)
    try:
        return SamplingParams(**given)
    except SamplingError as exc:
        raise InvalidArgument(str(exc)) from None


def _stop_strings(value: str) -> tuple[str, ...]:
    """`stop`: one string, or a JSON array of strings."""
    if not value.startswith("["):
        return (value,)
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = None
    if not isinstance(parsed, list):
        raise InvalidArgument(f"parameter 'stop' starts with '[' but is not a JSON array of strings: {value!r}")
    return tuple(parsed)
