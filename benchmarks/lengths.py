"""Text of real-world lengths: length-aware batches against batches in arrival order.

    python benchmarks/lengths.py [--rounds 3] [--concurrency 32] [--duration 15]

The workload: every sentence of Python's reference manual (batchline.bench.sentences, shipped with
Python) sent as text to the demo minilm, one sentence a request, plus a long tail: one request in
twenty joins eight sentences, cut at the model's 256 tokens. Two meshes stay up for the whole
run: one as configured (the scheduler's length_aware_batching on), one with
BATCHLINE_SCHEDULER_LENGTH_AWARE_BATCHING=false (each batch is the queue's head, padded to its
longest member). Each round drives both, closed loop at --concurrency in flight with 60 s budgets,
the order alternating. Prints per round sequences/s, p99 and the padding efficiency (tokens over
tokens run once padded, from the executor's batchline_padding_efficiency), and the median ratio;
first, what the gateway's tokenizer costs per text of the workload (CPU time, one text a call and
32 a call).
"""
from __future__ import annotations

import contextlib
import random
import re
import statistics
import sys
import urllib.request

import _common
from batchline.bench import InputOptions, run_closed
from batchline.bench.sentences import python_doc_sentences

TAIL_EVERY = 20    # one request in this many is long
TAIL_SENTENCES = 8  # sentences joined into a long one


def workload(seed: int = 0) -> list[str]:
    sentences = python_doc_sentences()
    rng = random.Random(seed)
    out = []
    for i, s in enumerate(sentences):
        out.append(" ".join(rng.sample(sentences, TAIL_SENTENCES)) if i % TAIL_EVERY == 0 else s)
    return out


def padding(port: int) -> tuple[float, float]:
    """(sum, count) of the executor's batchline_padding_efficiency."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    found = {m.group(1): float(m.group(2)) for m in
             re.finditer(r'^batchline_padding_efficiency_(sum|count)\{[^}]*model="minilm"[^}]*\} (\S+)$', text, re.M)}
    return found.get("sum", 0.0), found.get("count", 0.0)


def tokenizer_cost(tok, texts: list[str], rounds: int) -> tuple[float, float]:
    """CPU µs per text the tokenizer takes (medians of `rounds`): one text a call, as the gateway
    calls it for a request of one text (`encode_batch` of the request's texts), and 32 a call. CPU
    time counts the tokenizer's worker threads, their waits included."""
    import time

    def per_text(calls) -> float:
        start = time.process_time()
        calls()
        return (time.process_time() - start) / len(texts) * 1e6

    def alone() -> None:
        for t in texts:
            tok.encode_batch([t])

    def batched() -> None:
        for i in range(0, len(texts), 32):
            tok.encode_batch(texts[i:i + 32])

    return (statistics.median(per_text(alone) for _ in range(rounds)),
            statistics.median(per_text(batched) for _ in range(rounds)))


def main() -> int:
    p = _common.arg_parser(__doc__.splitlines()[0], progress=False)
    _common.step_args(p, duration=15.0, rounds=3)
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight (default: 32)")
    args = p.parse_args()
    print(f"machine: {_common.machine()}")
    repo = _common.ensure_repository(args.model_repository)
    texts = workload()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(repo / "minilm" / "tokenizer" / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(256)
    lengths = sorted(len(e.ids) for e in tok.encode_batch(texts))
    pct = {q: lengths[int(q / 100 * (len(lengths) - 1))] for q in (50, 90, 99)}
    print(f"workload: {len(texts)} texts, tokens mean {statistics.mean(lengths):.0f}, p50 {pct[50]}, p90 {pct[90]}, "
          f"p99 {pct[99]}, max {lengths[-1]}")
    alone, batched = tokenizer_cost(tok, texts, args.rounds)
    print(f"tokenizer (as the gateway calls it): {alone:.0f} µs a request of one text, {batched:.0f} µs a text in "
          f"requests of 32 (CPU time, worker threads included; medians of {args.rounds} rounds over the workload)")
    inputs = InputOptions(texts=texts)
    modes = {"length-aware": {}, "arrival order": {"BATCHLINE_SCHEDULER_LENGTH_AWARE_BATCHING": "false"}}
    with contextlib.ExitStack() as stack:
        address, metrics = {}, {}
        for mode, env in modes.items():
            base = _common.free_base()
            address[mode] = stack.enter_context(_common.mesh(repo, env=env, log_level=args.log_level,
                                                             metrics_port=base))
            metrics[mode] = base + 2  # gateway, scheduler, then the executor
        runs: dict[str, list] = {m: [] for m in modes}
        for r in range(args.rounds):
            for mode in (list(modes) if r % 2 == 0 else list(modes)[::-1]):
                before = padding(metrics[mode])
                step = run_closed(address[mode], "minilm", args.concurrency, args.duration, warmup=args.warmup,
                                  budget_ms=_common.CAPACITY_BUDGET_MS, inputs=inputs)
                after = padding(metrics[mode])
                efficiency = (after[0] - before[0]) / max(1.0, after[1] - before[1])
                runs[mode].append((step, efficiency))
                print(f"round {r + 1}, {mode}: {step.throughput_rps:.1f} seq/s, p99 "
                      f"{_common.f((step.latency_ms or {}).get('p99'))} ms, "
                      f"mean batch {_common.f(step.mean_batch_size)}, "
                      f"padding efficiency {efficiency:.2f}", flush=True)
    aware, plain = runs["length-aware"], runs["arrival order"]
    ratios = [a.throughput_rps / b.throughput_rps for (a, _), (b, _) in zip(aware, plain) if b.throughput_rps]
    print()
    for mode, rs in runs.items():
        print(f"{mode}: {statistics.median(s.throughput_rps for s, _ in rs):.1f} seq/s, p99 "
              f"{statistics.median((s.latency_ms or {}).get('p99', float('nan')) for s, _ in rs):.0f} ms, padding "
              f"efficiency {statistics.median(e for _, e in rs):.2f}")
    print(f"length-aware / arrival order: {statistics.median(ratios):.2f}x (median of {len(ratios)} rounds; "
          "target >= 1.3)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
