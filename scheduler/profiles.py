"""The scheduler's latency profiles: one per (model, version, execution provider), learned from
execution reports and kept in Redis, so that a scheduler that takes over plans from what its
predecessor learned rather than from nothing (scheduler/profile.py is one profile)."""
from __future__ import annotations

import struct
import time


from batchline.contract.keys import ModelKey
from batchline.planning import BatchCost
from batchline.contract.scheduler_store import ProfileKey, SchedulerStore
from batchline.protocol import internal_pb2 as pb
from batchline.registry import Registry
from scheduler.profile import LatencyProfile

# The provider of an executor not registered (any more): its reports still count somewhere.
UNKNOWN_KIND = "unknown"
# One sample as saved: units and seconds; warm-up samples are saved with negative units.
_SAMPLE = struct.Struct("<ff")
_NOT_REGISTERED = pb.ModelInfo()
# Weight of a batch in the moving average of a model's elements per row.
LENGTH_WEIGHT = 0.05


def kind(registry: Registry, executor_id: str, model: ModelKey) -> str:
    """The execution provider an executor runs a model on: executors of one kind share a profile."""
    info = registry.executors.get(executor_id)
    if info is not None:
        for m in info.models:
            if (m.name, m.version) == model and m.providers:
                return m.providers[0]
    return UNKNOWN_KIND


class Profiles:
    def __init__(self, store: SchedulerStore, default_s: float, margin_quantile: float) -> None:
        self.store = store
        self.default_s = default_s
        self.margin_quantile = margin_quantile
        self.by_key: dict[ProfileKey, LatencyProfile] = {}
        self.lengths: dict[ModelKey, float] = {}  # elements per row, averaged over the batches reported
        self._adopted: set[ProfileKey] = set()  # profiles whose saved samples this lease has read
        self.saved_at = time.monotonic()

    def of(self, key: ProfileKey) -> LatencyProfile:
        """The profile of `key`, new if this scheduler has none yet."""
        p = self.by_key.get(key)
        if p is None:
            p = self.by_key[key] = LatencyProfile(default=self.default_s, margin_quantile=self.margin_quantile)
        return p

    def cost_for_model(self, registry: Registry, model: ModelKey, holders: list[str], overhead_s: float) -> BatchCost:
        """The cost to plan with: no less than any holder kind's at any size, so that plans err late,
        not early (kinds differ in slope: a GPU's fixed cost is higher and its per-unit cost lower)."""
        kinds = {kind(registry, e, model) for e in holders} or {UNKNOWN_KIND}
        return BatchCost.upper([self.of((*model, k)).cost(overhead_s) for k in sorted(kinds)])

    def observe(self, registry: Registry, report: pb.ExecutionReport) -> None:
        model = (report.model_name, report.model_version)
        # A generative model's batch lasts as long as its sequence's answer, which no plan predicts:
        # its requests go to free cache slots, and its executors learn its step costs themselves.
        if report.rows and not registry.models.get(model, _NOT_REGISTERED).generation:
            seconds = (report.compute_input_ns + report.compute_infer_ns + report.compute_output_ns) / 1e9
            self.of((*model, kind(registry, report.executor_id, model))).observe(
                report.units or report.rows, seconds, warm_up=report.warmup)
            if not report.warmup:
                per_row = (report.units or report.rows) / report.rows
                held = self.lengths.get(model)
                self.lengths[model] = per_row if held is None else held + LENGTH_WEIGHT * (per_row - held)

    def length(self, model: ModelKey) -> int:
        """The elements per row (padded to each batch's longest) of the batches the model ran lately:
        the request the demand's capacity is played with (batchline.planning.capacity). 1 before
        any report, and always for fixed shapes."""
        return max(1, round(self.lengths.get(model, 1.0)))

    async def adopt(self, keys: list[ProfileKey]) -> None:
        """Adopt the samples a previous scheduler saved, once per profile and lease: under the samples
        this one observed already (a step's reports come in before its plan adopts), not instead of them.
        A profile that skipped its saved samples would be saved over them a few seconds later."""
        missing = [k for k in keys if k not in self._adopted]
        if not missing:
            return
        blobs = await self.store.saved_profiles(missing)
        for key, blob in zip(missing, blobs):
            self._adopted.add(key)
            if not blob:
                self.of(key)
                continue
            seen = self.by_key.pop(key, None)
            profile = self.of(key)
            for units, seconds in _SAMPLE.iter_unpack(blob):
                profile.observe(abs(int(units)), float(seconds), warm_up=units < 0)
            if seen is not None:  # newer than the saved ones: observed on top of them
                for units, seconds in seen.warm_up_samples():
                    profile.observe(units, seconds, warm_up=True)
                for units, seconds in seen.samples():
                    profile.observe(units, seconds)

    def forget(self) -> None:
        """Another scheduler led meanwhile, and saved what it learned: adopt it again."""
        self.by_key.clear()
        self._adopted.clear()

    async def save(self) -> None:
        self.saved_at = time.monotonic()
        if not self.by_key:
            return
        await self.store.save_profiles({
            key: b"".join([*(_SAMPLE.pack(-r, s) for r, s in profile.warm_up_samples()),
                           *(_SAMPLE.pack(r, s) for r, s in profile.samples())])
            for key, profile in self.by_key.items() if len(profile)})
