"""The generation engine alone on the demo decoder: continuous batching against its alternatives.

    python benchmarks/generation_engine.py [--sequences 64] [--rounds 1]

The same sequences (prompts of 1 to 150 tokens, most short; answers of a long-tailed length,
geometric with mean 32, 4 to 128 tokens, greedy, end-of-text ignored) are generated three ways,
closed loop with C in flight for C in 1, 8 and 32:
- continuous: one engine, a new sequence joins as soon as one ends (at the next step);
- request-level: groups of C run as one batch to the longest answer of the group (each row keeps
  computing until then, as a batch of whole requests does); the next group starts after;
- one at a time: a single sequence in flight (C = 1 of either).
Prints output tokens/s (only the tokens each sequence asked for) and steps per mode. Builds the
demo decoder into a temporary directory (a few seconds); nothing else runs.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import tempfile
import time

import numpy as np

from batchline.testing.decoder import build_gpt, mixed_prompts
from executor.generation_engine import GenerationEngine
from executor.generation_model import load_decoder
from executor.generation_sampling import SamplingParams


def answer_lengths(count: int, seed: int = 1) -> list[int]:
    rng = np.random.default_rng(seed)
    return np.clip(rng.geometric(1 / 32, size=count), 4, 128).tolist()


def continuous(decoder, prompts, lengths, in_flight: int) -> tuple[int, int]:
    engine = GenerationEngine(decoder, in_flight * decoder.slot_bytes, in_flight)
    queue, steps, tokens = list(range(len(prompts))), 0, 0
    while queue or engine.has_work:
        while queue and len(engine.running) + len(engine.waiting) < in_flight:
            i = queue.pop(0)
            engine.add(str(i), prompts[i], SamplingParams(max_tokens=lengths[i], temperature=0, ignore_eos=True))
        tokens += sum(len(o.token_ids) for o in engine.step().outputs)
        steps += 1
    return tokens, steps


def request_level(decoder, prompts, lengths, in_flight: int) -> tuple[int, int]:
    engine = GenerationEngine(decoder, in_flight * decoder.slot_bytes, in_flight)
    steps, tokens = 0, 0
    for start in range(0, len(prompts), in_flight):
        group = range(start, min(start + in_flight, len(prompts)))
        longest = max(lengths[i] for i in group)
        for i in group:
            engine.add(str(i), prompts[i], SamplingParams(max_tokens=longest, temperature=0, ignore_eos=True))
        made = dict.fromkeys(group, 0)
        while engine.has_work:
            for out in engine.step().outputs:
                made[int(out.request_id)] += len(out.token_ids)
            steps += 1
        tokens += sum(min(made[i], lengths[i]) for i in group)
    return tokens, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=64, help="sequences generated per mode and concurrency")
    parser.add_argument("--rounds", type=int, default=1, help="rounds, the modes alternating within each")
    args = parser.parse_args()
    print(f"host: {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as tmp:
        decoder = load_decoder(build_gpt(pathlib.Path(tmp)))
        prompts = mixed_prompts(args.sequences, seed=7)
        lengths = answer_lengths(args.sequences)
        print(f"{args.sequences} sequences: prompts {sum(map(len, prompts))} tokens, answers {sum(lengths)} tokens")
        for round_ in range(args.rounds):
            for in_flight in (1, 8, 32):
                modes = [("continuous", continuous), ("request-level", request_level)]
                for name, run in modes if round_ % 2 == 0 else modes[::-1]:
                    if in_flight == 1 and name == "request-level":
                        continue  # the same as continuous at one in flight: one sequence at a time
                    start = time.perf_counter()
                    tokens, steps = run(decoder, prompts, lengths, in_flight)
                    elapsed = time.perf_counter() - start
                    label = "one at a time" if in_flight == 1 else name
                    print(f"round {round_ + 1}  C={in_flight:<2}  {label:<14} {tokens / elapsed:8.0f} tokens/s  "
                          f"{steps:5d} steps  {elapsed:6.2f} s")


if __name__ == "__main__":
    main()
