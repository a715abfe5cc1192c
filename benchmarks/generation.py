"""Generation through the mesh: continuous batching against request-level batching and one at a time.

    python benchmarks/generation.py [--sequences 128] [--in-flight 8,32] [--rounds 3] [--quick]

A mesh (`batchline up`: Redis, a gateway, the scheduler, one executor) serves the demo `gpt`;
this process drives it with tritonclient's asyncio gRPC client, one ModelStreamInfer stream per
sequence. The same sequences (prompts of 1 to 150 token ids, most short; answers geometric with
mean 32, 4 to 128 tokens, end-of-text ignored, greedy; a sequence also ends at the model's
`max_context`) go three ways, closed loop with C in flight, in rounds whose order alternates:
- continuous C: a new sequence is sent as soon as one ends, and joins the running batch at the
  executor's next step;
- request-level C: the mesh has no request-level batching for a generative model, so it is
  emulated through the mesh: groups of C are sent together, each asking for the longest answer of
  its group, so the group runs as one batch to its longest answer; the next group starts after.
  Only the tokens a sequence asked for count; its answer is taken as whole at its group's end
  (its time to first token), and its time per token is the pace of its own tokens in the batch;
- one at a time: continuous with C = 1.
Prints per mode and round the output tokens per second (tokens asked for, over the mode's wall
time) and time to first token and per output token (p50, p99, ms), then medians over rounds and
the ratios. `--quick` runs 12 sequences of short answers at C = 4, one round: a check that the
script works, in seconds, not a measurement.
"""
from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass

import _common
import numpy as np
import tritonclient.grpc.aio as aioclient
from generation_engine import answer_lengths

from batchline.testing.decoder import mixed_prompts

MODEL = "gpt"


@dataclass
class Timed:
    tokens: int  # the tokens the sequence asked for that came back
    ttft_s: float
    tpot_s: float | None  # None: one token


async def one(client, prompt: list[int], max_tokens: int, request_id: str) -> tuple[float, list[float]]:
    """Send one sequence on a stream of its own; its send time and each token's arrival time."""
    ids = aioclient.InferInput("input_ids", [len(prompt)], "INT64")
    ids.set_data_from_numpy(np.array(prompt, np.int64))
    parameters = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                  "timeout": int(_common.CAPACITY_BUDGET_MS * 1000)}

    async def requests():
        yield {"model_name": MODEL, "inputs": [ids], "request_id": request_id, "parameters": parameters}

    sent, arrivals = time.perf_counter(), []
    async for result, error in client.stream_infer(requests()):
        if error is not None:
            raise SystemExit(f"sequence {request_id} failed: {error}")
        now = time.perf_counter()
        arrivals += [now] * len(result.as_numpy("token_ids"))
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    return sent, arrivals


def timed(sent: float, arrivals: list[float], asked: int, answered_at: float | None = None) -> Timed:
    own = arrivals[:asked]
    tpot = (own[-1] - own[0]) / (len(own) - 1) if len(own) > 1 else None
    return Timed(len(own), (answered_at if answered_at is not None else own[0]) - sent, tpot)


async def continuous(address: str, prompts, lengths, in_flight: int) -> list[Timed]:
    pending = list(range(len(prompts)))
    out: list[Timed] = []

    async def worker(client) -> None:
        while pending:
            i = pending.pop(0)
            sent, arrivals = await one(client, prompts[i], lengths[i], f"c{i}")
            out.append(timed(sent, arrivals, lengths[i]))

    async with aioclient.InferenceServerClient(address) as client:
        await asyncio.gather(*(worker(client) for _ in range(in_flight)))
    return out


async def request_level(address: str, prompts, lengths, in_flight: int) -> list[Timed]:
    out: list[Timed] = []
    async with aioclient.InferenceServerClient(address) as client:
        for start in range(0, len(prompts), in_flight):
            group = range(start, min(start + in_flight, len(prompts)))
            longest = max(lengths[i] for i in group)
            runs = await asyncio.gather(*(one(client, prompts[i], longest, f"r{i}") for i in group))
            end = max(arrivals[-1] for _, arrivals in runs)
            out += [timed(sent, arrivals, lengths[i], end) for i, (sent, arrivals) in zip(group, runs)]
    return out


def percentile_ms(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3 if values else float("nan")


def main() -> int:
    p = _common.arg_parser(__doc__.splitlines()[0], progress=False)
    p.add_argument("--sequences", type=int, default=128, help="sequences per mode and round (default: 128)")
    p.add_argument("--in-flight", default="8,32", help="the concurrencies C, comma-separated (default: 8,32)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, the order of the modes alternating (default: 3)")
    p.add_argument("--quick", action="store_true", help="12 short sequences at C=4, one round: a smoke check")
    args = p.parse_args()
    sequences, concurrencies, rounds = args.sequences, [int(c) for c in args.in_flight.split(",") if c], args.rounds
    if args.quick:
        sequences, concurrencies, rounds = 12, [4], 1
    prompts = mixed_prompts(sequences, seed=7)
    lengths = answer_lengths(sequences)
    if args.quick:
        lengths = [min(n, 8) for n in lengths]
    modes = [("one at a time", 1, continuous)]
    for c in concurrencies:
        modes += [(f"continuous C={c}", c, continuous), (f"request-level C={c}", c, request_level)]
    repo = _common.ensure_repository(args.model_repository)
    print(f"machine: {_common.machine()}; {sequences} sequences: prompts {sum(map(len, prompts))} token ids, "
          f"answers up to {sum(lengths)} tokens")
    rates: dict[str, list[float]] = {name: [] for name, _, _ in modes}
    latency: dict[str, list[Timed]] = {name: [] for name, _, _ in modes}
    with _common.mesh(repo, log_level=args.log_level) as address:
        asyncio.run(continuous(address, prompts[:2], [2, 2], 2))  # warm: the session's first runs
        for round_ in range(rounds):
            for name, in_flight, run in modes if round_ % 2 == 0 else modes[::-1]:
                start = time.perf_counter()
                results = asyncio.run(run(address, prompts, lengths, in_flight))
                elapsed = time.perf_counter() - start
                tokens = sum(r.tokens for r in results)
                rates[name].append(tokens / elapsed)
                latency[name] += results
                ttft = [r.ttft_s for r in results]
                tpot = [r.tpot_s for r in results if r.tpot_s is not None]
                print(f"round {round_ + 1}  {name:<20} {tokens / elapsed:7.0f} tokens/s  "
                      f"TTFT p50 {percentile_ms(ttft, 50):7.1f} p99 {percentile_ms(ttft, 99):7.1f} ms  "
                      f"TPOT p50 {percentile_ms(tpot, 50):6.2f} p99 {percentile_ms(tpot, 99):6.2f} ms  "
                      f"{elapsed:6.2f} s", flush=True)
    rows = [["mode", "tokens/s (median)", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms"]]
    median = {name: statistics.median(r) for name, r in rates.items()}
    for name, _, _ in modes:
        ttft = [r.ttft_s for r in latency[name]]
        tpot = [r.tpot_s for r in latency[name] if r.tpot_s is not None]
        rows.append([name, f"{median[name]:.0f}", *(_common.f(percentile_ms(v, q)) for v, q in
                                                     ((ttft, 50), (ttft, 99), (tpot, 50), (tpot, 99)))])
    print()
    print(_common.table(rows))
    for c in concurrencies:
        cont, req = median[f"continuous C={c}"], median[f"request-level C={c}"]
        print(f"C={c}: continuous x{cont / req:.2f} request-level, x{cont / median['one at a time']:.2f} one at a time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
