"""A generative model as the generation engine runs it: its session, its graph's names and cache shapes, its tokenizer.

`load_decoder` checks config.toml's `[generation]` against the graph, so that a name or a cache shape
that does not fit is refused at load, with the file and the key, rather than at the first step.
"""
from __future__ import annotations

import logging
import pathlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

from batchline.codec import DATATYPES, onnx_datatype
from executor.model_config import ConfigError, GenerationConfig, read_model_config
from executor.repository import RepositoryError
from executor.sessions import choose_providers, create_session, intra_op_threads_for

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheTensor:
    """One past input and the present output that returns it grown: [batch, heads, positions, head_dim]."""

    past: str
    present: str
    heads: int
    head_dim: int
    dtype: np.dtype


def slot_bytes(tensors: list[CacheTensor], max_context: int) -> int:
    """Bytes of the key/value cache of one sequence at `max_context` positions."""
    return sum(t.heads * t.head_dim * t.dtype.itemsize for t in tensors) * max_context


@dataclass
class Decoder:
    """A loaded generative model."""

    name: str
    session: ort.InferenceSession
    config: GenerationConfig
    cache: list[CacheTensor]
    tokenizer: Tokenizer
    max_batch_size: int  # most sequences in one decode step

    @property
    def slot_bytes(self) -> int:
        """Bytes of the key/value cache of one sequence at max_context."""
        return slot_bytes(self.cache, self.config.max_context)

    @property
    def cache_device(self) -> tuple[str, int]:
        """Where the cache lives: on the GPU the session runs on when the graph updates it in place (it is
        bound there and never leaves), else in host memory (gathered into each run's feeds)."""
        provider = self.session.get_providers()[0]
        if self.config.cache_in_place and provider == "CUDAExecutionProvider":
            options = self.session.get_provider_options().get(provider, {})
            return "cuda", int(options.get("device_id", 0))
        return "cpu", 0


def _cache_tensors(where: str, gen: GenerationConfig, session: ort.InferenceSession) -> list[CacheTensor]:
    inputs = {a.name: a for a in session.get_inputs()}
    outputs = {a.name: a for a in session.get_outputs()}
    plain_inputs = [gen.ids_input, gen.positions_input, gen.mask_input]
    for key, name in zip(("ids_input", "positions_input", "mask_input"), plain_inputs):
        if name not in inputs:
            raise RepositoryError(f"{where}: {key} {name!r} is not an input of the graph; "
                                  f"its inputs are {sorted(inputs)}")
    if gen.logits_output not in outputs:
        raise RepositoryError(f"{where}: logits_output {gen.logits_output!r} is not an output of the graph; "
                              f"its outputs are {sorted(outputs)}")
    unfed = set(inputs) - set(plain_inputs) - set(gen.cache_inputs)
    if unfed:
        raise RepositoryError(f"{where}: the graph's inputs {sorted(unfed)} are neither cache_inputs nor the ids, "
                              "positions or mask inputs: the engine would not know what to feed them")
    tensors = []
    for past, present in zip(gen.cache_inputs, gen.cache_outputs):
        if past not in inputs:
            raise RepositoryError(f"{where}: cache_inputs names {past!r}, which is not an input of the graph")
        if present not in outputs:
            raise RepositoryError(f"{where}: cache_outputs names {present!r}, which is not an output of the graph")
        shape = inputs[past].shape
        if len(shape) != 4 or not all(isinstance(d, int) for d in shape[1::2]):
            raise RepositoryError(f"{where}: cache input {past!r} has shape {shape}; the engine needs "
                                  "[batch, heads, positions, head_dim] with heads and head_dim fixed")
        if gen.cache_in_place and isinstance(shape[2], int) and shape[2] != gen.max_context:
            raise RepositoryError(f"{where}: cache_in_place binds buffers of max_context {gen.max_context} "
                                  f"positions, but cache input {past!r} has {shape[2]}")
        datatype = onnx_datatype(inputs[past].type)
        if onnx_datatype(outputs[present].type) != datatype:
            raise RepositoryError(f"{where}: cache output {present!r} is {onnx_datatype(outputs[present].type)}, its "
                                  f"input {past!r} {datatype}")
        tensors.append(CacheTensor(past, present, shape[1], shape[3], np.dtype(DATATYPES[datatype])))
    return tensors


def load_decoder(model_dir: pathlib.Path, version: str = "1", providers: list[str] | None = None,
                 intra_op_threads: int = 0, options: dict[str, Any] | None = None,
                 allow_spinning: bool = False, cpu_cores: int = 0) -> Decoder:
    """The generative model in `model_dir` (its config.toml must have a `[generation]` table).

    Its runs take the config's intra_op_threads, else `intra_op_threads` (the executor's), else
    `cpu_cores` (the executor's share of the host; 0: ONNX Runtime's default), as a batch model's
    one instance does (executor.sessions.intra_op_threads_for).

    `allow_spinning` as the executor's setting says: a decode step is hundreds of small operators,
    and two threads that spin between them cost a third more CPU per token than two that sleep
    (GPT-2 small's shape, 32 sequences, 2 cores: 68 against 89 tokens per CPU-second) and are
    slower too (132 against 145 tokens/s)."""
    where = f"{model_dir}/config.toml [generation]"
    try:
        config = read_model_config(model_dir / "config.toml")
    except ConfigError as exc:
        raise RepositoryError(str(exc)) from None
    gen = config.generation
    if gen is None:
        raise RepositoryError(f"{model_dir}/config.toml has no [generation] table: it is not a generative model")
    path = model_dir / gen.tokenizer / "tokenizer.json"
    try:
        tokenizer = Tokenizer.from_str(path.read_text())
    except OSError as exc:
        raise RepositoryError(f"{where}: cannot read {path} ({exc.strerror})") from None
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises plain Exceptions
        raise RepositoryError(f"{where}: {path} is not a tokenizer ({exc})") from None
    vocabulary = tokenizer.get_vocab_size()
    too_big = [t for t in gen.eos_token_ids if t >= vocabulary]
    if too_big:
        raise RepositoryError(f"{where}: eos_token_ids {too_big} are not in the tokenizer's {vocabulary} ids")
    chosen = choose_providers(config.providers or providers or ["CPUExecutionProvider"],
                              options or config.provider_options, ort.get_available_providers())
    threads = intra_op_threads_for(1, config.intra_op_threads or intra_op_threads, cpu_cores)
    session = create_session(model_dir / version / "model.onnx", chosen, threads, allow_spinning,
                             label=f"{model_dir.name} version {version}")
    logits = {a.name: a for a in session.get_outputs()}.get(gen.logits_output)
    width = logits.shape[-1] if logits is not None and logits.shape else None
    if isinstance(width, int) and width < vocabulary:
        # A prompt id the tokenizer knows but the graph does not would fail the run of every
        # sequence in its step: refused at load instead.
        raise RepositoryError(f"{where}: the tokenizer has {vocabulary} ids but the graph's logits "
                              f"{gen.logits_output!r} have {width}: they must be the same model's")
    cache = _cache_tensors(where, gen, session)
    warning = slow_on_gpu(session.get_providers()[0], gen.cache_in_place, cache)
    if warning:
        log.warning("%s version %s: %s", model_dir.name, version, warning)
    return Decoder(model_dir.name, session, gen, cache, tokenizer, config.max_batch_size)


def slow_on_gpu(provider: str, cache_in_place: bool, cache: list[CacheTensor]) -> str | None:
    """Why a decoder on the GPU will run far slower than it should, if it will: its cache is float32 and
    updated in place, and ONNX Runtime's CUDA provider has GroupQueryAttention (the in-place graphs'
    attention) in float16 and bfloat16 only, so each layer's attention runs on the CPU."""
    if provider != "CUDAExecutionProvider" or not cache_in_place or all(t.dtype != np.float32 for t in cache):
        return None
    return ("its cache is float32 and updated in place: ONNX Runtime's CUDA provider has GroupQueryAttention in "
            "float16 and bfloat16 only, so attention runs on the CPU, each layer's cache copied there and back "
            "(GPT-2 small's shape on an H100: 64 tokens/s against 4,390 in float16); export the graph in float16")
