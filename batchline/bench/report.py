"""Results of a benchmark run: the printed table, the JSON file and the PNG plot."""
from __future__ import annotations

import dataclasses
import json
import pathlib
from dataclasses import dataclass, field
from typing import Any

from batchline.bench.loadgen import StepResult


@dataclass
class BenchResult:
    target: dict[str, str]            # url, model, version
    config: dict[str, Any]            # mode, budget, input shapes, durations...
    started_at: str
    steps: list[StepResult] = field(default_factory=list)

    @property
    def mode(self) -> str:
        return self.config.get("mode", self.steps[0].mode if self.steps else "closed")

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "config": self.config,
            "started_at": self.started_at,
            "steps": [dataclasses.asdict(s) for s in self.steps],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "BenchResult":
        steps = []
        for s in data.get("steps", []):
            s = dict(s)
            if s.get("burst") is not None:
                s["burst"] = tuple(s["burst"])
            steps.append(StepResult(**s))
        return cls(target=data["target"], config=data["config"], started_at=data["started_at"], steps=steps)


def write_json(path: str | pathlib.Path, result: BenchResult) -> None:
    pathlib.Path(path).write_text(json.dumps(result.to_dict(), indent=2) + "\n")


def read_json(path: str | pathlib.Path) -> BenchResult:
    return BenchResult.from_dict(json.loads(pathlib.Path(path).read_text()))


def _num(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def format_statuses(counts: dict[str, int]) -> str:
    # OK first, then the failures by decreasing count.
    items = sorted(counts.items(), key=lambda kv: (kv[0] != "OK", -kv[1], kv[0]))
    return " ".join(f"{k}={v}" for k, v in items) or "-"


def format_table(steps: list[StepResult]) -> str:
    # Open loop only: how late the client sent vs its schedule; large values mean the
    # load generator itself could not keep up and the offered load is overstated.
    lag = any(s.send_lag_p99_ms is not None for s in steps)
    head = ["step", "offered/s", "thr/s", "good/s", "p50 ms", "p95 ms", "p99 ms", "max ms", "batch"]
    head += ["lag p99 ms"] * lag + ["statuses"]
    rows = [head]
    for s in steps:
        lat = s.latency_ms or {}
        rows.append([
            s.label, _num(s.offered_rps), _num(s.throughput_rps), _num(s.goodput_rps),
            _num(lat.get("p50")), _num(lat.get("p95")), _num(lat.get("p99")), _num(lat.get("max")),
            _num(s.mean_batch_size, ".2f"), *([_num(s.send_lag_p99_ms)] * lag), format_statuses(s.status_counts),
        ])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
    lines = []
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:-1], widths[1:])] + [r[-1]]
        lines.append("  ".join(cells))
    return "\n".join(lines)


def plot(path: str | pathlib.Path, result: BenchResult) -> None:
    """Closed loop: p50/p99 latency vs throughput. Open loop: goodput and throughput vs offered load."""
    import matplotlib

    matplotlib.use("Agg")  # no display; also safe when called from a thread
    import matplotlib.pyplot as plt

    steps = result.steps
    title = f"{result.target['model']} @ {result.target['url']}"
    if steps and steps[0].budget_ms is not None:
        title += f", budget {steps[0].budget_ms:g} ms"
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    try:
        if result.mode == "closed":
            x = [s.throughput_rps for s in steps]
            for key, style in (("p50", "o-"), ("p99", "s--")):
                ax.plot(x, [(s.latency_ms or {}).get(key, float("nan")) for s in steps], style, label=key)
            for s in steps:
                if s.latency_ms:
                    ax.annotate(f"c={s.concurrency}", (s.throughput_rps, s.latency_ms["p99"]),
                                textcoords="offset points", xytext=(4, 4), fontsize=8)
            ax.set_xlabel("throughput (OK answers/s)")
            ax.set_ylabel("latency (ms)")
            ax.set_title(f"closed loop: {title}")
        else:
            x = [s.offered_rps or 0.0 for s in steps]
            ax.plot(x, [s.throughput_rps for s in steps], "o-", label="throughput")
            ax.plot(x, [s.goodput_rps for s in steps], "s-", label="goodput (within budget)")
            top = max(x, default=1.0) or 1.0
            ax.plot([0, top], [0, top], ":", color="grey", label="ideal (y = x)")
            ax.set_xlabel("offered load (requests/s)")
            ax.set_ylabel("answers/s")
            ax.set_title(f"open loop: {title}")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
