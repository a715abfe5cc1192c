"""Continuous batching: the step loop that generates many sequences' tokens in shared runs of a decoder.

Every `step`:
1. admits waiting sequences, best priority and then earliest arrival first, while a cache slot
   is free and the running batch has room; a waiting sequence of better priority than a running
   one preempts it when none is free (the preempted one waits again, keeping its output, and is
   recomputed from prompt plus output when readmitted: vLLM's recompute preemption);
2. prefills at most `prefill_chunk` prompt tokens, one admitted sequence per run, so that a long
   prompt is spread over several steps and does not stall the running sequences;
3. runs one decode step for every running sequence whose prompt is in the cache, in one batched
   run, and samples each one's next token;
4. retires the finished ones (end-of-sequence token, max_tokens, a stop string, max_context) and
   frees their slots.

The engine is synchronous and single-threaded: an asyncio service runs `step` in a worker thread
(executor/generation_loop.py) and calls `add` and `cancel` only between steps. Time is passed in.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

from executor.generation_cache import SlotCache
from executor.generation_model import Decoder
from executor.generation_sampling import SamplingParams, choose
from executor.generation_text import OutputText


class PromptError(ValueError):
    """A prompt the model cannot take; the message says why."""


@dataclass
class Output:
    """What one step made of one sequence: new tokens and text, and whether it ended (and why)."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "eos", "length", "stop" or "cancelled" once finished

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StepReport:
    outputs: list[Output] = field(default_factory=list)
    prefill_tokens: int = 0
    decoded: int = 0  # sequences in the decode run
    preempted: list[str] = field(default_factory=list)
    # Sequences ended by their own failure (drawing a token from their logits), each with why: the
    # others in the step go on.
    failed: list[tuple[str, Exception]] = field(default_factory=list)


@dataclass(eq=False)  # one sequence is itself only: lists of them are searched by identity
class Sequence:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    priority: int
    arrival: float
    order: int  # ties of priority and arrival go in the order sequences were added
    text: OutputText
    output: list[int] = field(default_factory=list)
    slot: int | None = None
    cached: int = 0  # leading tokens whose keys and values are in the slot
    preemptions: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def rank(self) -> tuple[int, float, int]:
        return self.priority, self.arrival, self.order


class GenerationEngine:
    def __init__(self, decoder: Decoder, cache_budget_bytes: int, max_running: int = 0) -> None:
        self.decoder = decoder
        self.config = decoder.config
        self.cache = SlotCache(decoder.cache, self.config.max_context, cache_budget_bytes, decoder.cache_device)
        self._in_place = self.config.cache_in_place
        self.max_running = min(max_running or decoder.max_batch_size, self.cache.slots)
        self.eos = frozenset(self.config.eos_token_ids)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._added = 0
        self._cancelled: set[str] = set()
        self._outputs = [self.config.logits_output, *(c.present for c in decoder.cache)]

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request_id: str, prompt: list[int], params: SamplingParams, priority: int = 1,
            arrival: float = 0.0, output: list[int] | None = None) -> None:
        """Queue a sequence; PromptError when the prompt is empty or leaves no room to generate.

        `output`: tokens this sequence already made elsewhere (an executor that failed): they are
        recomputed with the prompt and not sent again; the next token drawn is the one after them."""
        if not prompt:
            raise PromptError("the prompt is empty: generation needs at least one token to continue")
        limit = self.config.max_context
        if len(prompt) >= limit:
            raise PromptError(f"the prompt has {len(prompt)} tokens; this model's context holds {limit}, so a prompt "
                              f"may have at most {limit - 1}")
        vocabulary = self.decoder.tokenizer.get_vocab_size()
        bad = sorted({t for t in prompt if not 0 <= t < vocabulary})
        if bad:
            raise PromptError(f"prompt token ids {bad[:5]} are not in the tokenizer's {vocabulary} ids")
        if request_id in {s.request_id for s in self.waiting + self.running}:
            raise PromptError(f"request id {request_id!r} is already generating")
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        made = list(output or [])
        if len(prompt) + len(made) >= limit or len(made) >= params.max_tokens:
            raise PromptError(f"the sequence already has {len(made)} output tokens: nothing is left to generate")
        text = OutputText(self.decoder.tokenizer, prompt, params.stop)
        for token in made:  # the text state (held-back characters, stop strings) the output left
            text.add(token)
        text.take()
        self._added += 1
        self.waiting.append(Sequence(request_id, list(prompt), params, seed, priority, arrival, self._added,
                                     text, made))

    def cancel(self, request_id: str) -> None:
        """End the sequence at the next step (its slot is freed then). A request this engine does not
        hold (ended already) is left alone: kept, its cancel would end the request when it is added
        again (handed back to this executor by recovery)."""
        if any(s.request_id == request_id for s in self.running) or \
                any(s.request_id == request_id for s in self.waiting):
            self._cancelled.add(request_id)

    def drop_all(self) -> None:
        """Forget every sequence and free its slot."""
        self.drop_running()
        self.waiting.clear()
        self._cancelled.clear()

    def drop_running(self) -> list[str]:
        """Forget the running sequences and free their slots (after a failed run, whose caches are
        unknown); the request ids dropped. Waiting ones were in no run and stay."""
        dropped = [seq.request_id for seq in self.running]
        for seq in list(self.running):
            self._release(seq)
        return dropped

    def step(self) -> StepReport:
        report = StepReport()
        self._retire_cancelled(report)
        self._admit(report)
        sampled: list[tuple[Sequence, np.ndarray]] = []
        prefilled = self._prefill(report, sampled)
        decoding = [s for s in self.running if s.cached == len(s.tokens) - 1 and s not in prefilled]
        if decoding:
            self._decode(decoding, sampled)
            report.decoded = len(decoding)
        failed: list[Sequence] = []
        for seq, logits in sampled:
            try:
                report.outputs.append(self._advance(seq, logits))
            except Exception as exc:  # noqa: BLE001 - one sequence's draw fails it alone, not the step
                report.failed.append((seq.request_id, exc))
                failed.append(seq)
        finished = {o.request_id for o in report.outputs if o.finished}
        for seq in [s for s in self.running if s.request_id in finished] + failed:
            self._release(seq)
        return report

    # ------------------------------------------------------------------ admission

    def _admit(self, report: StepReport) -> None:
        self.waiting.sort(key=lambda s: s.rank)
        while self.waiting:
            candidate = self.waiting[0]
            if len(self.running) >= self.max_running or self.cache.free == 0:
                victim = max(self.running, key=lambda s: s.rank, default=None)
                if victim is None or victim.priority <= candidate.priority:
                    return
                self._preempt(victim)
                report.preempted.append(victim.request_id)
            slot = self.cache.allocate()
            assert slot is not None
            self.waiting.pop(0)
            candidate.slot, candidate.cached = slot, 0
            self.running.append(candidate)

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.preemptions += 1
        self.waiting.append(seq)
        self.waiting.sort(key=lambda s: s.rank)

    def _release(self, seq: Sequence) -> None:
        self.running.remove(seq)
        assert seq.slot is not None
        self.cache.release(seq.slot)
        seq.slot, seq.cached = None, 0

    def _retire_cancelled(self, report: StepReport) -> None:
        if not self._cancelled:
            return
        for seq in [s for s in self.running if s.request_id in self._cancelled]:
            self._release(seq)
            report.outputs.append(Output(seq.request_id, [], seq.text.take(final=True), "cancelled"))
        for seq in [s for s in self.waiting if s.request_id in self._cancelled]:
            self.waiting.remove(seq)
            report.outputs.append(Output(seq.request_id, [], seq.text.take(final=True), "cancelled"))
        self._cancelled.clear()

    # ------------------------------------------------------------------ runs

    def _run(self, ids: np.ndarray, positions: np.ndarray, mask: np.ndarray,
             past: list[np.ndarray]) -> list[np.ndarray]:
        feeds = {self.config.ids_input: ids, self.config.positions_input: positions, self.config.mask_input: mask}
        feeds.update((c.past, p) for c, p in zip(self.decoder.cache, past))
        return self.decoder.session.run(self._outputs, feeds)

    def _run_in_place(self, ids: np.ndarray, positions: np.ndarray, mask: np.ndarray, first: int) -> np.ndarray:
        """One run on cache rows first..first+len(ids)-1, bound as both past and present; the logits."""
        binding = self.decoder.session.io_binding()
        binding.bind_cpu_input(self.config.ids_input, ids)
        binding.bind_cpu_input(self.config.positions_input, positions)
        binding.bind_cpu_input(self.config.mask_input, mask)
        binding.bind_output(self.config.logits_output, "cpu")
        device, device_id = self.cache.device
        for tensor, (address, shape, dtype) in zip(self.decoder.cache, self.cache.rows(first, len(ids))):
            binding.bind_input(tensor.past, device, device_id, dtype, shape, address)
            binding.bind_output(tensor.present, device, device_id, dtype, shape, address)
        self.decoder.session.run_with_iobinding(binding)
        # Only the logits are read back: the presents are the slots themselves.
        return binding.get_outputs()[0].numpy()

    def _prefill(self, report: StepReport, sampled: list[tuple[Sequence, np.ndarray]]) -> list[Sequence]:
        budget, touched = self.config.prefill_chunk, []
        for seq in sorted((s for s in self.running if s.cached < len(s.tokens) - 1), key=lambda s: s.rank):
            if budget == 0:
                break
            tokens = seq.tokens
            # A chunk that reaches the last token yields the next token's logits; one that stops short
            # of it leaves the sequence to a later chunk, or to the decode run when one token is left.
            end = min(len(tokens), seq.cached + budget)
            count = end - seq.cached
            assert seq.slot is not None
            ids = np.asarray([tokens[seq.cached:end]], np.int64)
            positions = np.arange(seq.cached, end, dtype=np.int64)[None]
            if self._in_place:
                logits = self._run_in_place(ids, positions, np.ones((1, end), np.int64), seq.slot)
            else:
                outputs = self._run(ids, positions, np.ones((1, end), np.int64),
                                    self.cache.gather([seq.slot], seq.cached))
                self.cache.write([seq.slot], [seq.cached], outputs[1:], count)
                logits = outputs[0]
            seq.cached = end
            budget -= count
            report.prefill_tokens += count
            touched.append(seq)
            if end == len(tokens):
                sampled.append((seq, logits[0, -1]))
        return touched

    def _decode(self, batch: list[Sequence], sampled: list[tuple[Sequence, np.ndarray]]) -> None:
        if self._in_place:
            self._decode_in_place(batch, sampled)
            return
        lengths = np.asarray([s.cached for s in batch], np.int64)
        longest = int(lengths.max())
        # Each row's cached positions, then padding up to the longest, then the new position.
        mask = (np.arange(longest + 1)[None, :] < lengths[:, None]).astype(np.int64)
        mask[:, longest] = 1
        slots = [s.slot for s in batch if s.slot is not None]
        outputs = self._run(np.asarray([[s.tokens[-1]] for s in batch], np.int64), lengths[:, None], mask,
                            self.cache.gather(slots, longest))
        self.cache.write(slots, lengths.tolist(), outputs[1:], 1)
        for b, seq in enumerate(batch):
            seq.cached += 1
            sampled.append((seq, outputs[0][b, -1]))

    def _decode_in_place(self, batch: list[Sequence], sampled: list[tuple[Sequence, np.ndarray]]) -> None:
        """One run over cache rows 0..R-1, R past the highest slot decoding. A row that is not decoding
        (a free slot, or a sequence still being prefilled) runs a stand-in token at its next free
        position: the keys and values written there are overwritten before anything reads them."""
        rows = max(s.slot for s in batch if s.slot is not None) + 1
        ids = np.zeros((rows, 1), np.int64)
        lengths = np.zeros(rows, np.int64)
        for seq in self.running:
            if seq.slot is not None and seq.slot < rows:
                lengths[seq.slot] = min(seq.cached, self.config.max_context - 1)
        for seq in batch:
            ids[seq.slot, 0] = seq.tokens[-1]
        # Each row's positions, cached and new, as ones from the first (the graph's lengths).
        mask = (np.arange(int(lengths.max()) + 1)[None, :] <= lengths[:, None]).astype(np.int64)
        logits = self._run_in_place(ids, lengths[:, None], mask, 0)
        for seq in batch:
            seq.cached += 1
            sampled.append((seq, logits[seq.slot, -1]))

    # ------------------------------------------------------------------ tokens

    def _advance(self, seq: Sequence, logits: np.ndarray) -> Output:
        token = choose(logits, seq.params, seq.seed, len(seq.output))
        seq.output.append(token)
        reason = None
        if token in self.eos and not seq.params.ignore_eos:
            reason = "eos"
        elif seq.text.add(token):
            reason = "stop"
        elif len(seq.output) >= seq.params.max_tokens or len(seq.tokens) >= self.config.max_context:
            reason = "length"
        return Output(seq.request_id, [token], seq.text.take(final=reason is not None), reason)
