"""The scheduler: reads queues and executor load from Redis, plans, dispatches.

`step()` coordinates one round: it reads every queue's head and every
executor's in-flight set in one round trip, asks the pure policy
(scheduler.policy.plan) what to do with each queue, and writes the sheds, the
dispatches and the load view in one more. The scheduler never touches
tensors: it moves queue members (request metadata) into batches and tells
executors which batches are theirs. Its parts:

- leadership.py: the lease; only its holder dispatches.
- fleet.py: the executors' registry, and the batches of dead executors handed back.
- wakeups.py: what wakes the loop (arrivals, reports) and what it leaves asleep.
- queues.py: each queue's entries parsed once, company rates, depth gauges.
- timeline.py: when each executor is free.
- profiles.py: the latency profiles, learned from reports and kept in Redis.
- dispatch.py: what a step writes for batches and sheds (every model's in one round trip).
- generation.py: where a generative model's requests go (each alone, to free cache).
- load_views.py: the views the gateways' admission control reads.
- demand.py: the arrival forecast and the executors wanted, for the autoscalers.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from functools import partial

from batchline import contract, metrics
from batchline.contract.keys import ModelKey
from batchline.contract.scheduler_store import SchedulerStore, StepWrites
from batchline.lifecycle import stop_tasks
from batchline.protocol import internal_pb2 as pb
from batchline.protocol import internal_pb2_grpc
from batchline.redis_client import REDIS_ERRORS, WAIT_RETRY_S, connect, connect_blocking
from batchline.registry import Registry
from batchline.planning import BatchCost, BatchingRule
from scheduler import dispatch, generation
from scheduler.demand import Demand
from scheduler.fleet import Fleet
from scheduler.leadership import Lease
from scheduler.load_views import LoadViews
from scheduler.policy import FIFO, ModelPolicy, PlannedBatch, busy_until, plan
from scheduler.profiles import Profiles, kind
from scheduler.queues import Queues
from scheduler.settings import SchedulerSettings
from scheduler.timeline import ExecutorTimeline
from scheduler.wakeups import DRAIN, Wakeups

log = logging.getLogger(__name__)

# After a step that failed for a reason other than Redis, the next one begins this much later.
FAILED_STEP_RETRY_S = 0.1


class Scheduler:
    def __init__(self, settings: SchedulerSettings, store: SchedulerStore | None = None):
        self.settings = settings
        self.scheduler_id = settings.scheduler_id or f"sched-{uuid.uuid4().hex[:12]}"
        self.store = store or SchedulerStore(connect(settings.redis_url, settings.redis_timeout_s),
                                             connect_blocking(settings.redis_url, settings.redis_timeout_s))
        self.fleet = Fleet(self.store, settings.registry_refresh_s)
        self.lease = Lease(self.store, self.scheduler_id, settings.lease_ttl_s)
        self.wakeups = Wakeups(self.store, self.scheduler_id, lambda: self.lease.held)
        self.views = LoadViews(settings.policy)
        self.queues = Queues(self.views)
        self.timeline = ExecutorTimeline(settings.default_execution_ms / 1000, settings.max_batches_per_executor)
        self.profiles = Profiles(self.store, settings.default_execution_ms / 1000, settings.margin_quantile)
        self.demand = Demand(self.store, self.scheduler_id, settings.demand())
        # Per model served, what this step planned it by (rule, cost, holders): the demand step reads them.
        self._plans: dict[ModelKey, tuple[BatchingRule, BatchCost, list[str], int]] = {}
        self._queued: dict[ModelKey, tuple[int, float]] = {}  # per model, its queue read and its oldest's age
        # Per generative model served, its holders and its sequences in flight: the demand step reads them.
        self._generating: dict[ModelKey, tuple[list[str], int, int]] = {}
        self._sequences_sent: Counter[ModelKey] = Counter()  # generative requests sent, ever: their throughput
        self._scanned_at = 0.0  # when the last step began reading the queues
        self._held: dict[str, int] = {}  # batches each executor holds: as the step read them, and those it sent
        # Sequences of each generative model each executor holds (its in-flight batches of it).
        self._sequences: dict[tuple[str, ModelKey], int] = {}
        self._tasks: list[asyncio.Task] = []
        self.counts: Counter[str] = Counter()

    @property
    def registry(self) -> Registry:
        return self.fleet.registry

    @property
    def leader(self) -> bool:
        return self.lease.held

    @property
    def depths(self) -> dict[ModelKey, int]:
        return self.queues.depths

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self.wakeups.listen(), name="listen"),
            asyncio.create_task(self._loop(), name="loop"),
        ]
        log.info("scheduler %s started (policy %s)", self.scheduler_id, self.settings.policy)

    async def stop(self) -> None:
        await stop_tasks(self._tasks)
        try:
            if self.lease.held:
                await self.profiles.save()
                await self.lease.release()
        except REDIS_ERRORS:
            pass
        self.lease.held = False
        self.queues.forget_gauges()
        self.demand.forget_gauges()
        await self.store.aclose()

    async def _loop(self) -> None:
        wake_at: float | None = None
        while True:
            timeout = min(self.settings.registry_refresh_s, self.lease.renew_every_s)
            if wake_at is not None:
                timeout = min(timeout, max(0.0, wake_at - time.time()))
            await _wait(self.wakeups.event, timeout)
            self.wakeups.step_begins()
            try:
                wake_at = await self.step() if await self._hold_lease() else None
            except REDIS_ERRORS as exc:
                log.warning("scheduling step failed: %s", exc)
                self.fleet.heartbeats.redis_trouble()
                wake_at = None
                await asyncio.sleep(WAIT_RETRY_S)
            except Exception:  # the loop must survive a bad step
                log.exception("scheduling step failed")
                wake_at = None
                await asyncio.sleep(FAILED_STEP_RETRY_S)
            finally:
                wake_at = self.wakeups.step_ended(wake_at)

    async def _hold_lease(self) -> bool:
        """Take or renew the lease when due; True while this scheduler leads."""
        was = self.lease.held
        held = await self.lease.hold()
        if held != was:
            log.info("scheduler %s %s the lease", self.scheduler_id, "took" if held else "lost")
            if held:
                # Another scheduler dispatched meanwhile: forget what we knew.
                self.timeline.forget()
                self.queues.forget_steps()
                self.fleet.read_again()
                self.demand.forget()
                self.profiles.forget()
            else:
                self.queues.forget_gauges()
                self.demand.forget_gauges()
        metrics.SCHEDULER_LEADER.set(1 if held else 0)
        if held != was or not held:
            # Taken: the blocking wait listens as a standby; make it take the shared lists now.
            # Lost: make it leave them to the new leader.
            await self.wakeups.relisten()
        return held

    # -- one step ----------------------------------------------------------

    async def step(self) -> float | None:
        """Read state, decide, act. Returns when to look again (epoch seconds) if nothing happens."""
        if self.fleet.due():
            await self._refresh_registry()
        models = sorted(self.registry.models)
        self.queues.forget_gauges(keep=models)  # of models served no more: their last depths would stay
        executors = sorted(self.registry.executors)
        # The load view is "as of" before the read: a request whose enqueue a gateway saw
        # confirmed by then is in it, any later one the gateway still counts itself.
        self._scanned_at = time.time()
        heads, held = await self._scan(models, executors)
        now = time.time()
        free_at = {eid: self.timeline.free_at(eid, {b.decode() for b in batches}, now)
                   for eid, batches in zip(executors, held)}
        self._held = {eid: len(batches) for eid, batches in zip(executors, held)}
        wake_at: float | None = None
        self._plans, self._generating, self._queued = {}, {}, {}
        # What the step does goes to Redis in one round trip, every model's: sheds, dispatches, load views.
        sends: list[tuple[ModelKey, int, dispatch.Sent, bool]] = []  # (model, result index, dispatch, timed)
        shed: list[tuple[ModelKey, int]] = []  # (model, result index): its result is how many were still queued
        async with self.store.step_writes() as pipe:
            for key, members in zip(models, heads):
                wake_at = _earlier(wake_at, await self._schedule(key, members, free_at, now, pipe, sends, shed))
            try:
                results = await pipe.execute()
            finally:
                for _, _, sent, _ in sends:
                    if sent.span is not None:
                        sent.span.end()
        for key, i in shed:
            self.counts["shed"] += results[i]
            metrics.SHED.labels(*key).inc(results[i])
        for key, i, sent, timed in sends:
            if dispatch.book(key, sent, results[i], self.counts) and timed:
                self.timeline.dispatched(sent.executor_id, sent.batch_id, sent.planned.start, sent.planned.finish)
        # An empty queue planned before another queue's dispatch kept the shared
        # executor busy: look again, so that arrivals to it need no wake-up either.
        for key in models:
            if not self.queues.depths[key] and contract.queue(key) not in self.wakeups.blocked:
                ready = [free_at[e] for e in self._holders(key, free_at) if free_at[e] != float("inf")]
                blocked, ready_at = busy_until(now, ready, self.settings.dispatch_lead_ms / 1000)
                if blocked:
                    self.wakeups.blocked.add(contract.queue(key))
                    wake_at = _earlier(wake_at, ready_at)
        self.queues.keep_only({m for members in heads for m in members})
        if self.demand.due(now):
            await self.demand.step(self.registry, self._plans, self.depths, now, self._generating,
                                   self._queued)
            wake_at = _earlier(wake_at, now + self.settings.forecast_step_s)
        await self.wakeups.relisten()
        if time.monotonic() - self.profiles.saved_at >= self.settings.profile_save_s:
            await self.profiles.save()
        return wake_at

    async def _refresh_registry(self) -> None:
        for eid, requeued in (await self.fleet.refresh()).items():
            self.timeline.forget(eid)
            self.counts["redispatched"] += requeued
        self.wakeups.notify = {contract.notify(k): contract.queue(k) for k in sorted(self.registry.models)}

    async def _scan(self, models: list[ModelKey], executors: list[str]) -> tuple[list[list[bytes]], list[set[bytes]]]:
        """One round trip: drop the arrivals' tokens, take the reports, read each queue's head and
        depth and each executor's in-flight sets. Returns the heads and each executor's batch ids."""
        # An executor's in-flight sets are per model (in the model's slot): one per model it has.
        sets = [(eid, (m.name, m.version)) for eid in executors for m in self.registry.executors[eid].models]
        async with metrics.redis_rtt("scheduler", "scan"):
            scan = await self.store.scan(list(self.wakeups.notify), models, sets, self.settings.queue_scan_limit, DRAIN)
        self._observe(self.wakeups.take_reports() + scan.reports)
        for key, depth in zip(models, scan.depths):
            self.queues.depths[key] = depth
        held: dict[str, set[bytes]] = {eid: set() for eid in executors}
        self._sequences = {}
        for (eid, key), ids in zip(sets, scan.inflight):
            if self.registry.models.get(key, pb.ModelInfo()).generation:
                # Sequences in the engine: they take cache slots, not the executor's batch turns.
                self._sequences[(eid, key)] = len(ids)
            else:
                held[eid] |= ids
        return scan.heads, [held[eid] for eid in executors]

    def _observe(self, reports: list[bytes]) -> None:
        for blob in reports:
            r = pb.ExecutionReport.FromString(blob)
            if r.ran_until_us:
                self.timeline.reported(r.executor_id, r.ran_until_us / 1e6)
            self.profiles.observe(self.registry, r)

    def _holders(self, key: ModelKey, free_at: dict[str, float]) -> list[str]:
        """The executors that may take batches of this model: those serving it; when none does,
        those releasing it (they finish what was queued before they stop)."""
        for executors in (self.registry.holders.get(key, []), self.registry.leaving.get(key, [])):
            usable = [e for e in executors if e in free_at and not self.registry.executors[e].draining]
            if usable:
                return usable
        return []

    async def _schedule(self, key: ModelKey, members: list[bytes], free_at: dict[str, float], now: float,
                        pipe: StepWrites, sends: list[tuple[ModelKey, int, dispatch.Sent, bool]],
                        shed: list[tuple[ModelKey, int]]) -> float | None:
        """Plan one model's queue and queue on `pipe` what the plan says (its dispatches on `sends`,
        its sheds on `shed`, both booked once the step's writes are done); when to look at it
        again."""
        info = self.registry.models[key]
        if info.generation:
            self._place_sequences(key, info, members, free_at, now, pipe, sends, shed)
            return None
        holders = self._holders(key, free_at)
        await self.profiles.adopt([(*key, kind(self.registry, e, key)) for e in holders])
        cost = self.profiles.cost_for_model(self.registry, key, holders, self.settings.overhead_ms / 1000)
        queue, arrivals = self.queues.read(key, members, partial(pipe.drop, key))
        # FIFO is the Triton baseline: it always waits max_queue_delay.
        company = self.queues.company(key, len(queue), arrivals, now) if self.settings.policy != FIFO else None
        self.queues.report(key, info.priority_levels, queue)
        policy = ModelPolicy.of_model(info, self.settings.policy, self.settings.length_aware_batching,
                                      self.settings.even_lanes_batching)
        ready = [e for e in holders if free_at[e] != float("inf")]
        most = self.settings.max_batches_per_executor
        decision = plan(now, queue, policy, [free_at[e] for e in ready], cost,
                        lead=self.settings.dispatch_lead_ms / 1000, company=company,
                        in_share_budget=self.queues.in_share_budget(key, now),
                        busy=[bool(self._held.get(e)) for e in ready],
                        room=[most - self._held.get(e, 0) for e in ready])
        self._plans[key] = (decision.rule, cost, holders, self.profiles.length(key))
        # The queue read and the age of its oldest at the read (the demand step makes a rate of them).
        self._queued[key] = (len(queue), max(0.0, self._scanned_at - min(p.enqueued for p in queue))) if queue \
            else (0, 0.0)
        (self.wakeups.blocked.add if decision.blocked else self.wakeups.blocked.discard)(contract.queue(key))
        if decision.expired:
            shed.append((key, len(pipe)))
            dispatch.shed(pipe, key, decision.expired, self.queues.entries)
        for planned in decision.batches:
            eid = ready[planned.executor]
            # Held from now on, for the plans of the models after this one too.
            self._held[eid] = self._held.get(eid, 0) + 1
            free_at[eid] = planned.finish if self._held[eid] < most else float("inf")
            self.timeline.planned(eid, planned.finish, now)
            entries = [self.queues.entries[m.member] for m in planned.members]
            sends.append((key, len(pipe), dispatch.send(pipe, key, eid, planned, entries), True))
        # The view shows what is left after this step: a batch just sent must not
        # look joinable to a request admitted against it.
        gone = ({m.request_id for b in decision.batches for m in b.members}
                | {p.request_id for p in decision.expired})
        left = [p for p in queue if p.request_id not in gone] if gone else queue
        self.queues.left(key, now, len(left))
        if self.settings.policy != FIFO and self.views.due(key, now, changed=bool(gone)):
            idle_at = [max(now, self.timeline.idle_at.get(e, now)) for e in holders]
            self.views.publish(pipe, key, info, idle_at, cost, decision.rule, left, now, self._scanned_at)
        return decision.wake_at

    def _place_sequences(self, key: ModelKey, info: pb.ModelInfo, members: list[bytes], free_at: dict[str, float],
                         now: float, pipe: StepWrites, sends: list[tuple[ModelKey, int, dispatch.Sent, bool]],
                         shed: list[tuple[ModelKey, int]]) -> None:
        """A generative model's queue: each request alone to an executor with a free cache slot
        (scheduler/generation.py); those whose deadline passed in the queue are shed."""
        holders = self._holders(key, free_at)
        free = {e: generation.slots(list(self.registry.executors[e].models), key) - self._sequences.get((e, key), 0)
                for e in holders}
        self._generating[key] = (holders, sum(n for (_, k), n in self._sequences.items() if k == key),
                                 self._sequences_sent[key])
        queue, _ = self.queues.read(key, members, partial(pipe.drop, key))
        self.queues.report(key, info.priority_levels, queue)
        expired = [p for p in queue if p.deadline <= now]
        placed = generation.place([p for p in queue if p.deadline > now], free)
        self.wakeups.blocked.discard(contract.queue(key))
        if expired:
            shed.append((key, len(pipe)))
            dispatch.shed(pipe, key, expired, self.queues.entries)
        self._sequences_sent[key] += len(placed)
        for eid, p in placed:
            planned = PlannedBatch((p,), p.rows, "generation", p.deadline - now, 0, now, now)
            # (not on the timeline: sequences take cache slots, not the executor's batch turns)
            sends.append((key, len(pipe), dispatch.send(pipe, key, eid, planned, [self.queues.entries[p.member]]),
                          False))
        self.queues.left(key, now, len(queue) - len(expired) - len(placed))

    def status(self) -> pb.SchedulerStatus:
        return pb.SchedulerStatus(
            scheduler_id=self.scheduler_id,
            queues=[pb.SchedulerStatus.ModelQueue(model_name=f"{n}:{v}", depth=d)
                    for (n, v), d in sorted(self.depths.items())],
            executors=list(self.registry.executors.values()),
            dispatched_batches=self.counts["batches"],
            dispatched_requests=self.counts["requests"],
            shed_requests=self.counts["shed"],
            leader=self.leader,
            redispatched_requests=self.counts["redispatched"],
        )


async def _wait(event: asyncio.Event, timeout: float) -> None:
    """Until `event` is set or `timeout` s have passed. Not asyncio.wait_for, which makes a task of
    every wait: the loop waits once a step, hundreds of times a second under load."""
    if event.is_set():
        return
    timer = asyncio.get_running_loop().call_later(timeout, event.set)
    try:
        await event.wait()
    finally:
        timer.cancel()


def _earlier(a: float | None, b: float | None) -> float | None:
    return b if a is None or (b is not None and b < a) else a


class SchedulerControl(internal_pb2_grpc.SchedulerServicer):
    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler

    async def Status(self, request, context):
        return self.scheduler.status()
