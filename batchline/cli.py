"""The `batchline` command: run the whole mesh locally, or build the demo models.

    batchline up                 Redis + executor(s) + scheduler + gateway, demo models by default
    batchline status             the mesh on one screen: scheduler, executors, gateways, queues
    batchline optimize MODEL     write a faster version of a model that passes an accuracy gate
    batchline tune MODEL         measure one executor's layouts for a model here, write the best to config.toml
    batchline build-models PATH  build the demo model repository (minilm, mlp, gpt) into PATH
    batchline bench ...          load a KServe v2 gRPC or HTTP endpoint, closed or open loop (see --help)
"""
from __future__ import annotations

import argparse
import os
import pathlib
import signal
import sys
import time

from batchline import logs
from batchline.autoscale import COOL_DOWN_S
from batchline.embedded_redis import RedisStartError
from batchline.redis_client import mask
from batchline.optimize import DEFAULT_VARIANTS, MIN_GAIN, VARIANTS
from batchline import tune as tuning
from batchline.mesh import Mesh, build_demo
from batchline.supervisor import say

DEFAULT_REPOSITORY = "model_repository"
# How often `up` looks whether a service died.
SUPERVISE_POLL_S = 0.2


def cmd_up(args: argparse.Namespace) -> int:
    mesh = Mesh(args)
    phase = "starting"

    def on_signal(signum, frame):
        # The services are in sessions of their own: they hear of a Ctrl-C only through this.
        nonlocal phase
        if phase == "stopping":
            mesh.hurry = True
            return
        starting, phase = phase == "starting", "stopping"
        say(args, "batchline: stopping (Ctrl-C again to kill what is left at once)")
        if starting:
            raise KeyboardInterrupt  # give up starting at once; `finally` stops what did start

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    code = 0
    try:
        address = mesh.start()
        if phase == "starting":
            phase = "up"
        restarts = (f"restarts counted at http://{args.host}:{mesh.metrics_port}/metrics; "
                    if mesh.metrics_port > 0 else "")
        rest = f"REST (KServe v2 HTTP) on {args.host}:{mesh.http_port}; " if mesh.http_port > 0 else ""
        say(args, f"batchline: up. Gateway (KServe v2 gRPC) listening on {address}; {rest}"
            f"Redis at {mask(mesh.redis.url if mesh.redis else mesh.redis_url)}; {restarts}Press Ctrl-C to stop.")
        while phase == "up":
            mesh.supervise()
            time.sleep(SUPERVISE_POLL_S)
    except KeyboardInterrupt:
        code = 130
    except RedisStartError as exc:
        say(args, f"batchline: cannot start Redis: {exc}", sys.stderr)
        code = 1
    except SystemExit as exc:
        if exc.code not in (None, 0):
            say(args, str(exc.code), sys.stderr)
            code = 1
    finally:
        mesh.stop()
    return code


def cmd_status(args: argparse.Namespace) -> int:
    from batchline import status

    return status.main(args.redis_url, args.json)


def _output_kinds(given: list[str], known: tuple[str, ...]) -> dict[str, str]:
    kinds = {}
    for item in given:
        name, _, kind = item.partition("=")
        if not name or kind not in known:
            raise SystemExit(f"batchline optimize: --output {item!r} must read NAME=KIND, "
                             f"KIND one of {', '.join(known)}")
        kinds[name] = kind
    return kinds


def cmd_optimize(args: argparse.Namespace) -> int:
    try:
        from batchline.optimize import gate, run, variants
    except ImportError as exc:  # onnx: the quantizer's
        raise SystemExit(f"batchline optimize needs {exc.name}: pip install 'batchline[optimize]'") from None

    options = run.Options(
        model=args.model, repository=pathlib.Path(args.repository), variants=tuple(args.variants.split(",")),
        calibration=pathlib.Path(args.calibration) if args.calibration else None,
        texts=pathlib.Path(args.texts) if args.texts else None,
        thresholds=gate.Thresholds(args.min_mean_cosine, args.min_p1_cosine, args.min_neighbour_overlap,
                                       max_abs_error=args.max_abs_error,
                                       min_argmax_agreement=args.min_argmax_agreement),
        int8=variants.Int8Options(tuple(t for t in args.int8_ops.split(",") if t), not args.per_tensor,
                                  args.weight_type),
        scratch=pathlib.Path(args.scratch) if args.scratch else None,
        min_gain=args.min_gain,
        outputs=_output_kinds(args.output, gate.KINDS),
    )
    try:
        report = run.optimize(options)
    except (run.OptimizeError, run.InputsError) as exc:
        print(f"batchline optimize: {exc}", file=sys.stderr, flush=True)
        return 2
    print(run.summary(report), flush=True)
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from batchline.tune import run

    options = run.Options(model=args.model, repository=pathlib.Path(args.repository), budget_ms=args.budget_ms,
                          concurrency=args.concurrency, duration_s=args.duration, min_gain=args.min_gain,
                          rounds=args.rounds,
                          dry_run=args.dry_run, seq_len=args.seq_len, progress=not args.no_progress)
    try:
        report = run.tune(options)
    except run.TuneError as exc:
        print(f"batchline tune: {exc}", file=sys.stderr, flush=True)
        return 2
    print(run.table(report), flush=True)
    return 0


# Sentences of Python's reference manual that judge the demo's INT8 minilm (build-models --int8).
DEMO_SENTENCES = 512


def cmd_build_models(args: argparse.Namespace) -> int:
    repo = pathlib.Path(args.path)
    build_demo(repo)
    if not args.int8 or (repo / "minilm" / "2").exists():
        return 0
    import tempfile

    from batchline.bench.sentences import python_doc_sentences
    from batchline.optimize import run

    with tempfile.TemporaryDirectory() as tmp:
        texts = pathlib.Path(tmp) / "python-reference-sentences.txt"
        texts.write_text("\n".join(python_doc_sentences(DEMO_SENTENCES)) + "\n")
        report = run.optimize(run.Options("minilm", repo, variants=("int8-dynamic",), texts=texts,
                                          scratch=pathlib.Path(tmp) / "scratch"))
    print(run.summary(report), flush=True)
    return 0 if report["written_version"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="batchline", description="batchline: a gRPC serving mesh for ONNX models.")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser(
        "up",
        help="run Redis, executors, the scheduler and the gateway locally",
        description="Start a local mesh: a private Redis (unless --redis-url), N executors, the scheduler "
        "and the gateway. Builds the demo model repository (minilm, mlp, and gpt, a small generative model) "
        "first if the repository path does not exist. A service that exits is restarted "
        "(with a growing backoff; --max-restarts "
        "bounds a crash loop), the embedded Redis too (one that cannot start again stops the mesh). Ctrl-C "
        "stops every process it started: the gateways first (they answer the requests they hold), then the "
        "scheduler, then the executors, Redis last; a second Ctrl-C kills what is left.",
    )
    up.add_argument("--model-repository", default=DEFAULT_REPOSITORY,
                    help="model repository to serve; the demo models are built there if it does not exist, or its "
                         "demo build was cut short (default: "
                         f"{DEFAULT_REPOSITORY})")
    up.add_argument("--model-control-mode", choices=("none", "poll", "explicit"), default="none",
                    help="none: serve what the repository holds at start; poll: re-scan it every --repository-poll-s "
                    "and load new versions / release removed ones while serving; explicit: serve the --load-model "
                    "models and what RepositoryModelLoad / RepositoryModelUnload ask for (default: none)")
    up.add_argument("--repository-poll-s", type=float, default=5.0,
                    help="poll mode: seconds between scans of the repository (default: 5)")
    up.add_argument("--load-model", action="append", default=[], metavar="NAME",
                    help="explicit mode: load this model at start (repeatable)")
    up.add_argument("--redis-url", default="",
                    help="use this Redis instead of starting a private one: redis://, rediss://, unix://; behind "
                    "Sentinel, redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER; a Redis Cluster, "
                    "redis+cluster://HOST:PORT[,HOST:PORT...]")
    up.add_argument("--redis-password", default=None,
                    help="the password of the private Redis (default: a random one; '' for none): printed as ***, "
                    "give it to `batchline status --redis-url redis://:PASSWORD@...`")
    up.add_argument("--executors", type=int, default=1, help="number of executor processes (default: 1)")
    up.add_argument("--autoscale", default="", metavar="MIN:MAX",
                    help="start and stop executors between MIN and MAX as the leader scheduler's forecast of "
                    "demand asks (batchline status shows it; docs/guides/scaling.md): more at once, fewer after "
                    "--scale-down-cool-down-s; a stopping executor drains. Starts with --executors, within the "
                    "bounds (default: off, --executors run)")
    up.add_argument("--scale-down-cool-down-s", type=float, default=COOL_DOWN_S,
                    help="--autoscale: how long fewer executors must be wanted before some stop; while every "
                         "rise has been foreseen, the forecast's horizon if that is shorter (default: "
                         f"{COOL_DOWN_S:g})")
    up.add_argument("--gateways", type=int, default=1,
                    help="number of gateway processes, all on the gateway port (SO_REUSEPORT: the kernel spreads "
                    "connections over them); one gateway process uses about one core (default: 1)")
    up.add_argument("--max-restarts", type=int, default=5,
                    help="a service that crashes more often than this within 60 s, or in a row with no run "
                    "lasting 30 s, is in a crash loop: the mesh stops and names it; below that, crashed services "
                    "are restarted (default: 5)")
    up.add_argument("--gateway-port", type=int, default=8001,
                    help="gateway gRPC port; 0 = any free port (default: 8001)")
    up.add_argument("--http-port", type=int, default=8000,
                    help="gateway KServe v2 HTTP/REST port, beside gRPC's; 0 = any free port, -1 = none "
                    "(default: 8000)")
    up.add_argument("--host", default="127.0.0.1", help="interface the services bind to (default: 127.0.0.1)")
    up.add_argument("--metrics-port", type=int, default=8002,
                    help="Prometheus endpoints on consecutive ports from this one: gateway-0, gateway-1, ..., the "
                    "scheduler, executor-0, executor-1, ... (as many as --executors, or MAX with --autoscale), "
                    "then `batchline up` itself (batchline_restarts_total, batchline_scale_events_total, "
                    "batchline_demand_reads_total); "
                    "0 = any free ports, -1 = none (default: 8002)")
    up.add_argument("--log-level", default=os.environ.get("BATCHLINE_LOG_LEVEL", "INFO"),
                    help="log level of the services (default: $BATCHLINE_LOG_LEVEL, else INFO)")
    up.add_argument("--auth-file", default="",
                    help="TOML file of the tokens that may call the gateways, with their tenants and model scopes "
                    "(docs/guides/security.md) (default: none, unauthenticated)")
    up.add_argument("--tls-cert", default="", help="PEM certificate the gateways serve TLS with (with --tls-key); "
                    "re-read when the file changes (default: plaintext)")
    up.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    up.add_argument("--tls-client-ca", default="",
                    help="PEM CA: clients must present a certificate signed by it (mutual TLS; needs --tls-cert)")
    up.add_argument("--log-format", choices=logs.FORMATS, default="text",
                    help="text, or json: one JSON object a line, from every service and from `batchline up` itself, "
                    "with the service and, when there is one, the request id, the batch id and the trace id "
                    "(default: text)")
    up.add_argument("--startup-timeout", type=float, default=120.0,
                    help="seconds to wait for the mesh to come up (default: 120)")
    up.set_defaults(func=cmd_up)

    st = sub.add_parser(
        "status", help="show the mesh: leader scheduler, executors, gateways, queue depths",
        description="Read the mesh's state from its Redis: the leader scheduler; each executor with its models, "
        "the execution provider each runs on, its busy share over its last heartbeat interval and its heartbeat "
        "age; each live gateway; the requests waiting per model and priority level, for every model served and every "
        "queue that holds requests (one no executor serves is marked so). Errors go to stderr, with exit code 1.")
    st.add_argument("--redis-url", default=os.environ.get("BATCHLINE_REDIS_URL", "redis://127.0.0.1:6379/0"),
                    help="the mesh's Redis (`batchline up` prints it) (default: $BATCHLINE_REDIS_URL, else "
                    "redis://127.0.0.1:6379/0)")
    st.add_argument("--json", action="store_true", help="print one JSON object instead of the screen")
    st.set_defaults(func=cmd_status)

    opt = sub.add_parser(
        "optimize", help="write a faster version of a model that passes an accuracy gate",
        description="Try optimized variants of MODEL's latest version (ONNX Runtime's graph optimizations, INT8 "
        "dynamic and static quantization, FP16), judge each against FP32 on the given inputs (or generated ones), "
        "time each against FP32 here, and write the fastest that passes the gate as the next version, with its "
        "report (optimize.json). A variant that fails the gate is never written: it stays in the scratch "
        "directory for inspection. Needs the [optimize] extra.")
    opt.add_argument("model", help="the model's name (its directory in the repository)")
    opt.add_argument("--repository", default=DEFAULT_REPOSITORY,
                     help=f"model repository (default: {DEFAULT_REPOSITORY})")
    opt.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                     help=f"comma-separated, from {', '.join(VARIANTS)} (default: all; "
                          "int8-static and tensorrt-int8 only with inputs)")
    opt.add_argument("--calibration", default="", help=".npz with one array per model input (rows first): judges "
                     "the variants and calibrates int8-static and tensorrt-int8")
    opt.add_argument("--texts", default="", help="text file, one sentence a line, tokenized as the model's "
                     "[tokenizer] table in config.toml says (as the gateway does): as --calibration, for a text model")
    opt.add_argument("--output", action="append", default=[], metavar="NAME=KIND",
                     help="judge output NAME as KIND: embedding (cosines, nearest neighbours), classes (argmax "
                     "agreement) or values (absolute error); repeatable; over config.toml's [optimize] outputs "
                     "(default: by the output's name and values, docs/guides/optimize.md)")
    opt.add_argument("--min-mean-cosine", type=float, default=0.99,
                     help="embeddings: mean cosine to FP32 (default: 0.99)")
    opt.add_argument("--min-p1-cosine", type=float, default=0.98,
                     help="embeddings: 1st percentile cosine (default: 0.98)")
    opt.add_argument("--min-neighbour-overlap", type=float, default=0.9,
                     help="embeddings: share of each one's top-10 neighbours kept (default: 0.9)")
    opt.add_argument("--max-abs-error", type=float, default=0.05,
                     help="other outputs: largest absolute error (default: 0.05)")
    opt.add_argument("--min-argmax-agreement", type=float, default=0.99,
                     help="classes outputs with more than one column: share of rows whose argmax is kept "
                          "(default: 0.99)")
    opt.add_argument("--int8-ops", default="MatMul",
                     help="op types INT8 quantizes, comma-separated; empty = all (default: MatMul)")
    opt.add_argument("--per-tensor", action="store_true", help="quantize weights per tensor, not per channel")
    opt.add_argument("--weight-type", choices=("auto", "QInt8", "QUInt8"), default="auto",
                     help="INT8 weight type (default: auto: QInt8 on a CPU with VNNI or AMX, whose 8-bit products are "
                     "exact, else QUInt8)")
    opt.add_argument("--min-gain", type=float, default=MIN_GAIN,
                     help="write the fastest variant that passed the gate only if it serves at least this many times "
                     f"FP32's throughput here (default: {MIN_GAIN}; 0 writes it whatever its speed)")
    opt.add_argument("--scratch", default="",
                     help="where the variants are written (default: a new temporary directory, kept)")
    opt.set_defaults(func=cmd_optimize)

    tn = sub.add_parser(
        "tune", help="measure one executor's layouts for a model on this host and write the best to its config.toml",
        description="Serve the model through a real local mesh (a private Redis, one executor, the scheduler, a "
        "gateway on free ports) in each layout of one executor: its config.toml's instance_count x intra_op_threads "
        "(the splits of this host's cores), then the best split's max_batch_size halved and doubled, for each "
        "version the repository holds (an INT8 one `batchline optimize` wrote among them); load each with a closed "
        "loop whose requests carry the budget, and write the layout with the most answers within the budget into "
        "config.toml (tune.json beside it says why), unless the current one is already best or the best gains less "
        f"than --min-gain in --rounds side-by-side rounds of the current one and the {tuning.FINALISTS - 1} layouts "
        "that served most in the search. Prints the table either way. "
        "Measure on the host that will serve, as quiet as it can be.",
    )
    tn.add_argument("model", help="the model's name (its directory in the repository)")
    tn.add_argument("--repository", default=DEFAULT_REPOSITORY,
                    help=f"model repository (default: {DEFAULT_REPOSITORY})")
    tn.add_argument("--budget-ms", type=float, default=0.0,
                    help="each request's latency budget (default: the model's default_timeout_ms)")
    tn.add_argument("--concurrency", type=int, default=tuning.CONCURRENCY,
                    help=f"requests kept in flight while a layout is measured (default: {tuning.CONCURRENCY})")
    tn.add_argument("--duration", type=float, default=tuning.MEASURE_S,
                    help=f"measured seconds per layout, after {tuning.WARMUP_S:g} s of warm-up (default: "
                         f"{tuning.MEASURE_S:g})")
    tn.add_argument("--seq-len", type=int, default=None, help="tokens per request for a model with token inputs "
                    "(default: the load generator's)")
    tn.add_argument("--min-gain", type=float, default=tuning.MIN_GAIN,
                    help="write the best layout only if it serves this many times the current one (default: "
                         f"{tuning.MIN_GAIN:g})")
    tn.add_argument("--rounds", type=int, default=tuning.ROUNDS,
                    help=f"rounds in which the current layout and the search's {tuning.FINALISTS - 1} best are "
                         "measured again side by side, each judged by the median of its ratios to the current one "
                         f"(default: {tuning.ROUNDS})")
    tn.add_argument("--dry-run", action="store_true", help="measure and print the table; write nothing")
    tn.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    tn.set_defaults(func=cmd_tune)

    build = sub.add_parser("build-models", help="build the demo model repository",
                           description="Export the demo models (minilm, mlp, gpt) to ONNX into PATH "
                                       "(needs the [demo] extra).")
    build.add_argument("path", nargs="?", default=DEFAULT_REPOSITORY,
                       help=f"repository path (default: {DEFAULT_REPOSITORY})")
    build.add_argument("--int8", action="store_true",
                       help=f"also write minilm version 2, INT8, with `batchline optimize` judged on {DEMO_SENTENCES} "
                       "sentences of Python's reference manual (needs the [optimize] extra; nothing is downloaded); "
                       "exits 1 if "
                       "no variant passes the gate and is faster here")
    build.set_defaults(func=cmd_build_models)

    from batchline.bench.cli import add_parser as add_bench_parser

    add_bench_parser(sub)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
