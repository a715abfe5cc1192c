"""In-memory stores: the scheduler's and the executor's, over one plain-Python state, for unit
tests of a scheduling step and of the executor's batch path without a Redis.

They keep what those paths read and write (queues, payloads, batches, in-flight sets, work and
reply lists, reports, registrations, load views, statistics), not Redis's expiries, slots or
failures: the Redis-backed stores are tested against a real Redis.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from batchline.contract.calls import FinishedBatch
from batchline.contract.keys import ModelKey, queue_score
from batchline.contract.scheduler_store import ProfileKey, Scan
from batchline.protocol import internal_pb2 as pb


@dataclass
class MemoryState:
    queues: dict[ModelKey, dict[bytes, int]] = field(default_factory=lambda: defaultdict(dict))  # member -> score
    payloads: dict[tuple[ModelKey, str], bytes] = field(default_factory=dict)
    batches: dict[str, pb.Batch] = field(default_factory=dict)
    inflight: dict[tuple[str, ModelKey], set[bytes]] = field(default_factory=lambda: defaultdict(set))
    work: dict[str, list[bytes]] = field(default_factory=lambda: defaultdict(list))
    replies: dict[str, list[bytes]] = field(default_factory=lambda: defaultdict(list))
    reports: list[bytes] = field(default_factory=list)
    registrations: dict[str, bytes | None] = field(default_factory=dict)  # executor id -> ExecutorInfo
    gateways: dict[str, str] = field(default_factory=dict)                # heartbeats: id -> address
    loads: dict[ModelKey, bytes] = field(default_factory=dict)
    profiles: dict[ProfileKey, bytes] = field(default_factory=dict)
    stats: dict[ModelKey, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    arrivals: Counter[ModelKey] = field(default_factory=Counter)  # what the gateways counted
    demand: bytes | None = None
    leader: str | None = None

    def enqueue(self, model: ModelKey, entry: pb.QueueEntry, payload: bytes) -> None:
        """What a gateway's group commit writes for one request."""
        self.payloads[(model, entry.request_id)] = payload
        self.queues[model][entry.SerializeToString()] = queue_score(entry.priority, entry.deadline_us)


class _MemoryStore:
    def __init__(self, state: MemoryState) -> None:
        self.state = state

    async def aclose(self) -> None:
        pass

    async def registrations(self) -> list[tuple[str, bytes | None]]:
        return sorted(self.state.registrations.items())

    async def requeue_held_batches(self, executor_id: str, *, include_queued: bool,
                                   skip: set[str] | frozenset[str] = frozenset(),
                                   older_than_us: int | None = None,
                                   models: Iterable[ModelKey] = ()) -> Counter[ModelKey]:
        # (every in-flight set is looked at here: `models` adds none the state does not hold)
        s, requeued = self.state, Counter[ModelKey]()
        queued = {pb.Batch.FromString(b).batch_id for b in s.work[executor_id]}
        for (eid, model), ids in s.inflight.items():
            for bid in [b.decode() for b in ids if eid == executor_id]:
                batch = s.batches.get(bid)
                if bid in skip or (bid in queued and not include_queued) or batch is None or \
                        (older_than_us is not None and batch.dispatched_us >= older_than_us):
                    continue
                requeued[model] += await self.hand_back(executor_id, batch)
        if include_queued:
            s.work.pop(executor_id, None)
        return requeued

    async def hand_back(self, executor_id: str, batch: pb.Batch) -> int:
        s, model = self.state, (batch.model_name, batch.model_version)
        s.batches.pop(batch.batch_id, None)
        held = s.inflight[(executor_id, model)]
        # Only the party that takes the batch off the in-flight set requeues it (HAND_BACK_LUA).
        live = [e for e in batch.members if (model, e.request_id) in s.payloads] \
            if batch.batch_id.encode() in held else []
        held.discard(batch.batch_id.encode())
        for e in live:
            s.queues[model][e.SerializeToString()] = queue_score(e.priority, e.deadline_us)
        s.reports.append(pb.ExecutionReport(executor_id=executor_id).SerializeToString())
        return len(live)


class MemoryStepWrites:
    """A step's writes, applied to the state at execute(), one result each."""

    def __init__(self, state: MemoryState) -> None:
        self.state = state
        self._writes: list[Callable[[], Any]] = []

    async def __aenter__(self) -> MemoryStepWrites:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._writes.clear()

    def __len__(self) -> int:
        return len(self._writes)

    def dispatch(self, batch: pb.Batch, members: Sequence[bytes], batch_ttl_ms: int,
                 blob: bytes | None = None) -> None:
        def run() -> int:
            s, model = self.state, (batch.model_name, batch.model_version)
            if not all(m in s.queues[model] for m in members):
                return 0  # all of them or none, as DISPATCH_LUA on one Redis
            taken = [m for m in members if s.queues[model].pop(m, None) is not None]
            if taken:
                stored = batch if blob is None else pb.Batch.FromString(blob)
                s.batches[batch.batch_id] = stored
                s.inflight[(batch.executor_id, model)].add(batch.batch_id.encode())
                s.work[batch.executor_id].append(blob if blob is not None else batch.SerializeToString())
            return len(taken)
        self._writes.append(run)

    def shed(self, model: ModelKey, members: Sequence[bytes], request_ids: Sequence[str],
             replies: Mapping[str, Sequence[pb.Reply]]) -> None:
        def run() -> int:
            # Only what is still queued, as SHED_LUA on one Redis.
            s = self.state
            shed = {r for m, r in zip(members, request_ids) if s.queues[model].pop(m, None) is not None}
            for r in shed:
                s.payloads.pop((model, r), None)
            for gateway_id, answers in replies.items():
                s.replies[gateway_id] += [a.SerializeToString() for a in answers if a.request_id in shed]
            s.stats[model]["fail_count"] += len(shed)
            return len(shed)
        self._writes.append(run)

    def drop(self, model: ModelKey, members: Sequence[bytes]) -> None:
        def run() -> None:
            for m in members:
                self.state.queues[model].pop(m, None)
        self._writes.append(run)

    def publish_load(self, model: ModelKey, load: bytes) -> None:
        self._writes.append(lambda: self.state.loads.__setitem__(model, load))

    async def execute(self) -> list[Any]:
        writes, self._writes = self._writes, []
        return [w() for w in writes]


class MemorySchedulerStore(_MemoryStore):
    def __init__(self, state: MemoryState) -> None:
        super().__init__(state)
        self.wakes = 0  # how often the scheduler ended its own blocking wait

    async def scan(self, notices: Sequence[str], models: Sequence[ModelKey],
                   inflight: Sequence[tuple[str, ModelKey]], scan_limit: int, drain: int) -> Scan:
        s = self.state
        reports, s.reports = s.reports[:drain], s.reports[drain:]
        heads = [sorted(s.queues[m], key=s.queues[m].__getitem__)[:scan_limit] for m in models]
        return Scan(reports, heads, [len(s.queues[m]) for m in models], [set(s.inflight[p]) for p in inflight])

    def step_writes(self) -> MemoryStepWrites:
        return MemoryStepWrites(self.state)

    async def wake(self, scheduler_id: str) -> None:
        self.wakes += 1

    async def forget_executor(self, executor_id: str) -> None:
        self.state.registrations.pop(executor_id, None)

    async def take_lease(self, holder_id: str, ttl_ms: int) -> bool:
        if self.state.leader in (None, holder_id):
            self.state.leader = holder_id
        return self.state.leader == holder_id

    async def release_lease(self, holder_id: str) -> None:
        if self.state.leader == holder_id:
            self.state.leader = None

    async def saved_profiles(self, keys: Sequence[ProfileKey]) -> list[bytes | None]:
        return [self.state.profiles.get(key) for key in keys]

    async def arrival_counts(self, models: Sequence[ModelKey]) -> list[int]:
        return [self.state.arrivals[m] for m in models]

    async def publish_demand(self, demand: bytes) -> None:
        self.state.demand = demand

    async def save_profiles(self, samples: Mapping[ProfileKey, bytes]) -> None:
        self.state.profiles.update(samples)


class MemoryExecutorStore(_MemoryStore):
    async def fetch(self, model: ModelKey, request_ids: Sequence[str],
                    gateway_ids: Sequence[str]) -> tuple[list[bytes | None], list[bytes | None]]:
        s = self.state
        beats = [s.gateways[g].encode() if g in s.gateways else None for g in gateway_ids]
        return [s.payloads.get((model, r)) for r in request_ids], beats

    async def payloads_held(self, requests: Sequence[tuple[str, ModelKey]]) -> list[bool]:
        return [(model, r) in self.state.payloads for r, model in requests]

    async def batch_done(self, done: FinishedBatch) -> None:
        s, batch = self.state, done.batch
        for gateway_id, items in done.replies.items():
            s.replies[gateway_id] += items
        for m in batch.members:
            s.payloads.pop((done.model, m.request_id), None)
        s.batches.pop(batch.batch_id, None)
        s.inflight[(done.report.executor_id, done.model)].discard(batch.batch_id.encode())
        s.reports.append(done.report.SerializeToString())
        stats = list(done.stats)
        for name, n in zip(stats[::2], stats[1::2]):
            s.stats[done.model][str(name)] += int(n)
