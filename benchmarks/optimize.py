"""INT8 against FP32 for minilm, side by side: in ONNX Runtime alone and through the mesh.

    python benchmarks/optimize.py [--rounds 3] [--duration 10]

Copies the demo repository's minilm, runs `batchline optimize` on it (int8-dynamic, its defaults)
with 512 sentences of Python's reference manual (pydoc_data, shipped with Python: nothing is
downloaded), then times the version it wrote against version 1: in ONNX Runtime alone, batches of
16 at 16 and 128 tokens; through one mesh serving both versions, closed loop at 32 in flight and
128 tokens. Rounds alternate; prints optimize's summary, its run time, and the median ratios.
"""
from __future__ import annotations

import pathlib
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import onnxruntime as ort

import _common
from batchline.bench import InputOptions, run_closed
from batchline.bench.sentences import python_doc_sentences
from batchline.optimize.run import Options, optimize, summary
from batchline.optimize.speed import compare

SENTENCES = 512
RUNS = {16: 30, 128: 6}  # runs per model and round, in ONNX Runtime alone, by tokens


def main() -> int:
    p = _common.arg_parser(__doc__.splitlines()[0], progress=False)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default: 3)")
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per mesh step (default: 10)")
    args = p.parse_args()
    print(f"machine: {_common.machine()}")
    source = _common.ensure_repository(args.model_repository)
    with tempfile.TemporaryDirectory() as tmp:
        repo = pathlib.Path(tmp) / "repository"
        shutil.copytree(source / "minilm", repo / "minilm")
        # Both versions served side by side (the default policy serves only the latest).
        config = repo / "minilm" / "config.toml"
        config.write_text("version_policy = { all = true }\n" + config.read_text())
        texts = pathlib.Path(tmp) / "sentences.txt"
        texts.write_text("\n".join(python_doc_sentences(SENTENCES)) + "\n")
        started = time.perf_counter()
        report = optimize(Options("minilm", repo, variants=("int8-dynamic",), texts=texts,
                                  scratch=pathlib.Path(tmp) / "scratch"))
        print(summary(report))
        print(f"optimize took {time.perf_counter() - started:.0f} s")
        if not report["written_version"]:
            return 1
        sessions = [ort.InferenceSession(str(repo / "minilm" / v / "model.onnx"), providers=["CPUExecutionProvider"])
                    for v in ("1", report["written_version"])]
        rng = np.random.default_rng(0)
        for tokens in (16, 128):
            feeds = {"input_ids": rng.integers(1000, 29000, size=(16, tokens)).astype(np.int64),
                     "attention_mask": np.ones((16, tokens), np.int64)}
            # About a second of runs per model and round: single runs of a few ms are at the mercy of the host.
            ratio = compare(*sessions, feeds, [16], rounds=max(3, args.rounds), runs=RUNS[tokens])["16"]
            print(f"ONNX Runtime alone, batch 16 x {tokens} tokens: INT8 / FP32 = {ratio['throughput_ratio']:.2f}x "
                  f"(p50 {ratio['p50_ms']:.1f} against {ratio['fp32_p50_ms']:.1f} ms)", flush=True)
        with _common.mesh(repo, log_level=args.log_level) as address:
            seqs: dict[str, list[float]] = {"1": [], report["written_version"]: []}
            for r in range(args.rounds):
                for version in (list(seqs) if r % 2 == 0 else list(seqs)[::-1]):
                    step = run_closed(address, "minilm", 32, args.duration, warmup=3.0, version=version,
                                      budget_ms=_common.CAPACITY_BUDGET_MS, inputs=InputOptions(seq_len=128))
                    seqs[version].append(step.throughput_rps)
                    print(f"round {r + 1}, version {version}: {step.throughput_rps:.1f} seq/s", flush=True)
        fp32, int8 = seqs.values()
        print(f"through the mesh, 128 tokens, 32 in flight: INT8 {statistics.median(int8):.1f} seq/s, "
              f"FP32 {statistics.median(fp32):.1f}; INT8 / FP32 = "
              f"{statistics.median(b / a for a, b in zip(fp32, int8)):.2f}x (median of {args.rounds} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
