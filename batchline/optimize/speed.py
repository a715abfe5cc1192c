"""How fast a variant runs against FP32, in the same run: alternating rounds per batch size.

The throughput ratio compares the fastest run of each model within a round, the median over the
rounds: other processes on the host only ever slow a run, so the fastest is the model's own speed.
On a host shared with other work, ratios of medians swung from 1.0x to 2.1x between identical
measurements of one INT8 minilm; ratios of the fastest runs stayed within 1.8-2.0x."""
from __future__ import annotations

import statistics
import time

import numpy as np
import onnxruntime as ort


def tile(feeds: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    """`feeds` repeated (or cut) to `rows` rows."""
    have = next(iter(feeds.values())).shape[0]
    reps = -(-rows // have)
    return {k: np.concatenate([v] * reps)[:rows] for k, v in feeds.items()}


def _timed(session: ort.InferenceSession, feeds: dict[str, np.ndarray], runs: int) -> list[float]:
    """Seconds of each of `runs` runs."""
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - t)
    return times


def compare(reference: ort.InferenceSession, candidate: ort.InferenceSession, feeds: dict[str, np.ndarray],
            sizes: list[int], rounds: int = 3, runs: int = 3) -> dict:
    """Per batch size: each model's p50 per run, and the candidate's throughput against the
    reference's (per round the ratio of their fastest runs; the median over `rounds` alternating
    rounds)."""
    out = {}
    for rows in sizes:
        batch = tile(feeds, rows)
        reference.run(None, batch)  # warm-up: allocations and kernel choices are not the model's speed
        candidate.run(None, batch)
        ref, cand = [], []
        for r in range(rounds):
            pair = [(ref, reference), (cand, candidate)]
            for times, session in (pair if r % 2 == 0 else pair[::-1]):
                times.append(_timed(session, batch, runs))
        out[str(rows)] = {"fp32_p50_ms": statistics.median(t for r in ref for t in r) * 1e3,
                          "p50_ms": statistics.median(t for r in cand for t in r) * 1e3,
                          "throughput_ratio": statistics.median(min(a) / min(b) for a, b in zip(ref, cand))}
    return out
