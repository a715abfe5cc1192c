"""The generation engine alone on the demo decoder: continuous batching against its alternatives.

    python benchmarks/generation_engine.py [--sequences 128] [--rounds 3] [--threads 1] [--in-flight 8,32]
        [--provider cpu|cuda] [--model DIR | --shape demo|gpt2-small --layout in-place|gathered
        --dtype float32|float16] [--check N] [--peer-setting THREADS,ATTENTION,BATCH_TOKENS]

The same sequences (prompts of 1 to 150 tokens, most short; answers of a long-tailed length,
geometric with mean 32, 4 to 128 tokens, greedy, end-of-text ignored) are generated three ways,
closed loop with C in flight for C in 8 and 32:
- continuous: one engine, a new sequence joins as soon as one ends (at the next step);
- request-level: groups of C run as one batch to the longest answer of the group (each row keeps
  computing until then, as a batch of whole requests does); the next group starts after;
- one at a time: a single sequence in flight (C = 1 of either);
- with `--peer-setting`: transformers' continuous batching on the same weights at that setting
  (benchmarks/generation_peers.py; generation.py sweeps it), closed loop with C in flight.
Prints output tokens per second of wall time and of the process's CPU time (only the tokens each
sequence asked for) and steps per mode and round, then the medians over rounds and their ratios. Builds the
demo decoder into a temporary directory (a few seconds; `--model` names one built already, for a host
without transformers): `--shape gpt2-small` at GPT-2 small's layers and width, `--layout gathered`
as the traced graph whose cache the engine gathers into each run (default: the graph that updates
its cache in place), `--dtype float16` for the CUDA provider; nothing else runs. `--provider cuda`
runs the engine on ONNX Runtime's CUDA provider (with the cache in place, the cache lives on the
GPU), and `--check N` first compares N greedy answers, generated together, with transformers'
`generate` on the same weights (in float32 on the CPU), token for token.
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile
import time

import _common
import numpy as np

from batchline import demo_decoder
from batchline.testing.decoder import Reference, build_gpt, mixed_prompts
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


PROVIDERS = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"]}


def check(model_dir: pathlib.Path, provider: str, count: int, shape: demo_decoder.Shape) -> None:
    """Greedy answers on `provider` for `count` prompts, generated together, against transformers' generate."""
    prompts = mixed_prompts(count, seed=11, longest=100)
    decoder = load_decoder(model_dir, providers=PROVIDERS[provider])
    engine = GenerationEngine(decoder, count * decoder.slot_bytes, count)
    for i, prompt in enumerate(prompts):
        engine.add(str(i), prompt, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(count)}
    while engine.has_work:
        for out in engine.step().outputs:
            tokens[out.request_id] += out.token_ids
    print(f"the session runs on {decoder.session.get_providers()[0]}; the cache lives on {decoder.cache_device[0]}")
    reference = Reference(shape)
    expected = [reference.greedy(p, 32) for p in prompts]
    answers = [tokens[str(i)] for i in range(count)]
    first = [next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
             for got, want in zip(answers, expected)]
    diverged = sorted(j for j in first if j is not None)
    # A near tie in the logits is decided by rounding (float16 most of all): only answers every
    # token of which transformers chose by a clear margin must be equal.
    clear = [i for i in range(count) if reference.clear(prompts[i], expected[i], margin=0.05)]
    print(f"greedy on {provider} against transformers: {count - len(diverged)} of {count} answers equal token for "
          f"token; of the {len(clear)} whose every token won by more than 0.05 in logit, "
          f"{sum(first[i] is None for i in clear)} equal"
          + (f"; the others part at output tokens {diverged}" if diverged else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=128, help="sequences generated per mode and concurrency")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the order of the modes alternating")
    # One thread by default: on a host whose cores other processes share, a run spread over two
    # threads stalls at every operator's barrier when one is preempted (several times slower here).
    parser.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads (0: its default)")
    parser.add_argument("--in-flight", default="8,32", help="the concurrencies C, comma-separated (default 8,32)")
    parser.add_argument("--provider", choices=sorted(PROVIDERS), default="cpu", help="ONNX Runtime's provider")
    parser.add_argument("--model", default="", help="a built demo decoder directory (default: build one)")
    parser.add_argument("--shape", choices=sorted(demo_decoder.SHAPES), default="demo",
                        help="the decoder's size when built here (default: demo)")
    parser.add_argument("--layout", choices=["in-place", "gathered"], default="in-place",
                        help="the graph built here: its cache updated in place, or gathered by the engine")
    parser.add_argument("--dtype", choices=["float32", "float16"], default="float32",
                        help="the graph's type when built here (float16: in place, for the CUDA provider)")
    parser.add_argument("--check", type=int, default=0,
                        help="first compare N greedy answers with transformers' generate, token for token")
    parser.add_argument("--peer-setting", default="", metavar="THREADS,ATTENTION,BATCH_TOKENS",
                        help="add transformers' continuous batching at this setting, e.g. 1,eager,256")
    args = parser.parse_args()
    concurrencies = [int(c) for c in args.in_flight.split(",") if c]
    print(f"host: {_common.machine()}; ONNX Runtime on {args.provider}, {args.threads or 'its default'} intra-op "
          "thread(s)")
    modes = [("one at a time", 1, continuous)]
    for in_flight in concurrencies:
        modes += [(f"continuous C={in_flight}", in_flight, continuous),
                  (f"request-level C={in_flight}", in_flight, request_level)]
    if args.peer_setting:
        from generation_peers import TransformersPeer, parse_setting

        peer = TransformersPeer()
        peer.setting = parse_setting(args.peer_setting)

        def transformers_cb(decoder, prompts, lengths, in_flight: int) -> tuple[int, int]:
            return sum(t.tokens for t in peer.run(prompts, lengths, in_flight)), 0

        modes += [(f"transformers CB C={c}", c, transformers_cb) for c in concurrencies]
    rates: dict[str, list[float]] = {name: [] for name, _, _ in modes}
    cpu_rates: dict[str, list[float]] = {name: [] for name, _, _ in modes}
    with tempfile.TemporaryDirectory() as tmp:
        shape = demo_decoder.SHAPES[args.shape]
        model_dir = pathlib.Path(args.model) if args.model else build_gpt(
            pathlib.Path(tmp), args.layout == "in-place", shape, args.dtype)
        print(f"decoder: {args.shape}, {args.layout}, {args.dtype}")
        if args.check:
            check(model_dir, args.provider, args.check, shape)
        decoder = load_decoder(model_dir, providers=PROVIDERS[args.provider], intra_op_threads=args.threads)
        prompts = mixed_prompts(args.sequences, seed=7)
        lengths = answer_lengths(args.sequences)
        print(f"{args.sequences} sequences: prompts {sum(map(len, prompts))} tokens, answers {sum(lengths)} tokens")
        continuous(decoder, prompts[:2], lengths[:2], 2)  # warm: on a GPU a session's first runs are slow
        for round_ in range(args.rounds):
            for name, in_flight, run in modes if round_ % 2 == 0 else modes[::-1]:
                start, cpu = time.perf_counter(), time.process_time()
                tokens, steps = run(decoder, prompts, lengths, in_flight)
                elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
                rates[name].append(tokens / elapsed)
                cpu_rates[name].append(tokens / cpu)
                print(f"round {round_ + 1}  {name:<20} {tokens / elapsed:8.0f} tokens/s  {tokens / cpu:8.0f} "
                      "tokens/CPU-s  "
                      f"{steps:5d} steps  {elapsed:6.2f} s")
    # Per CPU-second too: with one thread, the process's CPU time is its work, which other
    # processes on a shared host disturb far less than its wall time.
    for label, measured in (("tokens/s", rates), ("tokens/CPU-s", cpu_rates)):
        median = {name: statistics.median(r) for name, r in measured.items()}
        print(f"\nmedian {label}, and continuous against one at a time and against request-level:")
        print(f"  one at a time        {median['one at a time']:8.0f}")
        for in_flight in concurrencies:
            cont, req = median[f"continuous C={in_flight}"], median[f"request-level C={in_flight}"]
            print(f"  C={in_flight:<2} continuous {cont:8.0f}  request-level {req:8.0f}  "
                  f"x{cont / median['one at a time']:.1f} one at a time  x{cont / req:.1f} request-level", end="")
            tcb = median.get(f"transformers CB C={in_flight}")
            print(f"  transformers CB {tcb:8.0f}  x{cont / tcb:.1f} it" if tcb else "")
    if args.peer_setting:
        peer.stop()


if __name__ == "__main__":
    main()
