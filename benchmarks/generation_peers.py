"""The peers of benchmarks/generation.py: transformers' continuous batching on the demo `gpt`'s own weights,
and ONNX Runtime GenAI's engine on its own graph (`GenAIPeer`, at the end).

The demo `gpt` is exported from a transformers GPT2LMHeadModel (batchline/demo_decoder.py), so
the peer runs that very model, in this process, through transformers' ContinuousBatchingManager
(`init_continuous_batching`: the engine under `generate_batch` and `transformers serve`): closed
loop, a new request added as soon as one finishes, greedy, end-of-text ignored, each asking for the
tokens the mesh's sequence asks for (capped, as the mesh's are, by the model's 256 positions).
Its times come from the manager's own per-token timestamps, taken in its generation thread: no
network and no client between, which favours the peer over the mesh's client-side times.

The peer's knobs (torch threads, attention implementation, tokens per batch) are swept on the
host first and the best setting by tokens per second is the one measured (`sweep`); its paged KV
cache is sized for C sequences at the model's full context, as the executor's slots are.
"""
from __future__ import annotations

import itertools
import json
import os
import pathlib
import subprocess
import time
from dataclasses import dataclass

from batchline import demo_decoder


@dataclass
class Timed:
    tokens: int  # the tokens the sequence asked for that came back
    ttft_s: float
    tpot_s: float | None  # None: one token


@dataclass(frozen=True)
class Setting:
    threads: int
    attention: str  # transformers' attn_implementation: "sdpa" or "eager" (which its manager runs as "paged|eager")
    batch_tokens: int  # ContinuousBatchingConfig.max_batch_tokens: the most tokens in one forward

    def __str__(self) -> str:
        return f"{self.threads} thread{'s' * (self.threads > 1)}, {self.attention}, {self.batch_tokens} tokens a batch"


def parse_setting(text: str) -> Setting:
    """THREADS,ATTENTION,BATCH_TOKENS, e.g. 1,eager,256."""
    threads, attention, batch_tokens = text.split(",")
    return Setting(int(threads), attention, int(batch_tokens))


SWEEP = [Setting(t, a, b) for t, a, b in itertools.product((1, 2), ("sdpa", "eager"), (256, 1024))]
PAGE = 64  # tokens a cache page: 4 pages make one sequence's full context


def capped(prompts: list[list[int]], lengths: list[int]) -> list[int]:
    """The tokens each sequence can get: its answer length, cut where the prompt and answer fill the context."""
    return [min(n, demo_decoder.MAX_CONTEXT - len(p)) for p, n in zip(prompts, lengths)]


class TransformersPeer:
    """transformers' ContinuousBatchingManager on the demo's GPT2LMHeadModel, one manager per (setting, C)."""

    def __init__(self, shape: demo_decoder.Shape = demo_decoder.DEMO) -> None:
        import torch

        torch.set_grad_enabled(False)
        self.model = demo_decoder.build_reference_model(shape)
        self._managers: dict[tuple[Setting, int], object] = {}
        self.setting: Setting | None = None
        self.thriftiest: tuple[Setting, float] | None = None  # the sweep's best tokens per CPU-second

    def _manager(self, setting: Setting, in_flight: int):
        import torch
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        torch.set_num_threads(setting.threads)
        key = (setting, in_flight)
        if key not in self._managers:
            for manager in self._managers.values():
                manager.stop(block=True)  # type: ignore[attr-defined]
            self._managers.clear()
            self.model.set_attn_implementation(setting.attention)
            generation = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0,
                                          max_new_tokens=demo_decoder.MAX_CONTEXT)
            batching = ContinuousBatchingConfig(
                page_size=PAGE, num_blocks=in_flight * demo_decoder.MAX_CONTEXT // PAGE + 1,
                max_batch_tokens=setting.batch_tokens, max_requests_per_batch=in_flight,
                # Random prompts share no prefix: sharing would only cost its bookkeeping.
                allow_block_sharing=False)
            manager = self.model.init_continuous_batching(generation_config=generation,
                                                          continuous_batching_config=batching)
            manager.start()
            self._managers[key] = manager
        return self._managers[key]

    def prepare(self, prompts: list[list[int]], lengths: list[int], in_flight: int) -> None:
        """Build (and warm, on a few sequences) the manager the next run at `in_flight` uses, if it is
        not the one running now: outside the timed run, as the sweep warms each setting."""
        if (self.setting, in_flight) not in self._managers:
            self.run(prompts[:in_flight], lengths[:in_flight], in_flight)

    def stop(self) -> None:
        for manager in self._managers.values():
            manager.stop(block=True)  # type: ignore[attr-defined]
        self._managers.clear()

    def run(self, prompts: list[list[int]], lengths: list[int], in_flight: int,
            setting: Setting | None = None) -> list[Timed]:
        """Every sequence, closed loop with `in_flight` at once; each one's tokens and times."""
        setting = setting or self.setting
        assert setting is not None, "sweep first, or name a setting"
        manager = self._manager(setting, in_flight)
        wanted = capped(prompts, lengths)
        pending, sent, out = list(range(len(prompts))), {}, []
        run_id = time.perf_counter_ns()

        def add() -> None:
            i = pending.pop(0)
            request_id = f"{run_id}-{i}"
            sent[request_id] = time.perf_counter()
            manager.add_request(prompts[i], request_id=request_id, max_new_tokens=wanted[i],
                                record_timestamps=True, eos_token_id=-1)

        while pending and len(sent) < in_flight:
            add()
        while sent:
            result = manager.get_result(timeout=120)
            if result is None:
                raise SystemExit("transformers' continuous batching returned nothing for 120 s")
            if not result.is_finished():
                continue
            if result.error is not None:
                raise SystemExit(f"transformers' continuous batching failed a request: {result.error}")
            stamps = result.timestamps or []
            start = sent.pop(result.request_id)
            tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
            out.append(Timed(len(result.generated_tokens), stamps[0] - start, tpot))
            if pending:
                add()
        return out

    def sweep(self, prompts: list[list[int]], lengths: list[int], in_flight: int,
              settings: list[Setting] = SWEEP) -> list[tuple[Setting, float, float]]:
        """Each setting's tokens per second and per CPU-second of this process on the sequences, one pass
        after a warming one; the best by tokens per second becomes `self.setting`."""
        rows = []
        for setting in settings:
            self.run(prompts[:in_flight], lengths[:in_flight], in_flight, setting)
            start, cpu = time.perf_counter(), time.process_time()
            tokens = sum(t.tokens for t in self.run(prompts, lengths, in_flight, setting))
            rows.append((setting, tokens / (time.perf_counter() - start), tokens / (time.process_time() - cpu)))
            print(f"sweep  transformers CB, {setting}: {rows[-1][1]:.0f} tokens/s, {rows[-1][2]:.0f} tokens/CPU-s",
                  flush=True)
        self.setting = max(rows, key=lambda r: r[1])[0]
        # Its best per CPU-second may be another setting (fewer threads spin less): a ratio per
        # CPU-second is stated against that one too.
        self.thriftiest = max(((s, cpu) for s, _, cpu in rows), key=lambda sc: sc[1])
        return rows


class GenAIPeer:
    """ONNX Runtime GenAI's engine (static batching) on the demo decoder's own graph, in a child process
    of `python` (a virtualenv with onnxruntime-genai; benchmarks/generation_genai.py), one per thread
    count. A batch runs until its longest sequence ends, and a request that comes meanwhile waits for
    it: request-level batching, in C++ and in process, with no serving around it."""

    def __init__(self, python: str, model_dir: pathlib.Path, shape: demo_decoder.Shape) -> None:
        self.python, self.model_dir, self.shape = python, model_dir, shape
        self.thriftiest: tuple[str, float] | None = None  # the sweep's best tokens per CPU-second
        self._children: dict[int, subprocess.Popen] = {}
        self.threads = 1
        self.last_cpu_s = 0.0

    def _child(self, threads: int) -> subprocess.Popen:
        if threads not in self._children:
            from generation_genai import genai_config

            folder = self.model_dir.parent / f"genai-{threads}"
            folder.mkdir(exist_ok=True)
            graph = folder / "model.onnx"
            if not graph.exists():
                os.link(self.model_dir / "1" / "model.onnx", graph)  # 366 MB at GPT-2 small's size: not copied
            shape = self.shape
            (folder / "genai_config.json").write_text(json.dumps(genai_config(
                shape.layers, shape.heads, shape.embedding, demo_decoder.VOCAB_SIZE, demo_decoder.MAX_CONTEXT,
                threads)))
            child = subprocess.Popen([self.python, str(pathlib.Path(__file__).with_name("generation_genai.py")),
                                      str(folder), str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
            assert child.stdout is not None
            if json.loads(child.stdout.readline() or "{}").get("ready") is not True:
                raise SystemExit(f"ONNX Runtime GenAI did not start under {self.python} (its output above)")
            self._children[threads] = child
        return self._children[threads]

    def run(self, prompts: list[list[int]], lengths: list[int], in_flight: int, threads: int = 0) -> list[Timed]:
        child = self._child(threads or self.threads)
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(json.dumps({"prompts": prompts, "lengths": capped(prompts, lengths),
                                      "in_flight": in_flight}) + "\n")
        child.stdin.flush()
        answer = json.loads(child.stdout.readline())
        self.last_cpu_s = answer["cpu_s"]
        return [Timed(tokens, ttft, tpot) for tokens, ttft, tpot in answer["timed"]]

    def sweep(self, prompts: list[list[int]], lengths: list[int], in_flight: int) -> None:
        """One and two threads, a warming pass and a measured one each; the faster is `self.threads`."""
        best = None
        for threads in (1, 2):
            self.run(prompts[:in_flight], lengths[:in_flight], in_flight, threads)
            start = time.perf_counter()
            tokens = sum(t.tokens for t in self.run(prompts, lengths, in_flight, threads))
            rate, cpu = tokens / (time.perf_counter() - start), tokens / self.last_cpu_s
            print(f"sweep  GenAI static batching, {threads} thread(s): {rate:.0f} tokens/s, {cpu:.0f} tokens/CPU-s",
                  flush=True)
            if best is None or rate > best[0]:
                best = (rate, threads)
            if self.thriftiest is None or cpu > self.thriftiest[1]:
                self.thriftiest = (f"{threads} thread(s)", cpu)  # its best per CPU-second
        assert best is not None
        self.threads = best[1]
        for threads in [t for t in self._children if t != self.threads]:
            self._stop(threads)

    def _stop(self, threads: int) -> None:
        child = self._children.pop(threads)
        if child.stdin is not None:
            child.stdin.close()
        child.wait(timeout=30)

    def stop(self) -> None:
        for threads in list(self._children):
            self._stop(threads)
