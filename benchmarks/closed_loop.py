"""Closed-loop load against a running KServe v2 gRPC endpoint (batchline or Triton).

    python benchmarks/closed_loop.py --url 127.0.0.1:8001 --model mlp --concurrency 32 --seconds 10

Keeps N requests in flight with tritonclient.grpc.aio and prints requests/s,
latency percentiles and the mean batch size the server reports in
ModelStatistics over the run (inference_count / execution_count deltas).
Numbers are from one run on whatever the machine is doing meanwhile.
"""
from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np
import tritonclient.grpc.aio as tca


def make_inputs(model: str, rng: np.random.Generator, seq: int):
    if model == "mlp":
        x = rng.normal(size=(1, 32)).astype(np.float32)
        inp = tca.InferInput("features", [1, 32], "FP32")
        inp.set_data_from_numpy(x)
        return [inp]
    ids = rng.integers(1000, 5000, size=(1, seq), dtype=np.int64)
    ids[0, 0], ids[0, -1] = 101, 102
    inputs = []
    for name, arr in (("input_ids", ids), ("attention_mask", np.ones_like(ids))):
        inp = tca.InferInput(name, list(arr.shape), "INT64")
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    return inputs


async def stats(client, model):
    s = (await client.get_inference_statistics(model)).model_stats[0]
    return s.inference_count, s.execution_count


async def run(args) -> None:
    client = tca.InferenceServerClient(args.url)
    rng = np.random.default_rng(0)
    pool = [make_inputs(args.model, rng, args.seq) for _ in range(64)]
    latencies: list[float] = []
    errors = 0
    # Warm-up, so the first batches (and the scheduler's profile) are not measured.
    await asyncio.gather(*(client.infer(args.model, pool[i % 64]) for i in range(args.concurrency * 4)))
    before = await stats(client, args.model)
    stop_at = time.perf_counter() + args.seconds

    async def worker(k: int) -> None:
        nonlocal errors
        i = k
        while time.perf_counter() < stop_at:
            t = time.perf_counter()
            try:
                await client.infer(args.model, pool[i % 64])
                latencies.append(time.perf_counter() - t)
            except Exception:  # noqa: BLE001 - counted, the load goes on
                errors += 1
            i += args.concurrency

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(args.concurrency)))
    elapsed = time.perf_counter() - t0
    after = await stats(client, args.model)
    await client.close()
    lat = np.array(latencies) * 1e3
    inferences, executions = after[0] - before[0], after[1] - before[1]
    print(f"model={args.model} concurrency={args.concurrency} seconds={elapsed:.1f}")
    print(f"requests/s={len(latencies) / elapsed:.0f} errors={errors}")
    print(f"latency ms p50={np.percentile(lat, 50):.1f} p95={np.percentile(lat, 95):.1f} "
          f"p99={np.percentile(lat, 99):.1f} max={lat.max():.1f}")
    print(f"mean batch size={inferences / max(executions, 1):.1f} (executions={executions})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="127.0.0.1:8001", help="gateway host:port (default: 127.0.0.1:8001)")
    p.add_argument("--model", default="mlp", help="mlp or minilm (default: mlp)")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight (default: 32)")
    p.add_argument("--seconds", type=float, default=10, help="measured duration (default: 10)")
    p.add_argument("--seq", type=int, default=128, help="minilm tokens per request (default: 128)")
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
