"""Overload against Triton at its best: batchline untuned against Triton's REJECT queue policy with its
queue cap swept, as the offered load rises past capacity.

    python benchmarks/overload_vs_triton.py [--model minilm] [--seq-len 16] [--budget-ms 200] [--factors 1,2,3,4]
                                            [--rounds 3]

1. batchline's capacity at the budget (--model: minilm at --seq-len tokens, closed loop at 4 to 32
   in flight; or mlp, whose requests cost the model so little that the gateway's own per-call CPU
   bounds what the mesh takes in, at 8 to 64: the best goodput with 99% of the requests, or of the
   admitted ones, answered OK within --budget-ms).
2. For each factor f of --factors, open-loop Poisson arrivals at f x that capacity, every request
   with a --budget-ms deadline:
   - the sweep: Triton (benchmarks/peers/pytriton_server.py) with its REJECT queue policy, the queue
     timeout at the budget (a request queued longer is rejected rather than run late): first its
     layout on this host (instances x threads 1x2 and 2x1, ONNX Runtime spinning off and on, at
     --triton-delay-ms, max_queue_size 16) by goodput at the first factor of 2 or more, then with
     that layout each `max_queue_size` of --queue-caps, one run each per factor;
   - the comparison: batchline, untuned, against Triton at the cap that served the most good
     requests, --rounds rotating rounds.
   It prints the sweep, then per factor the median goodput (OK answers within the budget per
   second) of both, goodput / batchline's capacity, the ratio batchline / Triton, the shares each
   refused (batchline RESOURCE_EXHAUSTED, Triton's full queue UNAVAILABLE) and let time out
   (DEADLINE_EXCEEDED, the server's or the client's own), and how much of its 2x goodput each keeps
   at 3x.

Triton runs in its own virtualenv (vs_triton.py's docstring says how).
"""
from __future__ import annotations

import statistics
import sys
from typing import Callable

import _common
import overload
from batchline.bench import BenchError, InputOptions, StepResult, run_closed, run_open
from vs_triton import DEFAULT_PEER_PYTHON, PeerDown, Setting, Triton

# Triton's layouts swept on the host (instances x threads, spinning), at the queue cap the layout is judged at.
LAYOUTS = [(1, 2), (2, 1)]
LAYOUT_CAP = 16


# Per model: the closed-loop concurrencies batchline's capacity is the best of.
CAPACITY_SWEEP = {"minilm": [4, 8, 12, 16, 24, 32], "mlp": [8, 16, 32, 64]}


def peer_flags(model: str, layout: Setting, cap: int, budget_ms: float) -> tuple[str, ...]:
    return ("--models", model, *layout.flags, "--max-queue-size", str(cap), "--queue-timeout-ms", f"{budget_ms:g}")


# What each refuses with: batchline's admission RESOURCE_EXHAUSTED, Triton's full queue (REJECT) UNAVAILABLE.
REFUSED = ("RESOURCE_EXHAUSTED", "UNAVAILABLE")
TIMED_OUT = ("DEADLINE_EXCEEDED",)


def _share(runs: list[StepResult], statuses: tuple[str, ...]) -> str:
    """The median share of the requests sent that ended with one of `statuses`, in percent."""
    shares = [sum(st.status_counts.get(s, 0) for s in statuses) / max(1, st.sent) for st in runs]
    return f"{100 * statistics.median(shares):.0f}%"


def on_peer(peer: Triton, flags: tuple[str, ...], step: Callable[[str], StepResult], attempts: int = 3) -> StepResult:
    """`step` against Triton serving with `flags`, measured again on a fresh server when Triton died
    (vs_triton.py's Triton says how it can): a step that cannot connect, or that no request got an
    answer from (its REJECT policy answers UNAVAILABLE, so that status alone does not tell)."""
    for attempt in range(attempts):
        peer.serve(flags)
        try:
            st = step(peer.address)
        except BenchError as exc:
            print(f"Triton unreachable ({exc}); restarting it", flush=True)
        else:
            if st.status_counts.get("OK") or attempt == attempts - 1:
                return st
            print(f"Triton answered nothing ({st.status_counts}); measuring again on a fresh server", flush=True)
        peer.crashes += 1
        peer.stop()
    raise PeerDown(f"Triton died {attempts} times in a row")


def main() -> int:
    p = _common.arg_parser(__doc__.splitlines()[0], progress=False)
    p.add_argument("--model", choices=sorted(CAPACITY_SWEEP), default="minilm", help="the model (default: minilm)")
    p.add_argument("--seq-len", type=int, default=16, help="minilm tokens per request (default: 16)")
    p.add_argument("--budget-ms", type=float, default=200.0, help="per-request budget (default: 200)")
    p.add_argument("--factors", default="1,2,3,4", help="offered load / batchline's capacity (default: 1,2,3,4)")
    p.add_argument("--queue-caps", default="8,16,32,64", help="Triton's max_queue_size values (default: 8,16,32,64)")
    p.add_argument("--sweep-duration", type=float, default=8.0, help="measured seconds per sweep run (default: 8)")
    p.add_argument("--triton-delay-ms", type=float, default=0.5,
                   help="Triton's max_queue_delay (default: 0.5, its best for minilm 16 tokens in vs_triton.py)")
    p.add_argument("--peer-python", default=DEFAULT_PEER_PYTHON,
                   help=f"the Python of the virtualenv with nvidia-pytriton (default: {DEFAULT_PEER_PYTHON})")
    _common.step_args(p, duration=10.0, rounds=3)
    args = p.parse_args()
    repo = _common.ensure_repository(args.model_repository)
    model = args.model
    inputs = (InputOptions(seq_len=args.seq_len, int_ranges={"input_ids": (1000, 29000)}) if model == "minilm"
              else InputOptions())
    factors = [float(x) for x in args.factors.split(",")]
    caps = [int(x) for x in args.queue_caps.split(",")]
    what = f"minilm {args.seq_len} tokens" if model == "minilm" else model
    print(f"machine: {_common.machine()}; {what}, budget {args.budget_ms:g} ms")

    def closed(address: str, c: int) -> StepResult:
        return run_closed(address, model, c, args.duration, warmup=args.warmup, inputs=inputs,
                          budget_ms=args.budget_ms)

    def offered(address: str, rate: float, duration: float) -> StepResult:
        return run_open(address, model, rate, duration, warmup=args.warmup, budget_ms=args.budget_ms, inputs=inputs)

    peer = Triton(repo, args.peer_python)
    sweeps: dict[float, list[tuple[int, StepResult]]] = {}
    rounds: dict[float, dict[str, list[StepResult]]] = {f: {"batchline": [], "Triton": []} for f in factors}
    with _common.mesh(repo, log_level=args.log_level) as ours:
        # Every step runs (one noisy step must not end the sweep early and understate the capacity,
        # which would make "2x" no overload at all); the larger of the two capacities counts, as in overload.py.
        sweep = CAPACITY_SWEEP[model]
        cap, admitted_cap = overload.capacity_of([closed(ours, c) for c in sweep])
        if cap is None:
            raise SystemExit(f"no concurrency in {sweep} answered 99% within {args.budget_ms:g} ms")
        capacity = max(cap.goodput_rps, admitted_cap)
        print(f"batchline's capacity at the budget: {capacity:.0f} req/s (best of {sweep} in flight)", flush=True)
        try:
            judged_at = next((f for f in factors if f >= 2), factors[-1]) * capacity
            layouts = []
            for (instances, threads) in LAYOUTS:
                for spinning in (False, True):
                    setting = Setting(instances, threads, spinning, args.triton_delay_ms)
                    st = on_peer(peer, peer_flags(model, setting, LAYOUT_CAP, args.budget_ms),
                                 lambda address: offered(address, judged_at, args.sweep_duration))
                    layouts.append((setting, st))
                    print(f"sweep layout at {judged_at:.0f}/s, max_queue_size {LAYOUT_CAP}: {setting.name}: goodput "
                          f"{st.goodput_rps:.0f}/s {st.status_counts}", flush=True)
            layout = max(layouts, key=lambda ls: ls[1].goodput_rps)[0]
            print(f"Triton's layout here: {layout.name}", flush=True)
            for factor in factors:
                rate = factor * capacity
                sweeps[factor] = []
                for q in caps:
                    st = on_peer(peer, peer_flags(model, layout, q, args.budget_ms),
                                 lambda address: offered(address, rate, args.sweep_duration))
                    sweeps[factor].append((q, st))
                    print(f"sweep {factor:g}x ({rate:.0f}/s) Triton max_queue_size {q:3d}: goodput "
                          f"{st.goodput_rps:.0f}/s {st.status_counts}", flush=True)
                best = max(sweeps[factor], key=lambda qs: qs[1].goodput_rps)[0]
                for r in range(args.rounds):
                    for side in (("batchline", "Triton") if r % 2 == 0 else ("Triton", "batchline")):
                        st = (offered(ours, rate, args.duration) if side == "batchline" else
                              on_peer(peer, peer_flags(model, layout, best, args.budget_ms),
                                      lambda address: offered(address, rate, args.duration)))
                        rounds[factor][side].append(st)
                        print(f"round {r + 1} {factor:g}x {side:9s} goodput {st.goodput_rps:.0f}/s "
                              f"{st.status_counts}", flush=True)
        except PeerDown as exc:
            raise SystemExit(str(exc)) from None
        finally:
            peer.stop()

    f = _common.f
    print(f"\nTriton's queue cap swept ({args.sweep_duration:g} s a run), goodput req/s:")
    rows = [["offered", *(f"max_queue_size {q}" for q in caps), "best"]]
    for factor, runs in sweeps.items():
        best = max(runs, key=lambda qs: qs[1].goodput_rps)[0]
        rows.append([f"{factor:g}x", *(f(st.goodput_rps, ".0f") for _, st in runs), str(best)])
    print(_common.table(rows))
    print(f"\nbatchline untuned against Triton at its best cap, median of {args.rounds} alternating rounds "
          f"(capacity {capacity:.0f} req/s):")
    rows = [["offered", "offered/s", "batchline goodput/s", "goodput/capacity", "Triton goodput/s",
             "Triton goodput/capacity", "batchline/Triton", "refused (batchline, Triton)",
             "timed out (batchline, Triton)", "rounds (batchline vs Triton)"]]
    goodput = {}
    for factor, by in rounds.items():
        ours_g = statistics.median(st.goodput_rps for st in by["batchline"])
        theirs_g = statistics.median(st.goodput_rps for st in by["Triton"])
        goodput[factor] = (ours_g, theirs_g)
        rows.append([f"{factor:g}x", f"{factor * capacity:.0f}", f"{ours_g:.0f}", f"{ours_g / capacity:.2f}",
                     f"{theirs_g:.0f}", f"{theirs_g / capacity:.2f}", f(ours_g / theirs_g if theirs_g else None, ".2f"),
                     *(f"{_share(by['batchline'], status)}, {_share(by['Triton'], status)}"
                       for status in (REFUSED, TIMED_OUT)),
                     "; ".join(f"{a.goodput_rps:.0f} vs {b.goodput_rps:.0f}"
                               for a, b in zip(by["batchline"], by["Triton"]))])
    print(_common.table(rows))
    if 2.0 in goodput and 3.0 in goodput:
        for i, who in enumerate(("batchline", "Triton")):
            kept = goodput[3.0][i] / goodput[2.0][i] if goodput[2.0][i] else float("nan")
            print(f"{who}: goodput at 3x / at 2x = {kept:.2f}")
    if peer.crashes:
        print(f"Triton died {peer.crashes} time(s) during the run; those runs were measured again on a fresh server.")
    if peer.failed_starts:
        print(f"Triton failed to start {peer.failed_starts} time(s) and was started again.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
