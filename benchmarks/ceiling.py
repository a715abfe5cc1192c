"""How close the mesh gets to what ONNX Runtime alone can do with minilm on this machine.

    python benchmarks/ceiling.py [--model-repository PATH]

1. Ceiling: minilm in this process, in ONNX Runtime sessions created as the executor creates
   them (executor.sessions.create_session, CPU), at batch sizes 1, 2, 4, ..., 64 for 128 and
   16 tokens (best of 3 interleaved rounds of 1 s each), two ways: one run at a time over every
   core (ONNX Runtime's default intra-op threads), and one single-threaded run per core at once
   (what instance_count = cores does in the mesh). The ceiling is the best sequences/s of either,
   with the batch size and the way it needs.
2. Mesh: `batchline up`-style subprocesses, driven closed-loop: 128 tokens at 32 in flight, and
   16 tokens at 32, 64 and 128 in flight, as unary ModelInfer calls; then 128 tokens at 32 and
   16 tokens at 128 in flight over ModelStreamInfer streams (one per slot, like perf_analyzer
   --streaming), which spare gateway and client most of gRPC's per-call cost.
3. Paired: right before and right after each mesh step, while the mesh sits idle, the ceiling's
   batch size and way timed for as long as the step (--duration s at a stretch). The ceiling itself
   is the best of many 1 s rounds, an upper bound on a shared host whose speed drifts by 20% within
   minutes; the pair brackets the step in time, so the drift hits both sides alike.
4. gRPC's floor (grpc_floor.py): the CPU a bare grpc.aio server that refuses everything and the
   bench's client spend per call, unary and over streams, before the mesh starts. A request that
   costs that besides the model's m CPU ms (the cores over the ceiling) reaches at most
   m / (m + floor) of the ceiling on the same cores: the cap.
5. Prints mesh / ceiling, mesh / paired (the mean of the two bracketing timings) and the cap, per
   way of calling. ONNX Runtime alone, gRPC's floor and the mesh never run at the same time.
"""
from __future__ import annotations

import os
import pathlib
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import _common
import grpc_floor
from batchline.bench import InputOptions, run_closed

BATCHES = [1, 2, 4, 8, 16, 32, 64]
RUN_S = 1.0  # timed seconds per batch size and round
# The machine is shared and other load only ever slows a run down, so each batch size is timed
# in several rounds (interleaved, so a burst of outside load does not hit one size only) and the
# best round counts: the ceiling is an upper bound.
ROUNDS = 3


ONE_RUN = "one run over all cores"
PER_CORE = "one 1-thread run per core"


def _timed(session, feed: dict, rows: int, seconds: float) -> float:
    """Sequences/s of back-to-back runs for `seconds` (at least 2 runs)."""
    runs, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or runs < 2:
        session.run(None, feed)
        runs += 1
    return rows * runs / elapsed


def _rate(way: str, session, feed: dict, rows: int, seconds: float, pool: ThreadPoolExecutor, cores: int) -> float:
    if way == ONE_RUN:
        return _timed(session, feed, rows, seconds)
    # One session, `cores` runs at once: ONNX Runtime's runs are thread-safe.
    return sum(pool.map(lambda _: _timed(session, feed, rows, seconds), range(cores)))


def _session(model_path: pathlib.Path, way: str):
    from executor.sessions import create_session

    # ONNX Runtime's own defaults otherwise (spinning on, unlike the executor), as in earlier sessions.
    return create_session(model_path, [("CPUExecutionProvider", {})], intra_op_threads=0 if way == ONE_RUN else 1)


def _feed(rng: np.random.Generator, rows: int, seq_len: int) -> dict:
    return {"input_ids": rng.integers(1000, 29000, size=(rows, seq_len), dtype=np.int64),
            "attention_mask": np.ones((rows, seq_len), dtype=np.int64)}


def ort_ceiling(model_path: pathlib.Path, seq_len: int) -> tuple[float, int, str, dict[str, dict[int, float]]]:
    cores = len(os.sched_getaffinity(0))
    sessions = {way: _session(model_path, way) for way in (ONE_RUN, PER_CORE)}
    rng = np.random.default_rng(0)
    feeds = {b: _feed(rng, b, seq_len) for b in BATCHES}
    curves = {way: dict.fromkeys(BATCHES, 0.0) for way in sessions}
    with ThreadPoolExecutor(cores) as pool:
        for _ in range(ROUNDS):
            for b, feed in feeds.items():
                for way, session in sessions.items():
                    session.run(None, feed)  # warm-up: allocations for this shape
                    curves[way][b] = max(curves[way][b], _rate(way, session, feed, b, RUN_S, pool, cores))
    way, best = max(((w, b) for w in curves for b in BATCHES), key=lambda wb: curves[wb[0]][wb[1]])
    return curves[way][best], best, way, curves


class Sustained:
    """The ceiling's batch size and way, timed at a stretch for as long as a mesh step, on demand."""

    def __init__(self, model_path: pathlib.Path, seq_len: int, batch: int, way: str) -> None:
        self.cores = len(os.sched_getaffinity(0))
        self.batch, self.way = batch, way
        self.session = _session(model_path, way)
        self.feed = _feed(np.random.default_rng(1), batch, seq_len)
        self.session.run(None, self.feed)

    def rate(self, seconds: float) -> float:
        with ThreadPoolExecutor(self.cores) as pool:
            return _rate(self.way, self.session, self.feed, self.batch, seconds, pool, self.cores)


def main() -> int:
    p = _common.arg_parser(__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per mesh step (default: 10)")
    p.add_argument("--warmup", type=float, default=3.0, help="warm-up seconds per mesh step (default: 3)")
    args = p.parse_args()
    repo = _common.ensure_repository(args.model_repository)
    print(f"machine: {_common.machine()}")

    ceilings, sustained = {}, {}
    model_path = repo / "minilm" / "1" / "model.onnx"
    for seq in (128, 16):
        best, at, way, curves = ort_ceiling(model_path, seq)
        ceilings[seq] = (best, at)
        for w, per_batch in curves.items():
            curve = "  ".join(f"b{b}={v:.0f}" for b, v in per_batch.items())
            print(f"ONNX Runtime alone, minilm {seq} tokens, {w} (sequences/s): {curve}")
        print(f"  ceiling {best:.0f} seq/s at batch {at}, {way}", flush=True)
        # The ceiling is the best 1 s round of 42; a mesh step is one stretch of --duration
        # seconds. The same batch size and way, timed for as long right before and after each
        # step, shows how much of the gap is the host's drift rather than the mesh.
        sustained[seq] = Sustained(model_path, seq, at, way)

    floor = grpc_floor.floor_here()
    print(f"gRPC's floor (a bare grpc.aio server and the bench's client, CPU per call): "
          f"{floor['unary']:.2f} ms unary, {floor['stream']:.2f} ms over streams", flush=True)
    cores = len(os.sched_getaffinity(0))

    def cap(seq: int, calls: str) -> float:
        return grpc_floor.ceiling_cap(cores * 1e3 / ceilings[seq][0], floor[calls])

    steps = [(128, 32, False), (16, 32, False), (16, 64, False), (16, 128, False), (128, 32, True), (16, 128, True)]
    measured = []
    with _common.mesh(repo, log_level=args.log_level) as address:
        for seq, conc, streaming in steps:
            before = sustained[seq].rate(args.duration)
            s = run_closed(address, "minilm", conc, args.duration, warmup=args.warmup,
                           budget_ms=_common.CAPACITY_BUDGET_MS,
                           inputs=InputOptions(seq_len=seq, int_ranges={"input_ids": (1000, 29000)}),
                           progress=args.progress, streaming=streaming)
            after = sustained[seq].rate(args.duration)
            paired = (before + after) / 2
            measured.append((seq, conc, s, paired))
            print(f"mesh minilm {seq} tokens, {conc} in flight{' (stream)' if streaming else ''}: "
                  f"{s.throughput_rps:.0f} seq/s, "
                  f"p99 {_common.f((s.latency_ms or {}).get('p99'))} ms, batch {_common.f(s.mean_batch_size, '.1f')}, "
                  f"{s.status_counts}; ONNX Runtime alone before / after: {before:.0f} / {after:.0f} seq/s", flush=True)

    rows = [["tokens", "in flight", "calls", "mesh seq/s", "ceiling seq/s (batch)", "mesh/ceiling",
             "paired seq/s", "mesh/paired", "gRPC floor's cap", "mean batch", "p99 ms"]]
    best: dict[tuple[int, str], tuple[float, float]] = {}
    for seq, conc, s, paired in measured:
        ceiling, at = ceilings[seq]
        calls = "stream" if s.streaming else "unary"
        if s.throughput_rps >= best.get((seq, calls), (0.0, 0.0))[0]:
            best[seq, calls] = (s.throughput_rps, paired)
        rows.append([str(seq), str(conc), calls, f"{s.throughput_rps:.0f}", f"{ceiling:.0f} ({at})",
                     f"{s.throughput_rps / ceiling:.2f}", f"{paired:.0f}", f"{s.throughput_rps / paired:.2f}",
                     f"{cap(seq, 'stream' if s.streaming else 'unary'):.2f}", _common.f(s.mean_batch_size),
                     _common.f((s.latency_ms or {}).get("p99"))])
    print()
    print(_common.table(rows))
    for (seq, calls), (rps, paired) in best.items():
        print(f"minilm {seq} tokens, {calls} calls: best mesh/ceiling = {rps / ceilings[seq][0]:.2f} "
              f"(that step against ONNX Runtime alone timed around it: {rps / paired:.2f}); "
              f"gRPC's floor alone caps it at {cap(seq, calls):.2f} here")
    return 0


if __name__ == "__main__":
    sys.exit(main())
