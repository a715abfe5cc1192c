"""How fast a variant runs against FP32, in the same run: alternating rounds per batch size."""
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


def _timed(session: ort.InferenceSession, feeds: dict[str, np.ndarray], runs: int) -> float:
    """Median seconds of one run over `runs` runs."""
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def compare(reference: ort.InferenceSession, candidate: ort.InferenceSession, feeds: dict[str, np.ndarray],
            sizes: list[int], rounds: int = 3, runs: int = 2) -> dict:
    """Per batch size: each model's p50 per run and the candidate's throughput against the reference's
    (the median over `rounds` alternating rounds)."""
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
        out[str(rows)] = {"fp32_p50_ms": statistics.median(ref) * 1e3, "p50_ms": statistics.median(cand) * 1e3,
                          "throughput_ratio": statistics.median(a / b for a, b in zip(ref, cand))}
    return out
