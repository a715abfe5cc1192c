"""`batchline tune MODEL`: measure layouts of one executor for a model through a real mesh on this
host, by goodput within the budget, and write the best into its config.toml with the report
(tune.json beside it).

Each layout is served by a mesh of its own (`batchline up`'s: a private Redis, one executor, the
scheduler and a gateway on free ports) from a scratch copy of the model holding only the version
measured, and loaded by a closed loop of `concurrency` clients whose every request carries the
budget; goodput counts the answers that came in time. The current layout is measured first, the
splits of the cores next (layouts.candidates), then the best one's batch size halved and doubled
(layouts.refine). The current layout and the FINALISTS - 1 others that served most in those runs
are then measured again in `rounds` rounds, side by side, each first in turn, and each judged by
the median of its rounds' ratios to the current one: a shared host's speed drifts between
minutes, and a single run, or the mean of two taken a minute apart, picked winners by noise (on a
2-core host one layout of minilm measured 149 goodput/s in one tune and 284 in the next; a mean of
two would have written a layout that measured 0.66x the hand one in the next run). The best
finalist replaces the current layout only if its median is at least `min_gain`: otherwise
config.toml is left as it is.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pathlib
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from batchline.tune import CONCURRENCY, FINALISTS, MEASURE_S, MIN_GAIN, ROUNDS, WARMUP_S
from batchline.tune.layouts import Layout, candidates, refine, set_config

REPORT = "tune.json"


class TuneError(ValueError):
    """Nothing can be tuned as asked: the message says why."""


@dataclass
class Options:
    model: str
    repository: pathlib.Path
    budget_ms: float = 0.0                  # 0: the model's default_timeout_ms
    concurrency: int = CONCURRENCY
    duration_s: float = MEASURE_S
    warmup_s: float = WARMUP_S
    min_gain: float = MIN_GAIN
    rounds: int = ROUNDS                    # side-by-side rounds of the finalists
    dry_run: bool = False
    cores: int = 0                          # 0: the cores this process may run on
    seq_len: int | None = None              # token inputs' length (None: the load generator's default)
    progress: bool = True


@dataclass
class Measured:
    layout: Layout
    goodput_rps: float = 0.0                # the median of its runs
    runs: int = 1
    throughput_rps: float = 0.0
    p99_ms: float | None = None
    mean_batch: float | None = None
    refused: int = 0
    error: str = ""


@dataclass
class Report:
    model: str
    budget_ms: float
    cores: int
    concurrency: int
    current: Measured
    measured: list[Measured] = field(default_factory=list)
    chosen: Measured | None = None
    gain: float = 0.0                       # the median of the rounds' ratios, best finalist / current
    written: bool = False
    why: str = ""
    seconds: float = 0.0


def _versions(model_dir: pathlib.Path) -> list[str]:
    versions = sorted((p.name for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()
                       and (p / "model.onnx").exists()), key=int)
    if not versions:
        raise TuneError(f"model '{model_dir.name}' has no version directory with a model.onnx in {model_dir}")
    return versions


def current_layout(config: dict, version: str) -> Layout:
    return Layout(version, int(config["instance_count"]), int(config["intra_op_threads"]),
                  int(config["max_batch_size"]), float(config["max_queue_delay_ms"]))


def _serve_copy(model_dir: pathlib.Path, layout: Layout, dest: pathlib.Path) -> pathlib.Path:
    """A repository holding the model with only `layout.version`, its config.toml set to the layout."""
    target = dest / model_dir.name
    shutil.copytree(model_dir, target, ignore=lambda d, names: [
        n for n in names if n in ("trt_cache", REPORT)
        or (pathlib.Path(d) == model_dir and n.isdigit() and n != layout.version)])
    config = target / "config.toml"
    text = config.read_text()
    for key, value in layout.keys().items():
        text = set_config(text, key, value)
    # The copy holds this version alone: a policy pinning another would serve nothing.
    config.write_text(set_config(text, "version_policy", "{ latest = 1 }"))
    return dest


def measure(o: Options, model_dir: pathlib.Path, layout: Layout, budget_ms: float) -> Measured:
    """One layout through a real mesh: a closed loop at the budget."""
    from batchline.bench import BenchError, InputOptions, run_closed
    from batchline.mesh import Mesh

    with tempfile.TemporaryDirectory(prefix="batchline-tune-") as tmp:
        repo = _serve_copy(model_dir, layout, pathlib.Path(tmp))
        args = argparse.Namespace(model_repository=str(repo), redis_url="", executors=1, gateways=1, gateway_port=0,
                                  host="127.0.0.1", log_level="ERROR", startup_timeout=180.0, metrics_port=-1)
        mesh = Mesh(args)
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # the mesh's start-up lines: the table says it all
                address = mesh.start()
            step = run_closed(address, o.model, o.concurrency, o.duration_s, warmup=o.warmup_s, budget_ms=budget_ms,
                              inputs=InputOptions(seq_len=o.seq_len), retry_after=True)
        except (SystemExit, BenchError) as exc:
            return Measured(layout, error=" ".join(str(exc.code if isinstance(exc, SystemExit) else exc).split()))
        finally:
            with contextlib.redirect_stdout(io.StringIO()):
                mesh.stop()
    return Measured(layout, goodput_rps=step.goodput_rps, throughput_rps=step.throughput_rps,
                    p99_ms=(step.latency_ms or {}).get("p99"), mean_batch=step.mean_batch_size,
                    refused=step.status_counts.get("RESOURCE_EXHAUSTED", 0))


def tune(o: Options, measure_one: Callable[[Options, pathlib.Path, Layout, float], Measured] = measure) -> Report:
    """Measure, choose, and (unless a dry run, or the current layout is best) write config.toml."""
    from executor.model_config import select_versions
    from executor.repository import RepositoryError, read_config

    started = time.monotonic()
    if o.rounds < 1:
        raise TuneError(f"--rounds must be at least 1, got {o.rounds}")
    model_dir = o.repository / o.model
    if not (model_dir / "config.toml").exists():
        raise TuneError(f"no model '{o.model}' in {o.repository} (no {o.model}/config.toml there)")
    try:
        config = read_config(model_dir)
    except RepositoryError as exc:
        raise TuneError(str(exc)) from None
    versions = _versions(model_dir)
    served = select_versions(config["version_policy"], versions)
    if not served:
        raise TuneError(f"model '{o.model}': its version_policy {config['version_policy']} serves none of the "
                        f"versions in {model_dir} ({', '.join(versions)})")
    cores = o.cores or len(os.sched_getaffinity(0))
    budget_ms = o.budget_ms or float(config["default_timeout_ms"])
    current = current_layout(config, served[-1])
    layouts = candidates(current, versions, cores)
    bar = _bar(o.progress, len(layouts) + FINALISTS * o.rounds)
    measured: list[Measured] = []

    def run(layout: Layout) -> None:
        if bar is not None:
            bar.set_description(layout.label(cores))
        measured.append(measure_one(o, model_dir, layout, budget_ms))
        if bar is not None:
            bar.update()

    for layout in layouts:
        run(layout)
    best = max(measured, key=lambda m: m.goodput_rps)
    more = refine(best.layout, [m.layout for m in measured])
    if bar is not None:
        bar.total = len(measured) + len(more) + FINALISTS * o.rounds
    for layout in more:
        run(layout)
    current = measured[0]
    # The search's single runs pick finalists, not the winner: one lucky run would win otherwise.
    others = sorted((m for m in measured[1:] if not m.error), key=lambda m: -m.goodput_rps)
    finalists = [current] + others[:FINALISTS - 1]
    best, ratios = current, []
    if len(finalists) > 1:
        if bar is not None:
            bar.total = len(measured) + len(finalists) * o.rounds
        runs = {id(m): [m.goodput_rps] for m in finalists}
        by_round: dict[int, list[float]] = {id(m): [] for m in finalists[1:]}
        for r in range(o.rounds):
            pair = {}
            # Each finalist goes first in turn: a host's speed drifts within a round too.
            for m in finalists[r % len(finalists):] + finalists[:r % len(finalists)]:
                if bar is not None:
                    bar.set_description(f"round {r + 1}: {m.layout.label(cores)}")
                pair[id(m)] = measure_one(o, model_dir, m.layout, budget_ms).goodput_rps
                runs[id(m)].append(pair[id(m)])
                if bar is not None:
                    bar.update()
            base = pair[id(current)]
            for m in finalists[1:]:
                by_round[id(m)].append(pair[id(m)] / base if base else (float("inf") if pair[id(m)] else 1.0))
        for m in finalists:
            m.goodput_rps, m.runs = statistics.median(runs[id(m)]), len(runs[id(m)])
        best = max(finalists[1:], key=lambda m: statistics.median(by_round[id(m)]))
        ratios = by_round[id(best)]
    if bar is not None:
        bar.close()
    report = Report(o.model, budget_ms, cores, o.concurrency, current, measured)
    # The search's single run of another layout is not evidence enough: only the rounds judge.
    gain = report.gain = statistics.median(ratios) if ratios else 1.0
    report.chosen = best if gain > 1.0 and best.goodput_rps > 0 else current
    if report.chosen is report.current:
        report.why = "the current layout serves the most within the budget"
    elif gain < o.min_gain:
        report.why = f"the best serves {gain:.2f}x the current layout, under --min-gain {o.min_gain:g}: kept as it is"
    else:
        report.why = f"{gain:.2f}x the current layout's goodput within {budget_ms:g} ms"
        if o.dry_run:
            report.why += "; --dry-run: nothing written"
        else:
            write(model_dir, report.chosen.layout, versions[-1], served[-1])
            report.written = True
    report.seconds = time.monotonic() - started
    if report.written:
        (model_dir / REPORT).write_text(json.dumps(asdict(report), indent=2) + "\n")
    return report


def write(model_dir: pathlib.Path, layout: Layout, latest: str, served: str) -> None:
    """The layout into config.toml, whole or not at all (written beside it, then renamed over it);
    `served`: the version its version_policy serves now (the latest, or one it pins)."""
    config = model_dir / "config.toml"
    text = config.read_text()
    for key, value in layout.keys().items():
        text = set_config(text, key, value)
    if layout.version != served:
        policy = "{ latest = 1 }" if layout.version == latest else f"{{ specific = [{int(layout.version)}] }}"
        text = set_config(text, "version_policy", policy)
    staging = model_dir / ".config.toml.tune"
    try:
        staging.write_text(text)
        os.replace(staging, config)
    finally:
        staging.unlink(missing_ok=True)


def _bar(enabled: bool, total: int):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="layout", leave=False, bar_format="{desc}: {n}/{total} layouts |{bar}| {elapsed}")


def table(report: Report) -> str:
    """The report as a person reads it: one line per layout measured, then the verdict."""
    cores = report.cores
    lines = [f"model {report.model}: one executor's layouts on {cores} cores, {report.concurrency} requests in "
             f"flight, budget {report.budget_ms:g} ms; goodput = answers within the budget",
             f"  {'layout':48} {'goodput/s':>10} {'vs now':>7} {'p99 ms':>8} {'batch':>6} {'refused':>8} {'runs':>5}"]
    base = report.current.goodput_rps
    for m in report.measured:
        mark = "*" if m is report.chosen else " "
        name = m.layout.label(cores) + (" (now)" if m is report.current else "")
        if m.error:
            lines.append(f"{mark} {name:48} failed: {m.error}")
            continue
        ratio = f"{m.goodput_rps / base:.2f}x" if base else "-"
        p99 = f"{m.p99_ms:.1f}" if m.p99_ms is not None else "-"
        batch = f"{m.mean_batch:.1f}" if m.mean_batch is not None else "-"
        lines.append(f"{mark} {name:48} {m.goodput_rps:10.1f} {ratio:>7} {p99:>8} {batch:>6} {m.refused:8d} "
                     f"{m.runs:5d}")
    verdict = "wrote config.toml" if report.written else "left config.toml unchanged"
    lines.append(f"{verdict}: {report.why} ({report.seconds:.0f} s)")
    if report.chosen is not None and report.chosen is not report.current:
        lines.append("  best: " + ", ".join(f"{k} = {v}" for k, v in report.chosen.layout.keys().items())
                     + (f" (version {report.chosen.layout.version})" if report.chosen.layout.version
                        != report.current.layout.version else ""))
    return "\n".join(lines)
