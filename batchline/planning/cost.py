"""What a batch costs: the one model of it that the scheduler plans by and the gateways admit by.

A batch of `units` (rows x its longest member's length: batchline.sizing)
runs, typically, for the latency profile's fit a·units + b (scheduler/profile.py
learns it), plus the time it spends outside the model (the overhead: Redis
round trips, decoding, encoding). A batch is dispatched and admitted by that
plus a margin, a high quantile of how far batches of its size class overran
the fit, so predictions err late; a request is judged hopeless by the typical
cost alone (a spell of slow runs can push the margin past every budget, and
judging by it would then shed everything, so nothing would run and report).

The scheduler publishes the numbers in each model's load view (pb.ModelLoad),
and the gateways rebuild the same object from it: both sides predict with
this code.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from batchline.protocol import internal_pb2 as pb
from batchline.sizing import margin_for


class Cost(Protocol):
    """Seconds a batch of `units` takes, dispatch to answer."""

    def predict(self, units: int) -> float:
        """With the margin of its size: what dispatch and admission go by."""

    def typical(self, units: int) -> float:
        """Without the margin: what a request is judged hopeless by."""


@dataclass(slots=True)
class BatchCost:
    per_unit_s: float = 0.0          # the fit's a
    fixed_s: float = 0.0             # the fit's b
    margin_s: float = 0.0            # over batches of every size (the table's default)
    margin_by_size_s: tuple[float, ...] = ()  # per size class (batchline.sizing.margin_for)
    overhead_s: float = 0.0          # per batch, outside the model

    def typical(self, units: int) -> float:
        return max(0.0, self.per_unit_s * units + self.fixed_s) + self.overhead_s

    def margin(self, units: int) -> float:
        return margin_for(self.margin_by_size_s, units, self.margin_s)

    def predict(self, units: int) -> float:
        return self.typical(units) + self.margin(units)

    @classmethod
    def upper(cls, costs: Sequence["BatchCost"]) -> "BatchCost":
        """A cost no less than any of `costs` at any size (the executors of one model on different
        hardware): the largest per-unit and fixed costs, and per size class the largest margin."""
        if len(costs) == 1:
            return costs[0]
        classes = max(len(c.margin_by_size_s) for c in costs)
        table = tuple(max(c.margin_by_size_s[min(k, len(c.margin_by_size_s) - 1)] if c.margin_by_size_s
                          else c.margin_s for c in costs) for k in range(classes))
        return cls(max(c.per_unit_s for c in costs), max(c.fixed_s for c in costs), max(c.margin_s for c in costs),
                   table, max(c.overhead_s for c in costs))

    @classmethod
    def of_load(cls, load: pb.ModelLoad) -> "BatchCost":
        """The cost a scheduler published in a model's load view."""
        return cls(load.cost_per_unit_s, load.cost_fixed_s, load.cost_margin_s,
                   tuple(load.margin_by_size_s), load.overhead_s)

    def load_fields(self) -> dict[str, Any]:
        """The pb.ModelLoad fields that carry this cost to the gateways (`of_load` reads them back)."""
        return {"cost_per_unit_s": self.per_unit_s, "cost_fixed_s": self.fixed_s, "cost_margin_s": self.margin_s,
                "margin_by_size_s": self.margin_by_size_s, "overhead_s": self.overhead_s}


@dataclass(frozen=True, slots=True)
class FunctionCost:
    """A cost given as functions of units: a stand-in for a fitted profile (tests, what-if studies)."""
    predict_s: Callable[[int], float]
    typical_s: Callable[[int], float] | None = None  # None: the same as predict_s (no margin)
    overhead_s: float = 0.0

    def predict(self, units: int) -> float:
        return self.predict_s(units) + self.overhead_s

    def typical(self, units: int) -> float:
        return (self.typical_s or self.predict_s)(units) + self.overhead_s
