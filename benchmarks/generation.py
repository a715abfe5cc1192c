"""Generation through the mesh: continuous batching against request-level batching and one at a time.

    python benchmarks/generation.py [--sequences 512] [--single 64] [--in-flight 8,32] [--rounds 3] [--quick]
                                    [--shape gpt2-small] [--executors 2 --threads 1]

A mesh (`batchline up`: Redis, a gateway, the scheduler, one executor, or --executors of --threads
each) serves the demo `gpt`, or with `--shape gpt2-small` a decoder of GPT-2 small's layers and
width on the demo's vocabulary (random weights, built once into .cache/: a model whose compute,
not the serving around it, is most of a token's cost, as a real one's is);
this process drives it with tritonclient's asyncio gRPC client, one ModelStreamInfer stream per
sequence. The same sequences (prompts of 1 to 150 token ids, most short; answers geometric with
mean 32, 4 to 128 tokens, end-of-text ignored, greedy; a sequence also ends at the model's
`max_context`) go three ways, closed loop with C in flight, in rounds whose order alternates:
- continuous C: a new sequence is sent as soon as one ends, and joins the running batch at the
  executor's next step;
- request-level C: the mesh has no request-level batching for a generative model, so it is
  emulated through the mesh: groups of C are sent together, each asking for its own answer, and
  the next group starts when the group's longest has ended. Its answer is taken as whole at its
  group's end (its time to first token), and its time per token is the pace of its own tokens.
  A static batch would also compute its ended sequences' rows to the longest; here they leave the
  running batch, so the emulation computes less than a request-level server: a baseline that can
  only look better than the real one (the ratios against it are lower bounds);
- one at a time: continuous with C = 1, on the first `--single` sequences (it is a reference, not
  a target, and at a sequence at a time the whole set would take most of a round);
- the engine alone, continuous C and request-level C (static batches: each group of C to its longest
  answer, benchmarks/generation_engine.py), in this process: a request-level mesh's CPU per token is
  composed from them, a static batch's compute plus the mesh's serving cost per token (continuous
  through the mesh less the engine's own), printed last;
- transformers CB C: the peer, transformers' continuous batching on the same weights, in this
  process (benchmarks/generation_peers.py), at the best of a sweep of its settings on the host
  (run first, at the largest C; `--peer-setting` names one and skips it; `--no-peers` leaves it out);
- GenAI static C (with `--genai-python`): ONNX Runtime GenAI's engine on the same graph, in a child
  process of its own virtualenv (benchmarks/generation_genai.py): its static batching, a batch run
  to its longest sequence while newcomers wait, is a request-level batcher that really computes
  every row to the longest, in C++ with no serving around it (its continuous batching needs a
  graph from GenAI's own builder).
A closed loop ends with a drain: once fewer than C sequences are left, each step carries fewer
rows, and a run of S sequences spends about the longest answer's steps (up to 128) draining, for
every mode that batches continuously. At S = 4 C that drain is a third of the steps, which is not
"C in flight"; the default S = 16 C (512 at C = 32) makes it about an eighth. A static batch has
no drain (each group of C is full). The peers' sweeps run on the first 128 sequences.
Prints per mode and round the output tokens per second (tokens asked for, over the mode's wall
time) and per CPU-second (the mesh's: every process of it and this client; the peer's: this
process), time to first token and per output token (p50, p99, ms), then medians over rounds, the
ratios, and where the mesh's CPU went per output token, by process. `--quick` runs 12 sequences
of short answers at C = 4, one round, the peer unswept: a check that the script works, in seconds,
not a measurement.
"""
from __future__ import annotations

import asyncio
import pathlib
import statistics
import time
from collections import Counter
from functools import partial

import _common
import numpy as np
import tritonclient.grpc.aio as aioclient
from generation_engine import answer_lengths
from generation_engine import continuous as engine_continuous
from generation_engine import request_level as engine_request_level
from generation_peers import GenAIPeer, Setting, Timed, TransformersPeer, capped, parse_setting

from batchline import demo_decoder
from batchline.testing.decoder import build_gpt, mixed_prompts
from executor.generation_model import load_decoder
from executor.settings import DEFAULT_PROVIDERS

MODEL = "gpt"
SWEEP = 128  # sequences a peer's sweep runs per setting: enough to rank its settings


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
            runs = await asyncio.gather(*(one(client, prompts[i], lengths[i], f"r{i}") for i in group))
            end = max(arrivals[-1] for _, arrivals in runs)
            out += [timed(sent, arrivals, lengths[i], end) for i, (sent, arrivals) in zip(group, runs)]
    return out


def static_tokens(prompts, lengths, in_flight: int) -> int:
    """The tokens a static batch of request-level's groups computes: each sequence its group's longest
    answer, within the context. The emulation computes only those asked for (an ended sequence leaves
    the running batch) and sends only those, as a request-level server would."""
    total = 0
    for start in range(0, len(prompts), in_flight):
        group = range(start, min(start + in_flight, len(prompts)))
        longest = max(lengths[i] for i in group)
        total += sum(capped([prompts[i] for i in group], [longest] * len(group)))
    return total


def build_shape(name: str, shape: demo_decoder.Shape, dtype: str = "float32") -> pathlib.Path:
    """A repository of one decoder `gpt` of `shape`, built once (a few seconds at GPT-2 small's size)."""
    suffix = "" if dtype == "float32" else f"-{dtype}"
    repo = pathlib.Path(__file__).resolve().parent.parent / ".cache" / f"generation-{name}{suffix}"
    print(f"the {name} decoder ({dtype}) in {repo / MODEL} (built if it is not there) ...", flush=True)
    build_gpt(repo, shape=shape, dtype=dtype)
    return repo


def percentile_ms(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3 if values else float("nan")


MESH_PROCESSES = ("client", "gateway", "scheduler", "executor", "redis")
IN_PROCESS = ("transformers", "engine", "GenAI")  # the modes that run beside the mesh, not through it


def main() -> int:
    p = _common.arg_parser(__doc__.splitlines()[0], progress=False)
    p.add_argument("--sequences", type=int, default=512,
                   help="sequences per mode and round (default: 512, so that the closing drain, when fewer than C "
                        "are left, is a small part of a run at C = 32)")
    p.add_argument("--single", type=int, default=64,
                   help="sequences one at a time runs: the first of them (default: 64)")
    p.add_argument("--in-flight", default="8,32", help="the concurrencies C, comma-separated (default: 8,32)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, the order of the modes alternating (default: 3)")
    p.add_argument("--quick", action="store_true", help="12 short sequences at C=4, one round: a smoke check")
    p.add_argument("--no-peers", action="store_true", help="leave transformers' continuous batching out")
    p.add_argument("--peer-setting", type=parse_setting, metavar="THREADS,ATTENTION,BATCH_TOKENS",
                   help="the peer's setting instead of sweeping, e.g. 1,sdpa,256 (attention: sdpa or eager)")
    p.add_argument("--shape", choices=sorted(demo_decoder.SHAPES), default="demo",
                   help="the decoder's size: the demo `gpt` (4 layers x 128), or GPT-2 small's 12 layers x 768 "
                        "with the demo's vocabulary, built once into .cache/generation-gpt2-small (default: demo)")
    p.add_argument("--executors", type=int, default=1,
                   help="executors serving the model, each with --threads intra-op threads (default: 1)")
    p.add_argument("--dtype", choices=["float32", "float16"], default="float32",
                   help="the decoder's type (float16: for the CUDA provider, which the executors and the engine "
                        "alone take where ONNX Runtime has it; built into .cache/)")
    p.add_argument("--genai-python", default="", metavar="PYTHON",
                   help="the python of a virtualenv with onnxruntime-genai: adds its engine's static batching (a "
                        "request-level batcher) on the same graph, at the better of 1 and 2 threads")
    p.add_argument("--threads", type=int, default=0,
                   help="ONNX Runtime intra-op threads of each executor (default: 0, its default: a thread a core)")
    args = p.parse_args()
    sequences, concurrencies, rounds = args.sequences, [int(c) for c in args.in_flight.split(",") if c], args.rounds
    if args.quick:
        sequences, concurrencies, rounds = 12, [4], 1
        args.peer_setting = args.peer_setting or Setting(1, "sdpa", 256)
    prompts = mixed_prompts(sequences, seed=7)
    lengths = answer_lengths(sequences)
    if args.quick:
        lengths = [min(n, 8) for n in lengths]
    shape = demo_decoder.SHAPES[args.shape]
    env: dict[str, str] = {}
    if shape == demo_decoder.DEMO and args.dtype == "float32":
        repo = _common.ensure_repository(args.model_repository)
    else:
        repo = build_shape(args.shape, shape, args.dtype)
        # Cache slots for every sequence at once at the full context, as the demo's 64 MiB hold its own.
        env["BATCHLINE_EXECUTOR_GENERATION_CACHE_MB"] = f"{shape.cache_mb(max(concurrencies), args.dtype) * 1.05:.0f}"
    if args.threads:
        env["BATCHLINE_EXECUTOR_INTRA_OP_THREADS"] = str(args.threads)
    print(f"machine: {_common.machine()}; decoder {args.shape} ({shape.layers} layers x {shape.embedding}); "
          f"{args.executors} executor(s) x {args.threads or 'default'} thread(s); "
          f"{sequences} sequences: prompts {sum(map(len, prompts))} token ids, "
          f"answers up to {sum(capped(prompts, lengths))} tokens")
    for c in concurrencies:
        print(f"request-level C={c}: a static batch would compute {static_tokens(prompts, lengths, c)} tokens for "
              f"those; the emulation computes and sends only those")
    peer = None if args.no_peers else TransformersPeer(shape)
    if peer is not None:
        if args.peer_setting:
            peer.setting = args.peer_setting
        else:
            peer.sweep(prompts[:SWEEP], lengths[:SWEEP], max(concurrencies))
        print(f"transformers' continuous batching at: {peer.setting}")

    genai = GenAIPeer(args.genai_python, repo / MODEL, shape) if args.genai_python else None
    if genai is not None:
        genai.sweep(prompts[:SWEEP], lengths[:SWEEP], max(concurrencies))
        print(f"GenAI's static batching at: {genai.threads} thread(s)")

    # The executors' providers: on a GPU host the engine alone runs where the mesh's executors do.
    decoder = load_decoder(repo / MODEL, providers=list(DEFAULT_PROVIDERS), intra_op_threads=1)
    on_gpu = decoder.session.get_providers()[0] != "CPUExecutionProvider"
    print(f"the engine alone runs on {decoder.session.get_providers()[0]}")

    def engine_alone(run, in_flight: int, count: int = sequences) -> list[Timed]:
        tokens, _ = run(decoder, prompts[:count], lengths[:count], in_flight)
        return [Timed(tokens, float("nan"), None)]

    with _common.mesh(repo, env, executors=args.executors, log_level=args.log_level) as address:
        def through_mesh(run, in_flight: int, count: int = sequences) -> list[Timed]:
            return asyncio.run(run(address, prompts[:count], lengths[:count], in_flight))

        modes = [("one at a time", partial(through_mesh, continuous, 1, min(args.single, sequences)))]
        for c in concurrencies:
            modes += [(f"continuous C={c}", partial(through_mesh, continuous, c)),
                      (f"request-level C={c}", partial(through_mesh, request_level, c))]
            if peer is not None:
                modes.append((f"transformers CB C={c}", partial(peer.run, prompts, lengths, c)))
            if genai is not None:
                modes.append((f"GenAI static C={c}", partial(genai.run, prompts, lengths, c)))
            modes += [(f"engine continuous C={c}", partial(engine_alone, engine_continuous, c)),
                      (f"engine request-level C={c}", partial(engine_alone, engine_request_level, c))]
        rates: dict[str, list[float]] = {name: [] for name, _ in modes}
        per_cpu: dict[str, list[float]] = {name: [] for name, _ in modes}
        latency: dict[str, list[Timed]] = {name: [] for name, _ in modes}
        spent: dict[str, Counter] = {name: Counter() for name, _ in modes}
        made: Counter = Counter()
        through_mesh(continuous, 2, 8)  # warm: the mesh's first runs
        engine_alone(engine_continuous, 2, 8)  # and the engine's own (on a GPU, its first runs are slow)
        for round_ in range(rounds):
            for name, run in modes if round_ % 2 == 0 else modes[::-1]:
                if peer is not None and name.startswith("transformers CB C="):
                    # Its manager for this C built and warmed before the clock starts (one lives at a time).
                    peer.prepare(prompts, lengths, int(name.rsplit("=", 1)[1]))
                before, start = _common.cpu_seconds(), time.perf_counter()
                results = run()
                elapsed, after = time.perf_counter() - start, _common.cpu_seconds()
                # The peer and the engine alone run in this process: their CPU is the client's; the idle
                # mesh's is not their own.
                used = after - before if not name.startswith(IN_PROCESS) else Counter(
                    client=after["client"] - before["client"])
                if genai is not None and name.startswith("GenAI"):
                    used = Counter(client=genai.last_cpu_s)  # its child's: this process only waited
                tokens = sum(r.tokens for r in results)
                rates[name].append(tokens / elapsed)
                per_cpu[name].append(tokens / sum(used.values()))
                latency[name] += results
                spent[name] += used
                made[name] += tokens
                ttft = [r.ttft_s for r in results if r.ttft_s == r.ttft_s]
                tpot = [r.tpot_s for r in results if r.tpot_s is not None]
                print(f"round {round_ + 1}  {name:<22} {tokens / elapsed:6.0f} tokens/s {per_cpu[name][-1]:6.0f} "
                      f"tokens/CPU-s  TTFT p50 {percentile_ms(ttft, 50):7.1f} p99 {percentile_ms(ttft, 99):7.1f} ms  "
                      f"TPOT p50 {percentile_ms(tpot, 50):6.2f} p99 {percentile_ms(tpot, 99):6.2f} ms  "
                      f"{elapsed:6.2f} s", flush=True)
    if peer is not None:
        peer.stop()
    if genai is not None:
        genai.stop()
    rows = [["mode", "tokens/s (median)", "tokens/CPU-s (median)", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
             "TPOT p99 ms"]]
    median = {name: statistics.median(r) for name, r in rates.items()}
    median_cpu = {name: statistics.median(r) for name, r in per_cpu.items()}
    for name, _ in modes:
        ttft = [r.ttft_s for r in latency[name] if r.ttft_s == r.ttft_s]
        tpot = [r.tpot_s for r in latency[name] if r.tpot_s is not None]
        rows.append([name, f"{median[name]:.0f}", f"{median_cpu[name]:.0f}",
                     *(_common.f(percentile_ms(v, q)) for v, q in ((ttft, 50), (ttft, 99), (tpot, 50), (tpot, 99)))])
    print()
    print(_common.table(rows))
    print()
    cpu_rows = [["mode", *MESH_PROCESSES, "total"]]
    for name, _ in modes:
        if not name.startswith(IN_PROCESS):
            ms = {k: spent[name][k] / made[name] * 1e3 for k in MESH_PROCESSES}
            cpu_rows.append([name, *(f"{ms[k]:.3f}" for k in MESH_PROCESSES), f"{sum(ms.values()):.3f}"])
    print("CPU ms per output token, by process (all rounds):")
    print(_common.table(cpu_rows))
    for c in concurrencies:
        cont, req = f"continuous C={c}", f"request-level C={c}"
        # A request-level mesh: a static batch's compute (the engine alone, each group to its longest answer)
        # plus the mesh's serving cost per token (continuous's through the mesh less the engine's own).
        per_token = {name: sum(spent[name].values()) / made[name] for name in spent if made[name]}
        serving = per_token[cont] - per_token[f"engine continuous C={c}"]
        static = serving + per_token[f"engine request-level C={c}"]
        if on_gpu:  # the engine's cost there is the GPU's time, not CPU time: nothing to compose
            print(f"C={c}: the engine runs on a GPU: a request-level mesh is not composed from CPU time")
        else:
            print(f"C={c}: all rounds, CPU ms per token: continuous {per_token[cont] * 1e3:.3f} (serving "
                  f"{serving * 1e3:.3f}, the engine {per_token[f'engine continuous C={c}'] * 1e3:.3f}), "
                  f"request-level emulated {per_token[req] * 1e3:.3f}, a static batch's engine "
                  f"{per_token[f'engine request-level C={c}'] * 1e3:.3f}; a request-level mesh "
                  f"{static * 1e3:.3f}: continuous x{static / per_token[cont]:.2f} it per CPU-second")
        print(f"C={c}: continuous x{median[cont] / median[req]:.2f} request-level "
              f"(x{median_cpu[cont] / median_cpu[req]:.2f} per CPU-second), "
              f"x{median[cont] / median['one at a time']:.2f} one at a time", end="")
        if peer is not None:
            tcb = f"transformers CB C={c}"
            print(f", x{median[cont] / median[tcb]:.2f} transformers' continuous batching "
                  f"(x{median_cpu[cont] / median_cpu[tcb]:.2f} per CPU-second{_thrifty(median_cpu[cont], peer)})",
                  end="")
        if genai is not None:
            batcher = f"GenAI static C={c}"
            print(f", x{median[cont] / median[batcher]:.2f} GenAI's static batching "
                  f"(x{median_cpu[cont] / median_cpu[batcher]:.2f} per CPU-second{_thrifty(median_cpu[cont], genai)})",
                  end="")
        print()
    return 0


def _thrifty(ours_per_cpu: float, peer) -> str:
    """Our tokens per CPU-second against the peer's best per CPU-second in its sweep, when that was
    another setting than its fastest (the one the rounds ran)."""
    best = getattr(peer, "thriftiest", None)
    if not best or not best[1]:
        return ""
    return f"; x{ours_per_cpu / best[1]:.2f} against its best per CPU-second in the sweep, {best[0]}"


if __name__ == "__main__":
    raise SystemExit(main())
