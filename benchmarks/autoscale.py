"""Autoscaling policies replayed against arrival traces, simulated: how many requests each serves
within budget, refuses, times out, and at what cost in executor-seconds.

    python benchmarks/autoscale.py [--seeds 1,2,3] [--start-s 5] [--no-period] [--plot DIR]
    python benchmarks/autoscale.py --mode real [--bounds 1:3] [--real-seconds 36] [--model minilm]

The traces (per-second Poisson rates from documented parameters, fixed seeds; BASE = 800/s):
- diurnal: a day compressed into 300 s, BASE to 8x BASE and back as a raised cosine;
- bursts: BASE with 3x BASE for 10 s every 60 s;
- step: BASE, then 3x BASE from 100 s on;
- flash: BASE with 10x BASE for 20 s at 100 s;
- mmpp: a Markov-modulated Poisson process, BASE and 4x BASE, switching with probability 0.05 a second.

The policies, all with the same executor start time and cool-down:
- static-min: MIN executors; static-peak: as many as the trace's peak needs at a utilisation of 0.7;
- reactive: a queue-depth trigger, ceil(queued / 32) executors, as a plain KEDA queue-length scaler would do;
- predictive: what `batchline up --autoscale` does, by the same code: the leader's forecast and need
  (batchline.planning.forecast.ArrivalRate.ahead, batchline.planning.capacity.need, at
  scheduler.demand.TARGET_UTILISATION) and the supervisor's policy (batchline.autoscale.ScalePolicy);
  told the period of a trace that has one (bursts: 60 s), as `--demand-period-s` tells the scheduler.

The mesh is a fluid model of the planning model's numbers, in ticks of DT (20 ms): one executor serves
`executor_capacity` requests/s within the budget (the shared planning model's play of a steady stream
on a profile of 4 ms + 0.5 ms a row, max_batch_size 32); a request is admitted when the queue ahead
of it, at the serving executors' capacity, plus a batch's run finishes within 0.85 of its budget
(admission's headroom), else refused at once; an admitted one still waiting at its deadline times
out. A started executor serves after --start-s. Ticks of DT: a request is answered on average
halfway through the tick it is served in. Not simulated: batching dynamics within a second,
the gateways' and the scheduler's CPU, and retries of refused requests (a refusal counts once).

--mode real first measures the answers per second of 1, 2, ... MAX executors on this host (a closed
loop of 32 clients against a mesh of each size) and sets BASE to the same share of one's as the
simulation's BASE is of its capacity; then it plays each trace, compressed into --real-seconds (the
cool-down and the period compressed with it), with an open-loop client against a local mesh
serving the model from a copy of the repository whose executors each run on one thread
(instance_count 1, intra_op_threads 1), so that 1 to 3 executors matter
(benchmarks/_autoscale_real.py); static-peak runs MAX there, and the start time is the one the
mesh measured. Beside each real row it prints the simulation of the same
compressed trace with the same start time and cool-down, whose executors serve what as many served
here (on a host whose cores the gateway, the scheduler, Redis and the client share, a second
executor adds less than the first serves) and whose predictive policy sizes by the capacity the
leader published, as the real one does; and the differences.
"""
from __future__ import annotations

import argparse
import math
import pathlib
import random
import shutil
import tempfile
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from batchline.autoscale import ScalePolicy
from forecasters import poisson  # benchmarks/forecasters.py: one Poisson draw for both scripts
from batchline.planning import BatchingRule, FunctionCost
from batchline.planning.capacity import executor_capacity, need, queued_rate
from batchline.planning.forecast import ArrivalRate, Holt
from batchline.protocol import internal_pb2 as pb
from scheduler.demand import TARGET_UTILISATION

BASE = 800.0
SECONDS = 300
DT = 0.02
BUDGET_S = 0.2
HEADROOM = 0.85
# Static-peak runs as many executors as the peak needs at this share of their capacity: the
# baseline's size, as documented since the first table, is not moved with the predictive policy's
# target utilisation (scheduler.demand.TARGET_UTILISATION).
STATIC_UTILISATION = 0.7
COST = FunctionCost(lambda units: 0.004 + 0.0005 * units)
RULE = BatchingRule(32)
KEDA_THRESHOLD = 32


def diurnal(t: float, rng: random.Random) -> float:
    return BASE * (1 + 7 * (1 - math.cos(2 * math.pi * t / SECONDS)) / 2)


def bursts(t: float, rng: random.Random) -> float:
    return 3 * BASE if t % 60 >= 50 else BASE


def step(t: float, rng: random.Random) -> float:
    return 3 * BASE if t >= 100 else BASE


def flash(t: float, rng: random.Random) -> float:
    return 10 * BASE if 100 <= t < 120 else BASE


class Mmpp:
    def __init__(self) -> None:
        self.high, self.second = False, -1

    def __call__(self, t: float, rng: random.Random) -> float:
        if int(t) != self.second:
            self.second = int(t)
            if rng.random() < 0.05:
                self.high = not self.high
        return 4 * BASE if self.high else BASE


TRACES: dict[str, Callable[[], Callable[[float, random.Random], float]]] = {
    "diurnal": lambda: diurnal, "bursts": lambda: bursts, "step": lambda: step, "flash": lambda: flash, "mmpp": Mmpp}
PEAKS = {"diurnal": 8 * BASE, "bursts": 3 * BASE, "step": 3 * BASE, "flash": 10 * BASE, "mmpp": 4 * BASE}
# The period the predictive policy is told where a trace has one (as `--demand-period-s`).
PERIODS = {"bursts": 60.0}


def compressed(trace: Callable[[float, random.Random], float], scale: float, factor: float):
    """The trace played in `scale` of its time at `factor` times its rates (the real mode's, and its simulation's)."""
    return lambda t, rng: trace(t / scale, rng) * factor


@dataclass(frozen=True)
class Setup:
    """What a replay is played with: one executor's capacity within BUDGET_S, the actuators' numbers."""
    capacity: float
    seconds: float = SECONDS
    start_s: float = 5.0
    cool_down_s: float = 30.0
    low: int = 1
    high: int = 64
    period_s: float = 0.0                 # the demand's period predictive is told (0: none)
    keda_threshold: int = KEDA_THRESHOLD
    # Real mode: the requests/s within the budget measured with 1, 2, ... executors serving (the
    # host's cores are shared, so executors add less than their own capacity); (): n x capacity.
    served: tuple[float, ...] = ()
    sized_by: float = 0.0                 # the capacity predictive sizes by (the leader's); 0: capacity

    def total(self, serving: int) -> float:
        if serving <= 0:
            return 0.0
        return self.served[min(serving, len(self.served)) - 1] if self.served else serving * self.capacity


@dataclass
class Result:
    answered: float = 0.0
    in_budget: float = 0.0
    refused: float = 0.0
    timed_out: float = 0.0
    executor_s: float = 0.0
    scale_events: int = 0
    bound_s: float = 0.0                            # the least executor-seconds that serve the trace
    latencies: list = field(default_factory=list)   # (seconds, requests)
    timeline: list = field(default_factory=list)    # (t, arrivals/s, executors, in-budget share of the tick)

    @property
    def total(self) -> float:
        return self.answered + self.refused + self.timed_out

    def in_budget_from(self, start: float) -> float:
        """The share of the requests arriving from `start` on answered within the budget."""
        ticks = [(rate * DT, good) for t, rate, _, good in self.timeline if t >= start]
        arrived = sum(n for n, _ in ticks)
        return sum(n * good for n, good in ticks) / arrived if arrived else 1.0

    def p99_ms(self) -> float:
        total, seen = sum(n for _, n in self.latencies), 0.0
        for latency, n in sorted(self.latencies):
            seen += n
            if seen >= 0.99 * total:
                return latency * 1000
        return 0.0


class Reactive:
    """A queue-depth trigger, ceil(queued / threshold), as a plain KEDA queue-length scaler would do: up at once,
    down after the cool-down."""

    def __init__(self, low: int, high: int, cool_down_s: float, threshold: int = KEDA_THRESHOLD) -> None:
        self.low, self.high, self.cool_down_s, self.threshold = low, high, cool_down_s, threshold
        self.recent: deque = deque()

    def target(self, now: float, queued: float, running: int) -> int:
        desired = min(self.high, max(self.low, math.ceil(queued / self.threshold)))
        self.recent.append((now, desired))
        while self.recent and now - self.recent[0][0] > self.cool_down_s:
            self.recent.popleft()
        return desired if desired > running else max(d for _, d in self.recent)


def simulate(trace: Callable[[float, random.Random], float], policy: str, seed: int, setup: Setup,
             peak_need: int) -> Result:
    rng = random.Random(seed)
    capacity = setup.capacity
    service_s = COST.predict(RULE.max_batch_size)
    r = Result()
    initial = peak_need if policy == "static-peak" else setup.low
    ready = [0.0] * initial                  # when each executor serves
    queue: deque = deque()                   # [arrival time, requests]
    queued = 0.0
    arrived = 0
    least = 0                                # the fewest executors that serve this tick's rate
    rate = ArrivalRate(holt=Holt.for_period(round(setup.period_s)))
    scaler = ScalePolicy(setup.low, setup.high, setup.cool_down_s)
    reactive = Reactive(setup.low, setup.high, setup.cool_down_s, setup.keda_threshold)
    for tick in range(int(setup.seconds / DT)):
        t = tick * DT
        lam = trace(t, rng)
        n = poisson(rng, lam * DT)
        arrived += n
        # The bound: at every instant as many executors as the rate needs at their whole capacity,
        # each one added paying its start time.
        fewest = min(setup.high, max(setup.low, math.ceil(lam / capacity - 1e-9)))
        r.bound_s += fewest * DT + max(0, fewest - least) * setup.start_s
        least = fewest
        serving = sum(1 for x in ready if x <= t)
        room = max(0.0, (HEADROOM * BUDGET_S - service_s - DT) * setup.total(serving) - queued) if serving else 0.0
        admitted = min(n, math.floor(room))
        r.refused += n - admitted
        if admitted:
            queue.append([t, float(admitted)])
            queued += admitted
        while queue and t + DT / 2 - queue[0][0] + service_s > BUDGET_S:
            r.timed_out += queue[0][1]  # it cannot finish in time any more: shed, DEADLINE_EXCEEDED
            queued -= queue.popleft()[1]
        good = 0.0
        budget = setup.total(serving) * DT
        while queue and budget > 0:
            chunk = queue[0]
            take = min(chunk[1], budget)
            latency = t + DT / 2 - chunk[0] + service_s
            r.answered += take
            r.latencies.append((latency, take))
            if latency <= BUDGET_S:
                r.in_budget += take
                good += take
            chunk[1] -= take
            budget -= take
            queued -= take
            if chunk[1] <= 1e-9:
                queue.popleft()
        while queue and t + DT / 2 - queue[0][0] + service_s > BUDGET_S:
            r.timed_out += queue[0][1]
            queued -= queue.popleft()[1]
        r.executor_s += len(ready) * DT
        r.timeline.append((t, n / DT, len(ready), good / n if n else 1.0))
        if tick % round(1 / DT):  # not a whole second
            continue
        # Once a second, as the leader steps its demand and `batchline up` reads it.
        target = len(ready)
        if policy == "predictive":
            rate.observe(t, arrived)
            forecast = rate.ahead(setup.start_s)
            sized_by = setup.sized_by or capacity
            # A tick's arrivals come over the tick: its oldest queued request came about a tick ago.
            now_rate = queued_rate(round(queued), t + DT - queue[0][0],
                                   sized_by * BUDGET_S * sum(1 for x in ready if x <= t)) if queue else 0.0
            n_need = need(forecast, sized_by, TARGET_UTILISATION, round(queued), BUDGET_S, now_rate)
            model = pb.MeshDemand.Model(name="m", version="1", forecast_rate=forecast, arrival_rate=rate.rate,
                                        capacity=sized_by, by_forecast=n_need.by_forecast,
                                        by_backlog=n_need.by_backlog, queued_rate=now_rate)
            demand = pb.MeshDemand(models=[model], horizon_s=setup.start_s)
            decision = scaler.decide(t, len(ready), demand)
            target = decision.target if decision else target
        elif policy == "reactive":
            target = reactive.target(t, queued, len(ready))
        if target > len(ready):
            ready += [t + setup.start_s] * (target - len(ready))
            r.scale_events += 1
        elif target < len(ready):
            ready = sorted(ready)[:target]
            r.scale_events += 1
    return r


POLICIES = ("static-min", "static-peak", "reactive", "predictive")


def median(results: list[Result], f: Callable[[Result], float]) -> float:
    return statistics.median(f(r) for r in results)


def share(part: Callable[[Result], float]) -> Callable[[Result], float]:
    return lambda r: part(r) / max(1.0, r.total)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="", help="one run per seed; the table shows the median (default: 1,2,3; "
                                               "real: 1, so that every trace and policy runs in about 15 minutes)")
    p.add_argument("--start-s", type=float, default=5.0, help="an executor's start-to-serving time (default: 5)")
    p.add_argument("--bounds", default="", help="MIN:MAX executors (default: 1:64; real: 1:3)")
    p.add_argument("--cool-down-s", type=float, default=30.0,
                   help="scale-down cool-down, in the trace's seconds (default: 30; real: compressed with the trace)")
    p.add_argument("--traces", default=",".join(TRACES), help=f"comma-separated, of {', '.join(TRACES)}")
    p.add_argument("--no-period", action="store_true",
                   help="do not tell predictive the period of a trace that has one (bursts: 60 s)")
    p.add_argument("--plot", default="", help="write a PNG per trace into this directory")
    p.add_argument("--mode", choices=("sim", "real"), default="sim",
                   help="simulated, or against a local mesh side by side with its simulation")
    p.add_argument("--model-repository", default="",
                   help="real: the repository holding the model (default: the demo's)")
    p.add_argument("--model", default="minilm", help="real: the model to load (default: minilm)")
    p.add_argument("--seq-len", type=int, default=16, help="real: token inputs' length (default: 16)")
    p.add_argument("--base-rate", type=float, default=0.0,
                   help="real: requests/s for BASE (default: BASE's share of one executor's capacity as simulated, "
                        "times the capacity the mesh measured)")
    p.add_argument("--real-seconds", type=float, default=36.0,
                   help="real: each trace compressed into this (default: 36)")
    p.add_argument("--budget-ms", type=float, default=BUDGET_S * 1000,
                   help="real: each request's budget and the model's default (default: 200)")
    p.add_argument("--keda-threshold", type=int, default=KEDA_THRESHOLD,
                   help="reactive's queued requests per executor (default: 32)")
    a = p.parse_args()
    a.seeds = a.seeds or ("1" if a.mode == "real" else "1,2,3")
    if a.mode == "real":
        return real(a)
    low, high = (int(x) for x in (a.bounds or "1:64").split(":"))
    seeds = [int(s) for s in a.seeds.split(",")]
    capacity = executor_capacity(RULE, COST, BUDGET_S)
    print(f"one executor: {capacity:.0f} requests/s within {BUDGET_S * 1000:.0f} ms; start {a.start_s:g} s, "
          f"cool-down {a.cool_down_s:g} s, executors {low}..{high}, target utilisation {TARGET_UTILISATION:g}; "
          f"median of seeds {a.seeds}")
    for name in a.traces.split(","):
        peak_need = min(high, math.ceil(PEAKS[name] / (capacity * STATIC_UTILISATION)))
        setup = Setup(capacity, SECONDS, a.start_s, a.cool_down_s, low, high,
                      0.0 if a.no_period else PERIODS.get(name, 0.0), a.keda_threshold)
        runs = {policy: [simulate(TRACES[name](), policy, s, setup, peak_need) for s in seeds] for policy in POLICIES}
        bound = median(runs["predictive"], lambda r: r.bound_s)
        told = f"; predictive told the period, {setup.period_s:g} s" if setup.period_s else ""
        print(f"\n{name} (peak {PEAKS[name]:.0f}/s; static-peak runs {peak_need}; the least executor-s that serve "
              f"it: {bound:.0f}, {bound / (peak_need * SECONDS):.2f}x static-peak's{told})")
        print(f"  {'policy':12} {'in budget':>10} {'refused':>8} {'timed out':>10} {'p99 ms':>7} "
              f"{'executor-s':>11} {'scale events':>13}")
        for policy, results in runs.items():
            print(f"  {policy:12} {median(results, share(lambda r: r.in_budget)):10.2%} "
                  f"{median(results, share(lambda r: r.refused)):8.2%} "
                  f"{median(results, share(lambda r: r.timed_out)):10.2%} {median(results, Result.p99_ms):7.0f} "
                  f"{median(results, lambda r: r.executor_s):11.0f} {median(results, lambda r: r.scale_events):13.0f}")
        if setup.period_s:
            # No forecast sees the first period's peaks coming; a mesh that has served a while has its season.
            after = {policy: median(results, lambda r: r.in_budget_from(setup.period_s))
                     for policy, results in runs.items() if policy in ("reactive", "predictive")}
            print(f"  in budget from the second period on ({setup.period_s:g} s): "
                  + ", ".join(f"{policy} {v:.2%}" for policy, v in after.items()))
        if a.plot:
            _plot(pathlib.Path(a.plot) / f"autoscale-{name}.png", name, {k: v[0] for k, v in runs.items()})


def real(a: argparse.Namespace) -> None:
    from _autoscale_real import measure, run_real
    from _common import ensure_repository

    from batchline.tune.layouts import set_config

    low, high = (int(x) for x in (a.bounds or "1:3").split(":"))
    a.bounds = f"{low}:{high}"
    scale = a.real_seconds / SECONDS
    cool_down_s = a.cool_down_s * scale
    source = ensure_repository(a.model_repository
                               or pathlib.Path(__file__).resolve().parent.parent / "model_repository")
    with tempfile.TemporaryDirectory(prefix="batchline-autoscale-") as tmp:
        repo = pathlib.Path(tmp)
        shutil.copytree(source / a.model, repo / a.model, ignore=shutil.ignore_patterns("trt_cache"))
        config = repo / a.model / "config.toml"
        text = config.read_text()
        for key, value in (("instance_count", "1"), ("intra_op_threads", "1"),
                           ("default_timeout_ms", f"{a.budget_ms:g}")):
            text = set_config(text, key, value)
        config.write_text(text)
        measured = [measure(a, str(repo), n) for n in range(1, high + 1)]
        (capacity, planned, start_s), served = measured[0], tuple(m[0] for m in measured)
        simulated = executor_capacity(RULE, COST, BUDGET_S)
        base = a.base_rate or capacity * BASE / simulated
        print(f"real: {a.model}, one thread per executor, executors {low}..{high}, budget {a.budget_ms:g} ms; "
              f"1..{high} executors served {', '.join(f'{x:.0f}' for x in served)} requests/s (a closed loop of "
              f"32 each; the leader's planning model says {planned:.0f} for one within the budget), start "
              f"{start_s:.1f} s (measured); BASE = {base:.0f}/s; each trace in {a.real_seconds:g} s, cool-down "
              f"{cool_down_s:.1f} s; seeds {a.seeds}, median. sim: the same compressed traces in the fluid model, "
              f"serving what each count of executors served here, predictive sizing by the leader's capacity, "
              f"with the same start and cool-down", flush=True)
        for name in a.traces.split(","):
            period = 0.0 if a.no_period else PERIODS.get(name, 0.0) * scale
            setup = Setup(capacity, a.real_seconds, start_s, cool_down_s, low, high, period, a.keda_threshold,
                          served, planned)
            told = f"; predictive told the period, {period:g} s" if period else ""
            print(f"\n{name} (static-peak runs {high}{told})")
            print(f"  {'policy':12} {'in budget real':>14} {'sim':>7} {'diff':>6} {'executor-s real':>15} {'sim':>5} "
                  f"{'diff':>5} {'refused':>8} {'timed out':>10} {'p99 ms':>7} {'events':>6} {'start s':>8} "
                  f"{'leader cap/s':>12}")
            for policy in POLICIES:
                runs = [run_real(compressed(TRACES[name](), scale, base / BASE), policy, int(s), a, str(repo),
                                 high, cool_down_s, period, Result) for s in a.seeds.split(",")]
                got = [r for r, _, _ in runs]
                sim = [simulate(compressed(TRACES[name](), scale, base / BASE), policy, int(s), setup, high)
                       for s in a.seeds.split(",")]
                ib, ib_sim = median(got, share(lambda r: r.in_budget)), median(sim, share(lambda r: r.in_budget))
                es, es_sim = median(got, lambda r: r.executor_s), median(sim, lambda r: r.executor_s)
                print(f"  {policy:12} {ib:14.2%} {ib_sim:7.2%} {(ib - ib_sim) * 100:+6.1f} {es:15.0f} {es_sim:5.0f} "
                      f"{(es / es_sim - 1) * 100 if es_sim else 0:+4.0f}% "
                      f"{median(got, share(lambda r: r.refused)):8.2%} "
                      f"{median(got, share(lambda r: r.timed_out)):10.2%} {median(got, Result.p99_ms):7.0f} "
                      f"{median(got, lambda r: r.scale_events):6.0f} "
                      f"{statistics.median(st for _, st, _ in runs):8.1f} "
                      f"{statistics.median(c for _, _, c in runs):12.0f}", flush=True)


def _plot(path: pathlib.Path, name: str, runs: dict[str, Result]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    first = next(iter(runs.values())).timeline
    axes[0].plot([x[0] for x in first], [x[1] for x in first], lw=0.6)
    axes[0].set_ylabel("arrivals/s")
    for policy, r in runs.items():
        axes[1].plot([x[0] for x in r.timeline], [x[2] for x in r.timeline], label=policy)
        share = [x[3] for x in r.timeline]
        window = round(1 / DT)
        smooth = [statistics.fmean(share[max(0, i - window + 1):i + 1]) for i in range(len(share))]
        axes[2].plot([x[0] for x in r.timeline], smooth, label=policy)
    axes[1].set_ylabel("executors")
    axes[2].set_ylabel("in budget (1 s mean)")
    axes[2].set_xlabel("seconds")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"{name}: first seed")
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    main()
