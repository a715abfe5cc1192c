"""batchline against Triton at its best, side by side: the same ONNX files, the same client, alternating rounds.

    python benchmarks/vs_triton.py [--rounds 3] [--duration 10] [--workloads mlp 16 128]
                                   [--peer-python /work/peers/triton/bin/python]

Triton runs through nvidia-pytriton (PyPI; it ships Triton's server binary) in its own virtualenv
(`python -m venv /work/peers/triton && /work/peers/triton/bin/pip install nvidia-pytriton onnxruntime
numpy`), ONNX Runtime in its Python backend (benchmarks/peers/pytriton_server.py). batchline runs as
`batchline up` would, untuned.

1. The sweep. Triton is compared at its best on this host, not with batchline's settings: for each
   workload the script first sweeps Triton's own settings, --sweep-duration seconds a step: every
   layout (1 instance x 2 threads, 2 x 1, ONNX Runtime's thread spinning on and off) at every
   `max_queue_delay` (0, 0.5, 1, 2, 5, 10 ms). The best setting is the one with the most
   requests/s. It prints every step.
2. The comparison. Each round measures every workload on batchline, on Triton at its best setting
   and on Triton "as config.toml says" (its dynamic batcher and instances set from batchline's
   config.toml, as batchline's executor reads it), the order rotating from round to round, with
   the same `batchline bench` client (tritonclient's grpc.aio stubs). Triton at its best is the
   one of its two settings that served more over the rounds (a short sweep step on a shared host
   can pick a setting that does not hold up). It prints each round's requests/s and p50/p99, the
   median over rounds of batchline/Triton for throughput and latency against Triton at its best
   and as config.toml says, and the CPU each request took per process (psutil, over the measured
   window).

The text workload sends batchline the sentences of benchmarks/lengths.py as text (tokenized by its
gateway, batched by length); Triton's client sends token ids padded to 128, as Triton users do
without ragged batching (padded, the run costs the same whatever the tokens' values).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import pathlib
import queue
import signal
import statistics
import subprocess
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass, field

import _common
import lengths
from batchline.bench import InputOptions, StepResult, run_closed

PEER_SERVER = pathlib.Path(__file__).resolve().parent / "peers" / "pytriton_server.py"
DEFAULT_PEER_PYTHON = "/work/peers/triton/bin/python"
# Triton starts in seconds; after a crash its restart has been seen to hang before it is ready, so
# a start that is not ready in this long is tried again, START_TRIES times in all.
START_TIMEOUT_S = 60.0
START_TRIES = 3


@dataclass(frozen=True)
class Workload:
    name: str
    model: str
    concurrency: int
    streaming: bool = False
    seq_len: int | None = None
    # Real sentences of many lengths (benchmarks/lengths.py's workload): batchline gets the text;
    # Triton's client tokenizes and pads to `seq_len` tokens, as Triton users do without ragged batching.
    texts: bool = False
    protocol: str = "grpc"  # or "http": KServe v2 REST with binary tensors (rest.py), Triton swept over it too


WORKLOADS = [
    Workload("mlp unary, 1 in flight", "mlp", 1),
    Workload("mlp unary, 32 in flight", "mlp", 32),
    Workload("mlp streams, 1 in flight", "mlp", 1, streaming=True),
    Workload("mlp streams, 32 in flight", "mlp", 32, streaming=True),
    Workload("minilm 16 tokens, 32 in flight", "minilm", 32, seq_len=16),
    Workload("minilm 128 tokens, 32 in flight", "minilm", 32, seq_len=128),
    Workload("minilm text of real lengths, 32 in flight (Triton: padded to 128)", "minilm", 32, seq_len=128,
             texts=True),
]


@dataclass
class Run:
    step: StepResult
    cpu_ms: dict[str, float] = field(default_factory=dict)  # per request, per process role

    @property
    def p50(self) -> float:
        return (self.step.latency_ms or {}).get("p50", float("nan"))

    @property
    def p99(self) -> float:
        return (self.step.latency_ms or {}).get("p99", float("nan"))


class PeerDown(Exception):
    """Triton's server did not come up."""


class Triton:
    """Triton through pytriton, as a subprocess in its own session; restarted when it dies.

    Under ModelStreamInfer load Triton's Python backend (which pytriton's models run in) can die of a
    SIGSEGV (a known class of crashes: triton-inference-server/server#8882); a step that lost its
    server is measured again on a fresh one, and the crash is counted and reported.
    """

    def __init__(self, repository: pathlib.Path, peer_python: str):
        self.repository = repository
        self.peer_python = peer_python
        self.proc: subprocess.Popen | None = None
        self.address = ""
        self.http_address = ""  # its KServe v2 HTTP endpoint
        self.crashes = 0
        self.failed_starts = 0
        self.flags: tuple[str, ...] = ()  # pytriton_server.py's: the models and Triton's settings

    def serve(self, flags: tuple[str, ...]) -> None:
        """Serve with these settings: a fresh server unless the one up already has them."""
        if self.alive() and flags == self.flags:
            return
        self.stop()
        self.flags = flags
        self.start()

    def start(self) -> "Triton":
        """Start the server; a start that fails is tried again (START_TRIES in all): pytriton's stubs,
        spawned together for two instances, now and then fail in multiprocessing's resource tracker
        and leave the model unloaded (counted in `failed_starts`)."""
        for attempt in range(START_TRIES):
            try:
                return self._start()
            except PeerDown:
                self.failed_starts += 1
                if attempt == START_TRIES - 1:
                    raise
        raise AssertionError("unreachable")

    def _start(self) -> "Triton":
        env = dict(os.environ)
        # pytriton's Triton binary links against libpython from the interpreter's LIBDIR.
        env["LD_LIBRARY_PATH"] = ":".join(filter(None,
                                                 [sysconfig.get_config_var("LIBDIR"), env.get("LD_LIBRARY_PATH")]))
        self.proc = subprocess.Popen([self.peer_python, str(PEER_SERVER), "--model-repository", str(self.repository),
                                      *self.flags],
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     start_new_session=True)
        ready: queue.Queue[str] = queue.Queue()

        def read(stdout) -> None:
            for line in stdout:
                if line.startswith("ready "):
                    ready.put(line)
                    stdout.read()  # keep draining Triton's log so that it never blocks on a full pipe
                    return
            ready.put("")  # the server exited before it was ready

        threading.Thread(target=read, args=(self.proc.stdout,), daemon=True).start()
        try:
            line = ready.get(timeout=START_TIMEOUT_S)
        except queue.Empty:
            line = ""  # seen after a crash: a restarted server that never says it is ready
        if line:
            self.address = f"127.0.0.1:{int(line.split()[1])}"
            self.http_address = f"127.0.0.1:{int(line.split()[2])}"
            return self
        code = self.proc.poll()
        self.stop()
        why = f"exited with code {code}" if code is not None else f"not ready within {START_TIMEOUT_S:g} s"
        raise PeerDown(f"Triton did not start ({why}); run {PEER_SERVER.name} by hand to see why")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        # Its model processes, should any outlive the server.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc = None


@functools.cache
def _texts() -> list[str]:
    return lengths.workload()


def measure(address: str, w: Workload, args, peer: bool = False) -> Run:
    # Padded to seq_len, what the peer runs costs the same whatever the tokens' values.
    inputs = InputOptions(texts=_texts()) if w.texts and not peer else InputOptions(seq_len=w.seq_len)
    before = _common.cpu_seconds(rest="triton")
    t0 = time.monotonic()
    step = run_closed(address, w.model, w.concurrency, args.duration, warmup=args.warmup,
                      budget_ms=_common.CAPACITY_BUDGET_MS, inputs=inputs, streaming=w.streaming,
                      protocol=w.protocol)
    after = _common.cpu_seconds(rest="triton")
    # The CPU of the warm-up is in the deltas too: spread it over the requests of both windows.
    elapsed = time.monotonic() - t0
    requests = max(1, step.throughput_rps * elapsed)
    cpu = {k: (after[k] - before.get(k, 0.0)) * 1e3 / requests for k in after}
    return Run(step, cpu)


def measure_peer(peer: Triton, w: Workload, args, setting: "Setting", attempts: int = 3) -> Run | None:
    """A step on Triton with `setting`; measured again on a fresh server when Triton died during it
    (its wrapper process may outlive it: a step answered UNAVAILABLE, or one that cannot connect, is the sign)."""
    flags = ("--models", w.model, *setting.flags)
    for _ in range(attempts):
        try:
            peer.serve(flags)
        except PeerDown as exc:
            print(f"{exc}; trying again", flush=True)
            continue
        try:
            run = measure(peer.http_address if w.protocol == "http" else peer.address, w, args, peer=True)
        except Exception as exc:  # noqa: BLE001 - the server died before or as the step connected
            print(f"Triton unreachable for '{w.name}' ({exc}); restarting it", flush=True)
            peer.crashes += 1
            peer.stop()
            continue
        if not run.step.status_counts.get("UNAVAILABLE"):
            return run
        print(f"Triton died during '{w.name}' ({run.step.status_counts}); measuring it again on a fresh server",
              flush=True)
        peer.crashes += 1
        peer.stop()  # the next attempt, or the next step, starts a fresh one
    print(f"Triton died {attempts} times in a row during '{w.name}': no figure for it this round", flush=True)
    return None


@dataclass(frozen=True)
class Setting:
    """Triton's settings for a workload's model; the defaults: as batchline's config.toml says."""
    instances: int = 0             # 0: config.toml's instance_count, each on cores / instances threads
    threads: int = 0
    spinning: bool = False
    delay_ms: float | None = None  # max_queue_delay; None: config.toml's

    @property
    def flags(self) -> tuple[str, ...]:
        flags = ["--spinning" if self.spinning else "--no-spinning"]
        if self.instances:
            flags += ["--instances", str(self.instances), "--threads", str(self.threads)]
        if self.delay_ms is not None:
            flags += ["--max-queue-delay-ms", f"{self.delay_ms:g}"]
        return tuple(flags)

    @property
    def name(self) -> str:
        if self == AS_CONFIGURED:
            return "as config.toml says"
        delay = "config.toml's delay" if self.delay_ms is None else f"delay {self.delay_ms:g} ms"
        return f"{self.instances}x{self.threads}, spinning {'on' if self.spinning else 'off'}, {delay}"


AS_CONFIGURED = Setting()
LAYOUTS = [(1, 2), (2, 1)]                 # instances x ONNX Runtime threads, on 2 cores
DELAYS_MS = [0.0, 0.5, 1.0, 2.0, 5.0, 10.0]


def sweep(peer: Triton, w: Workload, args) -> tuple[Setting, list[tuple[Setting, Run | None]]]:
    """Triton's best setting for `w` on this host: every layout at every queue delay. (A layout
    picked at one delay and the delay swept with it alone can miss: at config.toml's 10 ms the
    layouts may tie, and at 0 ms one of them serves twice the other.)"""
    quick = argparse.Namespace(**{**vars(args), "duration": args.sweep_duration, "warmup": args.sweep_warmup})
    steps: list[tuple[Setting, Run | None]] = []

    def served(setting: Setting) -> float:
        run = measure_peer(peer, w, quick, setting)
        steps.append((setting, run))
        print(f"sweep {w.name:32s} {setting.name:40s} " + (
            f"{run.step.throughput_rps:8.0f}/s p50 {run.p50:6.1f} ms p99 {run.p99:6.1f} ms" if run else "no figure"),
            flush=True)
        return run.step.throughput_rps if run else 0.0

    for i, t in LAYOUTS:
        for spin in (False, True):
            for delay in DELAYS_MS:
                served(Setting(i, t, spin, delay))
    measured = [(st, run) for st, run in steps if run is not None]
    best = max(measured, key=lambda sr: sr[1].step.throughput_rps)[0] if measured else AS_CONFIGURED
    return best, steps


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def report(w: Workload, ours: list[Run], theirs: list[Run | None]) -> list[list[str]]:
    f = _common.f
    pairs = [(o, t) for o, t in zip(ours, theirs) if t is not None]
    if not pairs:
        return [[w.name, "Triton crashed in every round", *[""] * 7]]
    ours, theirs = [o for o, _ in pairs], [t for _, t in pairs]
    thr = statistics.median(ratio(o.step.throughput_rps, t.step.throughput_rps) for o, t in zip(ours, theirs))
    p50 = statistics.median(ratio(o.p50, t.p50) for o, t in zip(ours, theirs))
    p99 = statistics.median(ratio(o.p99, t.p99) for o, t in zip(ours, theirs))
    rounds = "; ".join(f"{o.step.throughput_rps:.0f} vs {t.step.throughput_rps:.0f}" for o, t in zip(ours, theirs))
    return [[w.name, f(thr, ".2f"), f(p50, ".2f"), f(p99, ".2f"),
             f(statistics.median(o.p50 for o in ours)), f(statistics.median(t.p50 for t in theirs)),
             f(statistics.median(o.p99 for o in ours)), f(statistics.median(t.p99 for t in theirs)), rounds]]


def cpu_table(results: dict[Workload, tuple[list[Run], list[Run]]]) -> str:
    roles = ["client", "gateway", "redis", "scheduler", "executor"]
    rows = [["workload", *roles, "batchline total", "client (Triton)", "triton", "Triton total"]]
    for w, (ours, theirs) in results.items():
        med = {r: statistics.median(o.cpu_ms.get(r, 0.0) for o in ours) for r in roles}
        theirs = [t for t in theirs if t is not None] or [Run(StepResult(mode="closed"))]
        client_t = statistics.median(t.cpu_ms.get("client", 0.0) for t in theirs)
        server_t = statistics.median(t.cpu_ms.get("triton", 0.0) for t in theirs)
        rows.append([w.name, *(f"{med[r]:.3f}" for r in roles), f"{sum(med.values()):.3f}",
                     f"{client_t:.3f}", f"{server_t:.3f}", f"{client_t + server_t:.3f}"])
    return _common.table(rows)


SIDES = ["batchline", "Triton, the sweep's pick", "Triton as config.toml says"]
DEFAULT_WORKLOADS = ["mlp unary, 32", "minilm 16", "minilm 128"]


def main() -> int:
    p = _common.arg_parser(__doc__.splitlines()[0], progress=False)
    _common.step_args(p, duration=10.0, rounds=3)
    p.add_argument("--sweep-duration", type=float, default=5.0, help="measured seconds per sweep step (default: 5)")
    p.add_argument("--sweep-warmup", type=float, default=2.0, help="warm-up seconds per sweep step (default: 2)")
    p.add_argument("--peer-python", default=DEFAULT_PEER_PYTHON,
                   help=f"the Python of the virtualenv with nvidia-pytriton (default: {DEFAULT_PEER_PYTHON})")
    p.add_argument("--workloads", nargs="*", default=DEFAULT_WORKLOADS,
                   help="only the workloads whose name contains one of these (default: the targets' "
                        f"{DEFAULT_WORKLOADS}; '' for every workload)")
    args = p.parse_args()
    if not pathlib.Path(args.peer_python).exists():
        raise SystemExit(f"no {args.peer_python}: create the peer's virtualenv as this script's docstring says")
    workloads = [w for w in WORKLOADS if any(k in w.name for k in args.workloads)]
    repo = _common.ensure_repository(args.model_repository)
    print(f"machine: {_common.machine()}")
    results: dict[Workload, dict[str, list[Run | None]]] = {w: {side: [] for side in SIDES} for w in workloads}
    sweeps: dict[Workload, tuple[Setting, list[tuple[Setting, Run | None]]]] = {}
    peer = Triton(repo, args.peer_python)
    with _common.mesh(repo, log_level=args.log_level) as ours:
        try:
            for w in workloads:
                sweeps[w] = sweep(peer, w, args)
                print(f"Triton's best for '{w.name}': {sweeps[w][0].name}", flush=True)
            for r in range(args.rounds):
                for w in workloads:
                    for side in SIDES[r % 3:] + SIDES[:r % 3]:
                        if side == "batchline":
                            run = measure(ours, w, args)
                        else:
                            run = measure_peer(peer, w, args, sweeps[w][0] if side == SIDES[1] else AS_CONFIGURED)
                        results[w][side].append(run)
                        if run is not None:
                            print(f"round {r + 1} {w.name:32s} {side:26s} {run.step.throughput_rps:8.0f}/s "
                                  f"p50 {run.p50:6.1f} ms p99 {run.p99:6.1f} ms  {run.step.status_counts}", flush=True)
        finally:
            peer.stop()
    f = _common.f
    print(f"\nThe sweep of Triton's settings ({args.sweep_duration:g} s a step):")
    rows = [["workload", "Triton setting", "req/s", "p50 ms", "p99 ms", ""]]
    for w, (best, steps) in sweeps.items():
        rows += [[w.name, st.name, f(run.step.throughput_rps, ".0f") if run else "-", f(run.p50) if run else "-",
                  f(run.p99) if run else "-", "best" if st == best else ""] for st, run in steps]
    print(_common.table(rows))
    # The pick is by throughput: the tail a p99 ratio is judged against may be Triton's best one elsewhere.
    for w, (best_setting, steps) in sweeps.items():
        measured = [(st, run) for st, run in steps if run is not None]
        if not measured:
            continue
        top = max(run.step.throughput_rps for _, run in measured)
        st, run = min(((st, run) for st, run in measured if run.step.throughput_rps >= 0.95 * top),
                      key=lambda sr: sr[1].p99)
        print(f"'{w.name}': Triton's lowest p99 in the sweep within 5% of its best throughput: {f(run.p99)} ms "
              f"({st.name}{', the pick' if st == best_setting else ''})")
    head = ["workload", "thr ratio", "p50 ratio", "p99 ratio", "p50 bl", "p50 Triton", "p99 bl", "p99 Triton",
            "rounds (req/s, batchline vs Triton)"]
    # A 5 s sweep step is noisy on a shared host: Triton at its best is whichever of the sweep's pick
    # and batchline's settings served more over the rounds.
    best = {w: max(SIDES[1:], key=lambda side: statistics.median(
        r.step.throughput_rps if r else 0.0 for r in by[side])) for w, by in results.items()}
    for title, side_of in (("Triton at its best", best), (SIDES[2], {w: SIDES[2] for w in results})):
        print(f"\nbatchline / {title}, median of {args.rounds} rotating rounds (ratios > 1: batchline serves more; "
              "latency ratios < 1: batchline answers sooner)")
        rows = [head] + [row for w, by in results.items() for row in report(w, by["batchline"], by[side_of[w]])]
        print(_common.table(rows))
    for w, side in best.items():
        print(f"Triton at its best for '{w.name}': "
              + (sweeps[w][0].name if side == SIDES[1]
                 else "as config.toml says (it served more than the sweep's pick)"))
    print("\nCPU per request, ms (median over rounds; the warm-up's requests included; Triton at its best):")
    print(cpu_table({w: (by["batchline"], by[best[w]]) for w, by in results.items()}))
    if peer.crashes:
        print(f"\nTriton's Python backend died {peer.crashes} time(s) during the run; those steps were measured again.")
    if peer.failed_starts:
        print(f"Triton failed to start {peer.failed_starts} time(s) and was started again.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
