"""A model's config.toml: every key, its default, its check and its documentation, in one place.

`ModelConfig` is what `executor.repository.read_config` validates a config.toml
against, and what scripts/gen_docs.py renders as the config.toml table of
docs/reference/settings.md: a key added here is documented there (a test
fails until the page is regenerated).
"""
from __future__ import annotations

import math
import pathlib
import tomllib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from batchline.contract.keys import CLIENT_PRIORITY_LEVELS
from executor.sequence_config import SequenceBatchingConfig


class ConfigError(ValueError):
    """A config.toml that cannot be served; the message names the file and the key."""


def _problem(message: str) -> PydanticCustomError:
    # A custom error type keeps the message as written (ValueError's would gain a "Value error, " prefix).
    return PydanticCustomError("model_config", message)


class TokenizerConfig(BaseModel):
    """`[tokenizer]`: the model takes text, tokenized by the gateway into its token-id inputs."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="Directory holding tokenizer.json (Hugging Face `tokenizers`), "
                                  "relative to the model's.")
    max_length: int = Field(512, ge=1, description="Most tokens of one text, special tokens included.")
    truncate: bool = Field(True, description="Cut longer texts to max_length (false: refuse them, INVALID_ARGUMENT).")
    input: str = Field("text", description="Name of the BYTES input the model exposes for text.")
    ids_input: str = Field("input_ids", description="The graph's input that takes the token ids.")
    mask_input: str = Field("attention_mask", description="The graph's input that takes the attention mask.")
    type_ids_input: str = Field("", description="The graph's token-type input, if it has one (fed zeros).")


class OptimizeConfig(BaseModel):
    """`[optimize]`: how `batchline optimize` judges this model's variants against FP32."""

    model_config = ConfigDict(extra="forbid")

    outputs: dict[str, Literal["embedding", "classes", "values"]] = Field(
        default_factory=dict,
        description="Output name = how the accuracy gate judges it: `embedding` (cosines and nearest neighbours), "
        "`classes` (argmax kept, values close) or `values` (values close). Outputs not named here are judged by "
        "their name and values (docs/guides/optimize.md#the-gate).")


class GenerationConfig(BaseModel):
    """`[generation]`: the model is a decoder that writes text a token at a time, with a key/value cache."""

    model_config = ConfigDict(extra="forbid")

    cache_inputs: list[str] = Field(
        description="The graph's past key/value inputs, [batch, heads, past, head_dim] each.")
    cache_outputs: list[str] = Field(
        description="The outputs that return each of cache_inputs with the new positions appended, in the same "
        "order: [batch, heads, past + sequence, head_dim].")
    eos_token_ids: list[int] = Field(
        default_factory=list, description="Token ids that end a sequence (unless a request sets ignore_eos).")
    max_context: int = Field(description="Most tokens of one sequence, prompt and output together.")
    tokenizer: str = Field(description="Directory holding tokenizer.json (Hugging Face `tokenizers`), relative to "
                           "the model's.")
    ids_input: str = Field("input_ids", description="The graph's input that takes the new token ids [batch, sequence].")
    positions_input: str = Field("position_ids", description="The graph's input that takes their positions.")
    mask_input: str = Field("attention_mask", description="The graph's input that takes the mask over cached and new "
                            "positions [batch, past + sequence].")
    cache_in_place: bool = Field(
        False, description="The graph updates its cache in place: each cache input is a buffer [batch, heads, "
        "max_context, head_dim] holding a row's positions from the first, the matching output is that same buffer "
        "with the new positions written in (ONNX Runtime's GroupQueryAttention with a shared past and present), "
        "and the mask holds each row's positions as ones from the first. The engine binds both to its slots, so "
        "a step copies no cache (docs/design/generation.md#the-cache-in-place).")
    logits_output: str = Field("logits", description="The output of next-token logits [batch, sequence, vocabulary].")
    prefill_chunk: int = Field(
        256, description="Most prompt tokens prefilled in one step: a longer prompt is prefilled over several, "
        "between the decode steps of the running sequences.")
    ttft_ms: float = Field(
        0.0, ge=0, description="Time to first token a request must meet unless it sets `ttft_ms` itself (0 = none): "
        "admission refuses at once what no executor is predicted to meet (docs/design/generation.md#admission).")
    tpot_ms: float = Field(
        0.0, ge=0, description="Time per output token a request must meet unless it sets `tpot_ms` itself (0 = none).")

    @field_validator("cache_inputs", "cache_outputs")
    @classmethod
    def _cache_names(cls, value: list[str], info: Any) -> list[str]:
        if not value:
            raise _problem(f"generation.{info.field_name} must name at least one tensor")
        twice = sorted({name for name in value if value.count(name) > 1})
        if twice:
            raise _problem(f"generation.{info.field_name} names {twice} more than once")
        return value

    @field_validator("eos_token_ids")
    @classmethod
    def _eos(cls, value: list[int]) -> list[int]:
        bad = [v for v in value if v < 0]
        if bad:
            raise _problem(f"generation.eos_token_ids must be token ids >= 0 (got {bad})")
        return value

    @field_validator("max_context")
    @classmethod
    def _context(cls, value: int) -> int:
        if value < 2:
            raise _problem(f"generation.max_context must be >= 2: a prompt token and one to write (got {value})")
        return value

    @field_validator("prefill_chunk")
    @classmethod
    def _chunk(cls, value: int) -> int:
        if value < 1:
            raise _problem(f"generation.prefill_chunk must be >= 1 (got {value})")
        return value

    @model_validator(mode="after")
    def _pairs(self) -> "GenerationConfig":
        if len(self.cache_inputs) != len(self.cache_outputs):
            raise _problem(f"generation.cache_inputs has {len(self.cache_inputs)} names and generation.cache_outputs "
                           f"{len(self.cache_outputs)}: they pair in order, one output per input")
        return self


class ModelConfig(BaseModel):
    """The keys of ``<repo>/<model>/config.toml``; every one is optional."""

    model_config = ConfigDict(extra="forbid")

    max_batch_size: int = Field(
        8, description="Most rows in one batch, and in one request. 0 = the model has no batch dimension: "
        "every request runs alone.",
    )
    max_queue_delay_ms: float = Field(
        2.0, description="Longest the oldest queued request waits for company before its batch is sent "
        "(the deadline policy waits only while another arrival is expected within it).",
    )
    default_timeout_ms: float = Field(
        10_000.0,
        description="Latency budget of a request that sets neither a gRPC deadline nor a `timeout` parameter.",
    )
    preferred_batch_sizes: list[int] = Field(
        default_factory=list,
        description="Batch sizes sent as soon as they are queued; with more queued but short of a full batch, "
        "the largest of them that the queue's head makes exactly.",
    )
    default_priority: int = Field(
        1, description="Priority level of a request whose `priority` parameter is absent or 0 (1 is the highest).",
    )
    priority_levels: int = Field(
        0, description="Priority levels a request may ask for, 1 to this (at most 450); 0 = 1 to 450. The 450 "
        "levels below are where a tenant over its fair share queues (docs/guides/security.md).",
    )
    max_queue_size: int = Field(
        0, description="Queued requests beyond which new ones are refused with RESOURCE_EXHAUSTED; 0 = no cap.",
    )
    instance_count: int = Field(
        1, description="Batches of this model an executor runs at once (Triton's instance_group count), each a lane "
        "of its own on cpu_cores / instance_count intra-op threads unless intra_op_threads says otherwise.",
    )
    intra_op_threads: int = Field(
        0, ge=0, description="ONNX Runtime intra-op threads of each of this model's runs, over the executor's "
        "intra_op_threads (0 = the executor's; `batchline tune` writes it).",
    )
    padding: dict[str, Any] = Field(
        default_factory=dict,
        description="Input name = pad value: inputs whose non-batch dims may be padded so that requests of "
        "different lengths share a batch. Only for models that mask the padding and whose outputs do not "
        "depend on the padded length (outputs are not un-padded).",
    )
    providers: list[str] | None = Field(
        None, description="ONNX Runtime execution providers for this model, in order of preference, instead of "
        "the executor's `--providers`.",
    )
    provider_options: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Options per execution provider, a table each: `[provider_options.TensorrtExecutionProvider]` "
        "with `trt_fp16_enable = true`.",
    )

    input_format: dict[str, Literal["FORMAT_NONE", "FORMAT_NHWC", "FORMAT_NCHW"]] = Field(
        default_factory=dict,
        description="Input name = its layout as Triton names it (`FORMAT_NCHW`, `FORMAT_NHWC`, `FORMAT_NONE`), "
        "reported in ModelConfig: image clients (Triton's image_client) read it to lay out pixels.",
    )
    label_filename: dict[str, str] = Field(
        default_factory=dict,
        description="Output name = a file of class labels, one a line, relative to the model's directory: a "
        "request may ask that output for its top N classes (the `classification` parameter), answered as "
        "BYTES `score:index:label`.",
    )

    tokenizer: TokenizerConfig | None = Field(
        None, description="A `[tokenizer]` table: the model also takes text (a BYTES input, `text` by default), which "
        "the gateway tokenizes into its token-id inputs; those stay available to clients that tokenize themselves. "
        "Keys: `path` (required: the directory of tokenizer.json), `max_length` (512), `truncate` (true; false "
        "refuses longer texts), `input`, `ids_input`, `mask_input`, `type_ids_input`.",
    )
    generation: GenerationConfig | None = Field(
        None,
        description="A `[generation]` table: the model is a decoder with a key/value cache, run by the generation "
        "engine (docs/design/generation.md) rather than in batches of whole requests. Keys: `cache_inputs` and "
        "`cache_outputs` (required, paired in order), `eos_token_ids`, `max_context` (required), `tokenizer` "
        "(required: the directory of tokenizer.json), `ids_input`, `positions_input`, `mask_input`, `logits_output`, "
        "`cache_in_place` (false: the engine gathers the cache into each run), `prefill_chunk` (256), `ttft_ms` and "
        "`tpot_ms` (0 = none: the time to first token and per output token a request must meet unless it sets its "
        "own).",
    )
    optimize: OptimizeConfig | None = Field(
        None, description="An `[optimize]` table for `batchline optimize` (the executors ignore it): "
        "`outputs = { NAME = \"embedding\" | \"classes\" | \"values\" }` says how its accuracy gate judges each output "
        "(default: by the output's name and values).",
    )
    sequence_batching: SequenceBatchingConfig | None = Field(
        None, description="A `[sequence_batching]` table: the model is stateful (Triton's sequence batcher). Keys: "
        "`max_sequence_idle_microseconds` (1000000), `strategy` (`oldest` | `direct`), `control = { INPUT = "
        "\"start\" | \"end\" | \"ready\" | \"corrid\" }`, `state = { STATE_INPUT = \"STATE_OUTPUT\" }` "
        "(docs/guides/model-repository.md#sequence-models).",
    )
    decoupled: bool = Field(
        False, description="Answer each request with one response per row of its outputs' first dim (zero rows: "
        "no response), on ModelStreamInfer only; needs max_batch_size = 0 "
        "(docs/guides/model-repository.md#decoupled-models).",
    )
    version_policy: dict[str, Any] = Field(
        default_factory=lambda: {"latest": 1},
        description="Which of the model's version directories are served (Triton's version_policy): "
        "`{ latest = N }` the N highest numbers, `{ all = true }` every one, `{ specific = [1, 3] }` those. "
        "When the policy stops selecting a served version (a newer one arrived), "
        "it finishes what is queued for it and is released.",
    )

    @field_validator("version_policy")
    @classmethod
    def _version_policy(cls, value: dict[str, Any]) -> dict[str, Any]:
        usage = "version_policy must be one of { latest = N }, { all = true }, { specific = [N, ...] }"
        if len(value) != 1:
            raise _problem(f"{usage} (got {value!r})")
        (kind, arg), = value.items()
        if kind == "latest" and not (isinstance(arg, int) and not isinstance(arg, bool) and arg >= 1):
            raise _problem(f"version_policy.latest must be an integer >= 1 (got {arg!r})")
        if kind == "all" and arg is not True:
            raise _problem(f"version_policy.all must be true (got {arg!r})")
        if kind == "specific" and not (isinstance(arg, list) and arg
                                       and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in arg)):
            raise _problem(f"version_policy.specific must be a non-empty list of version numbers (got {arg!r})")
        if kind not in ("latest", "all", "specific"):
            raise _problem(f"{usage} (got {value!r})")
        return value

    @model_validator(mode="after")
    def _generation_alone(self) -> "ModelConfig":
        # The generation engine tokenizes with [generation].tokenizer and never pads a request.
        if self.generation is not None:
            if self.tokenizer is not None:
                raise _problem("[tokenizer] is for models that take text in one request; a generative model names its "
                               "tokenizer in [generation] (tokenizer = \"DIR\")")
            if self.padding:
                raise _problem("[padding] does not apply to a generative model: the generation engine masks "
                               "sequences of different lengths itself")
            if self.max_batch_size < 1:
                raise _problem("max_batch_size of a generative model must be >= 1: it is the most sequences in one "
                               "decode step")
            if self.sequence_batching is not None:
                raise _problem("[sequence_batching] does not apply to a generative model: the generation engine keeps "
                               "each sequence's state (its key/value cache) itself")
        return self

    @field_validator("max_batch_size")
    @classmethod
    def _batch_size(cls, value: int) -> int:
        if not 0 <= value < 2**32:  # it travels as a uint32 (ModelInfo)
            raise _problem(f"max_batch_size must be from 0 to {2**32 - 1} (got {value})")
        return value

    @field_validator("priority_levels", "max_queue_size", "default_priority")
    @classmethod
    def _counts(cls, value: int, info: Any) -> int:
        low = 1 if info.field_name == "default_priority" else 0
        if not low <= value < 2**32:  # each travels as a uint32 (ModelInfo)
            raise _problem(f"{info.field_name} must be from {low} to {2**32 - 1} (got {value})")
        return value

    @field_validator("preferred_batch_sizes")
    @classmethod
    def _preferred(cls, value: list[int]) -> list[int]:
        bad = [v for v in value if not 1 <= v < 2**32]
        if bad:
            raise _problem(f"preferred_batch_sizes must be batch sizes >= 1 (got {bad})")
        return value

    @field_validator("priority_levels")
    @classmethod
    def _client_levels(cls, value: int) -> int:
        if value > CLIENT_PRIORITY_LEVELS:
            raise _problem(f"priority_levels must be at most {CLIENT_PRIORITY_LEVELS} (got {value}): the levels "
                           "below are where a tenant over its fair share queues")
        return value

    @model_validator(mode="after")
    def _priority_within_levels(self) -> "ModelConfig":
        if not self.priority_levels and self.default_priority > CLIENT_PRIORITY_LEVELS:
            raise _problem(f"default_priority {self.default_priority} is past the {CLIENT_PRIORITY_LEVELS} levels "
                           "clients may use (those below are where a tenant over its fair share queues)")
        if self.priority_levels and self.default_priority > self.priority_levels:
            raise _problem(f"default_priority {self.default_priority} is past priority_levels {self.priority_levels} "
                           "(levels are 1, the highest, to priority_levels)")
        return self

    @field_validator("instance_count", mode="before")
    @classmethod
    def _instances(cls, value: Any) -> Any:
        # Checked before coercion: 2.0 or "2" is a mistake to point out, not to round.
        if not isinstance(value, int) or value < 1:
            raise _problem("instance_count must be an integer >= 1")
        return value

    @field_validator("default_timeout_ms")
    @classmethod
    def _default_timeout(cls, value: float) -> float:
        if not (value > 0 and math.isfinite(value)):
            # Every request that names no budget would be refused as already past its deadline.
            raise _problem("default_timeout_ms must be a finite number > 0 (it is the budget of requests that name "
                           "none)")
        return value

    @field_validator("max_queue_delay_ms")
    @classmethod
    def _queue_delay(cls, value: float) -> float:
        if not (value >= 0 and math.isfinite(value)):
            raise _problem("max_queue_delay_ms must be a finite number >= 0")
        return value


KEYS = sorted(ModelConfig.model_fields)


def select_versions(policy: dict[str, Any], available: list[str]) -> list[str]:
    """The version directories (numeric names) that `policy` serves, ascending."""
    # ASCII digits only: str.isdigit() takes '²', which int() does not.
    numbered = sorted((v for v in available if v.isascii() and v.isdigit()), key=int)
    (kind, arg), = policy.items()
    if kind == "latest":
        return numbered[-arg:]
    if kind == "specific":
        return [v for v in numbered if int(v) in set(arg)]
    return numbered


def declares_generation(model_dir: pathlib.Path) -> bool:
    """Whether the model's config.toml has a `[generation]` table (false when it cannot be read: reading it
    for serving reports why)."""
    try:
        with (model_dir / "config.toml").open("rb") as f:
            return "generation" in tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError):
        return False


def _message(error: dict[str, Any]) -> str:
    if error["type"] == "model_config":
        return error["msg"]
    key = ".".join(str(part) for part in error["loc"])
    return f"{key}: {error['msg']} (got {error['input']!r})"


def read_model_config(path: pathlib.Path) -> ModelConfig:
    """The config at `path` (every default when the file does not exist); ConfigError names what is wrong."""
    loaded: dict[str, Any] = {}
    if path.exists():
        with path.open("rb") as f:
            try:
                loaded = tomllib.load(f)
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"{path}: not valid TOML ({exc})") from None
    return _checked(loaded, str(path))


def _checked(loaded: dict[str, Any], where: str) -> ModelConfig:
    unknown = set(loaded) - set(KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}; known: {KEYS}")
    try:
        return ModelConfig(**loaded)
    except ValidationError as exc:
        raise ConfigError(f"{where}: " + "; ".join(_message(e) for e in exc.errors())) from None


def check_model_config(loaded: dict[str, Any], where: str) -> dict[str, Any]:
    """config.toml's keys given as a dict (a load call's override), checked; every key, defaults filled in."""
    return _checked(loaded, where).model_dump()
