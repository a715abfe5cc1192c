"""Generative models on an executor: loaded into a generation engine each, and described to the mesh.

A generative model is served as a decoupled model of two inputs, of which a request sends one,
and two outputs (docs/design/generation.md#through-the-mesh): the prompt as text in `text_input`
(BYTES [1]) or as token ids in `input_ids` (INT64 [n]); each response one or more output tokens,
as `text_output` (BYTES [1], the text they add) and `token_ids` (INT64 [k]). Its ModelInfo has no
batch dimension, so that the scheduler sends each request alone: a request joins the engine's
running batch at its next step, not with the requests it queued beside.
"""
from __future__ import annotations

import asyncio
import logging
import pathlib
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from batchline import metrics
from batchline.protocol import internal_pb2 as pb
from executor.generation_engine import GenerationEngine, StepReport
from executor.generation_loop import GenerationLoop
from executor.generation_model import load_decoder
from executor.generation_writes import StreamWrites
from executor.model_config import ModelConfig, declares_generation, read_model_config
from executor.repository import RepositoryError, scan_model
from executor.settings import ExecutorSettings

log = logging.getLogger(__name__)

TEXT_INPUT = "text_input"
IDS_INPUT = "input_ids"
TEXT_OUTPUT = "text_output"
TOKENS_OUTPUT = "token_ids"


@dataclass
class GenerationModel:
    """A generative model version as an executor serves it: its engine's loop and its description.

    `active` counts its batches running here (one request each); `ending`, once set, ends each of their sequences at its
    next token, UNAVAILABLE with that message (a version released while it still generates)."""

    info: pb.ModelInfo
    loop: GenerationLoop
    tokenizer: Tokenizer
    fingerprint: tuple[int, ...] = ()
    ending: str = ""
    active: int = 0
    _idle: asyncio.Event = field(default_factory=asyncio.Event)
    writes: StreamWrites | None = None  # its streams' writes to Redis, gathered (made by the first request)

    @property
    def engine(self) -> GenerationEngine:
        return self.loop.engine

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def version(self) -> str:
        return self.info.version

    def begin(self) -> None:
        self.active += 1
        self._idle.clear()

    def end(self) -> None:
        self.active -= 1
        if not self.active:
            self._idle.set()

    async def retire(self, end_after_s: float | None, message: str = "") -> None:
        """Stop serving once its batches here have ended: after `end_after_s` (None: no limit) the
        sequences still generating end with `message`; then its loop stops and its cache goes."""
        if self.active:
            try:
                await asyncio.wait_for(self._idle.wait(), end_after_s)
            except asyncio.TimeoutError:
                log.info("%s version %s: the %d requests still generating end now: %s", self.name, self.version,
                         self.active, message)
                self.ending = message
                await self._idle.wait()
        await self.loop.__aexit__(None, None, None)
        self.engine.cache.arrays.clear()  # the cache goes now, not when the last reference to the engine does


def generation_names(root: pathlib.Path, only: list[str] | None = None) -> list[str]:
    """The repository's generative models (those in `only`, when given)."""
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")
                  and (not only or p.name in only) and declares_generation(p))


def load_generation_models(settings: ExecutorSettings) -> list[GenerationModel]:
    """Every generative model's selected versions, each with an engine of `generation_cache_mb` of cache
    (not started: its loop runs inside the executor's event loop, `async with model.loop`)."""
    root = pathlib.Path(settings.model_repository)
    models = []
    for name in generation_names(root, settings.models or None):
        scanned = scan_model(root / name)
        for version, print_ in scanned.versions.items():
            model = load_generation(scanned.path, version, settings)
            model.fingerprint = print_
            models.append(model)
    return models


def load_generation(model_dir: pathlib.Path, version: str, settings: ExecutorSettings) -> GenerationModel:
    """One version of the generative model in `model_dir`, with an engine of `generation_cache_mb` of
    cache (not started); RepositoryError with the reason when it cannot be served."""
    budget = int(settings.generation_cache_mb * (1 << 20))
    name = model_dir.name
    decoder = load_decoder(model_dir, version, settings.providers, settings.intra_op_threads,
                           allow_spinning=settings.allow_spinning, cpu_cores=settings.cpu_cores)  # (checks the config)
    config: ModelConfig = read_model_config(model_dir / "config.toml")
    try:
        engine = GenerationEngine(decoder, budget)
    except ValueError as exc:  # the budget holds no sequence's cache
        raise RepositoryError(f"{model_dir}: {exc} (the executor's generation_cache_mb is "
                              f"{settings.generation_cache_mb:g})") from None
    info = pb.ModelInfo(
        name=name, version=version, platform="onnxruntime_onnx", max_batch_size=0,
        default_timeout_ms=float(config.default_timeout_ms), default_priority=int(config.default_priority),
        priority_levels=int(config.priority_levels), max_queue_size=int(config.max_queue_size),
        inputs=[pb.TensorSpec(name=TEXT_INPUT, datatype="BYTES", shape=[1]),
                pb.TensorSpec(name=IDS_INPUT, datatype="INT64", shape=[-1])],
        outputs=[pb.TensorSpec(name=TEXT_OUTPUT, datatype="BYTES", shape=[1]),
                 pb.TensorSpec(name=TOKENS_OUTPUT, datatype="INT64", shape=[-1])],
        providers=decoder.session.get_providers(), decoupled=True, generation=True,
        generation_slots=engine.max_running, ttft_ms=decoder.config.ttft_ms, tpot_ms=decoder.config.tpot_ms,
    )
    log.info("loaded generative model %s version %s: %d sequences at once in %d MiB of cache",
             name, version, engine.max_running, budget >> 20)
    return GenerationModel(info, GenerationLoop(engine, on_step=_step_metrics(engine, info)), decoder.tokenizer)


def _step_metrics(engine: GenerationEngine, info: pb.ModelInfo):
    labels = (info.name, info.version)
    tokens, running, waiting = (metrics.GENERATION_TOKENS.labels(*labels), metrics.GENERATION_RUNNING.labels(*labels),
                                metrics.GENERATION_WAITING.labels(*labels))
    cache, preempted = metrics.GENERATION_CACHE_USE.labels(*labels), metrics.GENERATION_PREEMPTIONS.labels(*labels)

    def observe(report: StepReport, seconds: float) -> None:
        tokens.inc(sum(len(o.token_ids) for o in report.outputs))
        running.set(len(engine.running))
        waiting.set(len(engine.waiting))
        info.generation_running, info.generation_waiting = len(engine.running), len(engine.waiting)
        learn(info, report, seconds)
        cache.set(1 - engine.cache.free / engine.cache.slots)
        preempted.inc(len(report.preempted))

    return observe


# Weight of a step's measurement in the moving averages of the learned costs.
LEARNING_RATE = 0.2


def learn(info: pb.ModelInfo, report: StepReport, seconds: float) -> None:
    """Move the learned costs toward this step's: a step of decoding only times a decode step; the rest
    of a step that also prefilled is its prefill, per token."""
    def moved(old: float, new: float) -> float:
        return new if old == 0 else old + LEARNING_RATE * (new - old)

    if report.decoded and not report.prefill_tokens:
        info.decode_step_s = moved(info.decode_step_s, seconds)
    elif report.prefill_tokens:
        prefill_s = max(0.0, seconds - (info.decode_step_s if report.decoded else 0.0))
        info.prefill_token_s = moved(info.prefill_token_s, prefill_s / report.prefill_tokens)
