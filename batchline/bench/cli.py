"""`batchline bench`: the command line over `batchline.bench` (also `python -m batchline.bench`)."""
from __future__ import annotations

import argparse
import sys

DESCRIPTION = """\
Drive a KServe v2 gRPC or HTTP endpoint (batchline or Triton) with random inputs shaped after the model's
metadata, and report per step: offered load, throughput (OK answers/s), goodput (OK answers within
--budget-ms per second), p50/p95/p99/max latency of OK answers, counts by gRPC status and the mean
batch size from ModelStatistics.

Closed loop keeps N requests in flight (one step per --concurrency value); open loop sends Poisson
arrivals at each --rate without waiting for answers (plus --burst SIZE:PERIOD_S bursts). Requests
are unary ModelInfer calls, or with --streaming messages on ModelStreamInfer streams; with
--protocol http, POSTs to the REST port with binary tensors (Triton's binary tensor data extension),
one keep-alive connection per request in flight, and statuses counted by their gRPC names.

Inputs: a dynamic first dim is the batch dim (1 row per request); other dynamic dims are
--default-dim, or --seq-len for 2-D integer inputs, or exactly --shape NAME=d0,d1,... (full shape).
Integers are drawn from [0, 100] (inputs named *mask*: all ones) unless --int-range NAME=LO:HI.
BYTES inputs get random ASCII words."""

EPILOG = """\
examples:
  batchline bench --url 127.0.0.1:8001 --model mlp --concurrency 1,8,32 --duration 10
  batchline bench --model minilm --seq-len 128 --int-range input_ids=1000:29000 --concurrency 32
  batchline bench --url 127.0.0.1:8001 --model mlp --concurrency 32 --streaming
  batchline bench --protocol http --url 127.0.0.1:8000 --model mlp --concurrency 32
  batchline bench --model minilm --seq-len 16 --mode open --rate 100,200,400 --budget-ms 200 \\
      --burst 50:2 --json out.json --plot out.png"""


def _csv(kind):
    def parse(text: str):
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
        if not values or any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
        return values
    return parse


def _burst(text: str) -> tuple[int, float]:
    size, sep, period = text.partition(":")
    try:
        if not sep:
            raise ValueError
        value = int(size), float(period)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected SIZE:PERIOD_S (e.g. 50:2), got {text!r}") from None
    if value[0] < 1 or value[1] <= 0:
        raise argparse.ArgumentTypeError(f"burst size must be >= 1 and period > 0, got {text!r}")
    return value


def configure(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("target")
    t.add_argument("--url", default=None, help="endpoint HOST:PORT (default: 127.0.0.1:8001, with --protocol http "
                   "127.0.0.1:8000)")
    t.add_argument("--protocol", choices=("grpc", "http"), default="grpc",
                   help="grpc, or http: KServe v2 REST with binary tensors (default: grpc)")
    t.add_argument("--model", required=True, help="model name")
    t.add_argument("--model-version", default="", help="model version (default: the server's choice)")
    m = p.add_argument_group("load")
    m.add_argument("--mode", choices=("closed", "open"), default="closed", help="closed or open loop (default: closed)")
    m.add_argument("--concurrency", type=_csv(int), default=[1, 8, 32],
                   help="closed loop: requests in flight, one step per value (default: 1,8,32)")
    m.add_argument("--rate", type=_csv(float), default=[100.0],
                   help="open loop: Poisson arrival rates in requests/s, one step per value (default: 100)")
    m.add_argument("--burst", type=_burst, default=None,
                   help="open loop: SIZE:PERIOD_S, SIZE extra requests at once every PERIOD_S seconds")
    m.add_argument("--duration", type=float, default=10.0, help="measured seconds per step (default: 10)")
    m.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds before each step (default: 2)")
    m.add_argument("--budget-ms", type=float, default=None,
                   help="per-request latency budget: the KServe `timeout` parameter (µs on the wire) and, over "
                        "gRPC, the call's deadline; over HTTP, the Batchline-Timeout-Ms header and the client's wait "
                        "for the answer; goodput counts OK answers within it (default: none)")
    m.add_argument("--priority", type=int, default=0, help="KServe `priority` parameter, 1 = highest (default: unset)")
    m.add_argument("--streaming", action="store_true",
                   help="send on ModelStreamInfer streams instead of unary calls (like perf_analyzer --streaming): "
                   "closed loop, one stream per in-flight slot, one request at a time; open loop, 4 streams "
                   "carrying every request, answers matched by id. The budget travels only in the `timeout` "
                   "parameter; a request unanswered 1 s past it counts DEADLINE_EXCEEDED")
    m.add_argument("--header", action="append", default=[], metavar="NAME=VALUE",
                   help="sent with every call: gRPC metadata, or with --protocol http an HTTP header, e.g. "
                   "authorization='Bearer TOKEN' (repeatable)")
    m.add_argument("--connections", type=int, default=1,
                   help="gRPC connections to open, calls and streams spread over them round robin: a server that "
                   "runs several gateway processes on one port (SO_REUSEPORT) spreads connections, not calls; "
                   "--protocol http opens one per request in flight instead (default: 1)")
    m.add_argument("--no-retry-after", dest="retry_after", action="store_false",
                   help="closed loop: resend a refused request at once, as perf_analyzer does (default: a worker "
                   "whose request was refused with a `retry-after-ms` hint, as batchline's admission control sends "
                   "(trailing metadata of a unary call, a parameter of a stream's error answer, an HTTP answer's "
                   "header), waits that long first)")
    m.add_argument("--max-outstanding", type=int, default=10_000,
                   help="open loop: requests due while this many are outstanding are counted as NOT_SENT "
                        "(default: 10000)")
    g = p.add_argument_group("inputs")
    g.add_argument("--shape", action="append", default=[], metavar="NAME=d0,d1,...",
                   help="full shape of an input incl. the batch dim, e.g. input_ids=1,128 (repeatable)")
    g.add_argument("--default-dim", type=int, default=16, help="size of dynamic non-batch dims (default: 16)")
    g.add_argument("--seq-len", type=int, default=None,
                   help="size of the dynamic non-batch dim of 2-D integer inputs (token ids, masks)")
    g.add_argument("--seq-len-dist", default=None, metavar="L1,L2,...|lognormal:MEAN:MAX",
                   help="token-style [batch, seq] inputs: each request's length drawn from these lengths, or from a "
                   "lognormal with that mean, capped at MAX (a long tail); instead of one --seq-len")
    g.add_argument("--texts", default=None, metavar="FILE",
                   help="one sentence a line: each request sends one on the model's text input (a model with a "
                   "[tokenizer]); the pool is every line, in a random order")
    g.add_argument("--int-range", action="append", default=[], metavar="NAME=LO:HI",
                   help="inclusive value range of an integer input, e.g. attention_mask=1:1 (repeatable)")
    g.add_argument("--pool-size", type=int, default=64, help="distinct pre-serialized requests (default: 64)")
    g.add_argument("--seed", type=int, default=0, help="random seed of inputs and arrivals (default: 0)")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="PATH", help="write every step's results as JSON")
    o.add_argument("--plot", metavar="PATH.png", help="write a PNG plot (closed: latency vs throughput; "
                   "open: goodput/throughput vs offered load)")
    o.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=main)


def add_parser(sub) -> argparse.ArgumentParser:
    """Register `bench` on the `batchline` subcommand parsers."""
    p = sub.add_parser("bench", help="benchmark a KServe v2 gRPC or HTTP endpoint (closed/open loop)",
                       description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    configure(p)
    return p


def _input_options(args: argparse.Namespace):
    from batchline.bench.inputs import InputError, InputOptions, parse_int_range, parse_seq_len_dist, parse_shape

    if args.default_dim < 0 or (args.seq_len is not None and args.seq_len < 0):
        raise InputError("--default-dim and --seq-len must be >= 0")
    return InputOptions(
        shapes=dict(parse_shape(s) for s in args.shape),
        int_ranges=dict(parse_int_range(s) for s in args.int_range),
        default_dim=args.default_dim, seq_len=args.seq_len, pool_size=args.pool_size, seed=args.seed,
        seq_lens=parse_seq_len_dist(args.seq_len_dist, args.seed) if args.seq_len_dist else None,
        texts=_texts(args.texts) if args.texts else [],
    )


def _texts(path: str) -> list[str]:
    from batchline.bench.inputs import InputError

    try:
        lines = [line.strip() for line in open(path, encoding="utf-8")]
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"--texts {path}: {exc}") from None
    lines = [line for line in lines if line]
    if not lines:
        raise InputError(f"--texts {path}: no sentences (one a line)")
    return lines


def main(args: argparse.Namespace) -> int:
    from batchline.bench import BenchConfig, BenchError, InputError, format_table, plot, run_bench, write_json

    def fail(message: str) -> int:
        print(f"batchline bench: error: {message}", file=sys.stderr, flush=True)
        return 2

    if args.connections < 1:
        return fail(f"--connections must be >= 1, got {args.connections}")
    headers = {}
    for h in args.header:
        name, sep, value = h.partition("=")
        if not sep or not name.strip():
            return fail(f"--header takes NAME=VALUE, got {h!r}")
        headers[name.strip()] = value
    if args.url is None:
        args.url = "127.0.0.1:8000" if args.protocol == "http" else "127.0.0.1:8001"
    try:
        config = BenchConfig(
            url=args.url, protocol=args.protocol, model=args.model, version=args.model_version, mode=args.mode,
            concurrency=args.concurrency, rate=args.rate, burst=args.burst, duration=args.duration,
            warmup=args.warmup, budget_ms=args.budget_ms, priority=args.priority,
            inputs=_input_options(args), max_outstanding=args.max_outstanding, streaming=args.streaming,
            retry_after=args.retry_after, connections=args.connections, headers=headers,
            progress=not args.quiet and sys.stderr.isatty(),
        )
        result = run_bench(config)
    except (BenchError, InputError) as exc:
        return fail(str(exc))
    except KeyboardInterrupt:
        return fail("interrupted")
    shapes = ", ".join(f"{k}={v}" for k, v in result.config["input_shapes"].items())
    budget = f", budget {args.budget_ms:g} ms" if args.budget_ms is not None else ""
    stream = " over ModelStreamInfer streams" if args.streaming else (" over HTTP" if args.protocol == "http" else "")
    print(f"{args.model} @ {args.url}: {args.mode} loop{stream}, {args.duration:g} s per step{budget}; inputs {shapes}")
    print(format_table(result.steps))
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    if args.plot:
        plot(args.plot, result)
        print(f"wrote {args.plot}")
    return 0


def standalone(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m batchline.bench", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    configure(p)
    args = p.parse_args(argv)
    return args.func(args)
