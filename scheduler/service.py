"""The scheduler loop: reads queues and executor load from Redis, applies the policy, dispatches.

All decisions come from `scheduler.policy.plan`; this module only does I/O.
It never touches tensors: it moves queue members (request metadata) into
batches and tells executors which batches are theirs.

Only the holder of the lease in Redis dispatches, so a second scheduler
started by mistake (or as a standby) cannot double-dispatch. The leader also
hands back the batches of executors whose heartbeat expired, keeps one
latency profile per (model, version, executor kind) learned from execution
reports and saved in Redis, and publishes per model the load view that
gateways use for admission control.

Wake-ups: a BLMPOP task wakes the loop when a gateway enqueues (a token on the
queue's notify list) or an executor reports (or its batches are handed back); it
leaves alone the tokens of queues that wait for a busy executor, whose report
wakes the loop anyway. Timers (a batch's delay or deadline) are kept locally
because Redis only honours blocking timeouts to its cron tick (100 ms by default).
"""
from __future__ import annotations

import asyncio
import logging
import struct
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

import grpc

from batchline import contract, metrics, telemetry, tracecontext
from batchline.clock import now_us
from batchline.errors import duration_text
from batchline.lifecycle import stop_tasks
from batchline.protocol import internal_pb2 as pb
from batchline.protocol import internal_pb2_grpc
from batchline.recovery import requeue_held_batches
from batchline.redis_client import REDIS_ERRORS, ListPop, connect, connect_blocking
from batchline.registry import Registry
from scheduler.company import CompanyRate
from batchline.planning import BatchCost, Pending, queue_tails
from scheduler.policy import FIFO, ModelPolicy, PlannedBatch, busy_until, free_after, plan
from scheduler.profile import LatencyProfile
from scheduler.settings import SchedulerSettings

log = logging.getLogger(__name__)

_DRAIN = 10_000
_LOAD_EVERY_S = 0.02
# How soon an arrival noticed during a step, after the step had read its queue, gets a look.
_NOTICE_RECHECK_S = 0.002
_UNKNOWN_KIND = "unknown"
# A gateway whose requests no view has counted for this long is forgotten (it stopped, or
# sends nothing): its own count of what it admitted is over long before.
_SEEN_KEEP_S = 60.0


_tracer = telemetry.tracer("batchline.scheduler")


def pending_by_level(scanned: list[int], depth: int) -> Counter:
    """Requests waiting per priority level, from the priorities of the queue's scanned head (in
    priority order) and its whole depth: those past the scan limit count at the last level scanned,
    the level the tail starts at, so that the levels add up to the depth."""
    counts = Counter(scanned)
    if scanned and depth > len(scanned):
        counts[scanned[-1]] += depth - len(scanned)
    return counts


@dataclass(slots=True)
class _Sent:
    """A dispatch queued on a step's pipeline, booked once Redis has run it."""
    batch_id: str
    executor_id: str
    planned: PlannedBatch
    entries: list[pb.QueueEntry]
    dispatched_us: int
    span: Any  # the batch's span (tracing on), ended once the dispatch is written


class Scheduler:
    def __init__(self, settings: SchedulerSettings):
        self.settings = settings
        self.scheduler_id = settings.scheduler_id or f"sched-{uuid.uuid4().hex[:12]}"
        self.redis = connect(settings.redis_url, settings.redis_timeout_s)
        self.blocking = connect_blocking(settings.redis_url, settings.redis_timeout_s)
        self.registry = Registry()
        self._registry_at = 0.0
        self.leader = False
        self._lease_at = 0.0
        self.profiles: dict[tuple[str, str, str], LatencyProfile] = {}
        self._profiles_saved_at = time.monotonic()
        # Queue members parsed once, for as long as they stay queued.
        self._pending_cache: dict[bytes, Pending] = {}
        self._entries: dict[bytes, pb.QueueEntry] = {}
        # What this scheduler sent each executor and has not seen answered:
        # batch id -> (dispatched at, predicted cost); predicts when it is free.
        self._ledger: dict[str, dict[str, tuple[float, float]]] = {}
        self._load_at: dict[tuple[str, str], float] = {}
        # Per model, per gateway: the latest enqueued_us of its requests a load view has counted
        # (ModelLoad.seen_us); never lowered, so requests sent on since still count as seen.
        self._seen: dict[tuple[str, str], dict[str, int]] = {}
        self._idle_at: dict[str, float] = {}  # when each executor is predicted to run out of work
        self._ran_until: dict[str, float] = {}  # when each executor's last reported run ended
        self._blocked: set[str] = set()  # queues waiting for an executor, not for company
        self._stepping = False  # a step is under way: its verdicts on _blocked are not in yet
        self._noticed: set[str] = set()  # queues counted as blocked whose arrivals were noticed during the step
        self._levels_reported: dict[tuple[str, str], set[int]] = {}  # priority levels with a pending gauge
        self._company: dict[tuple[str, str], CompanyRate] = {}  # per queue: arrivals seen while n requests waited
        self._left: dict[tuple[str, str], tuple[float, int]] = {}  # per queue: last step's time, requests it left queued
        self._wake = asyncio.Event()
        self._wake_key = contract.scheduler_wake(self.scheduler_id)
        self._scanned_at = 0.0  # when the last step began reading the queues
        self._notify: dict[str, str] = {}  # each registered queue's notify list -> the queue
        self._listening: set[str] = set()  # the lists the blocking wait under way listens to
        self._reports: list[bytes] = []
        self._tasks: list[asyncio.Task] = []
        self._lease = None
        self._release = None
        self.depths: dict[tuple[str, str], int] = {}
        self.counts: Counter[str] = Counter()

    async def start(self) -> None:
        self._lease = self.redis.register_script(contract.LEASE_LUA)
        self._release = self.redis.register_script(contract.RELEASE_LUA)
        self._tasks = [
            asyncio.create_task(self._listen(), name="listen"),
            asyncio.create_task(self._loop(), name="loop"),
        ]
        log.info("scheduler %s started (policy %s)", self.scheduler_id, self.settings.policy)

    async def stop(self) -> None:
        await stop_tasks(self._tasks)
        try:
            if self.leader:
                await self._save_profiles()
                await self._release(keys=[contract.LEADER], args=[self.scheduler_id])
        except REDIS_ERRORS:
            pass
        self.leader = False
        self._forget_gauges()
        await self.redis.aclose()
        await self.blocking.aclose()

    # -- wake-ups ----------------------------------------------------------

    def _listen_keys(self) -> list[str]:
        """What the blocking wait listens to.

        A standby leaves the shared lists to the leader. The leader listens to
        reports, and to the notify lists of the queues that are not blocked: the
        requests of a blocked queue wait for an executor's report or a timer, and
        arrivals cannot change that, so each token read would be a wasted wake-up
        (at small models' rates, about one per request). The next step drops them.
        Its own wake list lets a step interrupt the wait when the lists change.
        """
        if not self.leader:
            return [self._wake_key]
        return [contract.REPORTS, *(n for n, q in self._notify.items() if q not in self._blocked), self._wake_key]

    async def _listen(self) -> None:
        pop = ListPop(self.blocking)
        while True:
            keys = self._listen_keys()
            self._listening = set(keys)
            try:
                item = await pop(keys, _DRAIN)
            except REDIS_ERRORS as exc:
                log.warning("waiting for events failed: %s", exc)
                await asyncio.sleep(0.5)
                continue
            except Exception:  # noqa: BLE001 - the wait must outlive what Redis answers
                log.exception("waiting for events failed")
                await asyncio.sleep(0.5)
                continue
            if item is not None:
                key, values = item
                key = key.decode()
                if key == contract.REPORTS:
                    self._reports.extend(values)
                    self._wake.set()
                elif key != self._wake_key:
                    queue = self._notify.get(key, key)
                    if queue not in self._blocked:
                        self._wake.set()
                    elif self._stepping:
                        # Blocked since the wait began. A queue whose requests wait for a busy
                        # executor needs no new look before that executor reports or its timer
                        # fires. But the step under way may have read the queue before this
                        # arrival, woken by the report that frees the executor: if it no longer
                        # counts the queue as waiting, look again.
                        self._noticed.add(queue)

    async def _relisten(self) -> None:
        """Interrupt the blocking wait when it should listen to a list it does not (a queue no
        longer blocked, a model registered, the lease taken), or to fewer shared lists (the
        lease lost). A wait that listens to more than it needs is left alone: it ends at the
        next report, and a token it reads for a blocked queue is ignored."""
        want = set(self._listen_keys())
        if not want <= self._listening or (not self.leader and want != self._listening):
            async with self.redis.pipeline(transaction=True) as pipe:  # (never without its expiry)
                pipe.rpush(self._wake_key, 1)
                pipe.pexpire(self._wake_key, contract.SCHEDULER_WAKE_TTL_MS)
                await pipe.execute()

    async def _loop(self) -> None:
        wake_at: float | None = None
        while True:
            timeout = min(self.settings.registry_refresh_s, self.settings.lease_ttl_s / 3)
            if wake_at is not None:
                timeout = min(timeout, max(0.0, wake_at - time.time()))
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            self._stepping = True
            try:
                wake_at = await self.step() if await self._hold_lease() else None
            except REDIS_ERRORS as exc:
                log.warning("scheduling step failed: %s", exc)
                wake_at = None
                await asyncio.sleep(0.5)
            except Exception:  # noqa: BLE001 - the loop must survive a bad step
                log.exception("scheduling step failed")
                wake_at = None
                await asyncio.sleep(0.1)
            finally:
                self._stepping = False
                if self._noticed - self._blocked:
                    # Looked at shortly, not at once: under load the next arrival's notice wakes
                    # the loop sooner anyway, and a step per arrival would cost more than it saves.
                    recheck = time.time() + _NOTICE_RECHECK_S
                    wake_at = recheck if wake_at is None else min(wake_at, recheck)
                self._noticed.clear()

    async def _hold_lease(self) -> bool:
        """Take or renew the lease (a third of its TTL apart); True while this scheduler leads."""
        now = time.monotonic()
        if now - self._lease_at < self.settings.lease_ttl_s / 3:
            return self.leader
        held = bool(await self._lease(keys=[contract.LEADER], args=[self.scheduler_id, int(self.settings.lease_ttl_s * 1000)]))
        self._lease_at = now
        took = held and not self.leader
        if held != self.leader:
            log.info("scheduler %s %s the lease", self.scheduler_id, "took" if held else "lost")
            if held:
                # Another scheduler dispatched meanwhile: forget what we knew.
                self._ledger.clear()
                self._left.clear()  # what it left queued, and when, is not known here
                self._registry_at = 0.0
        if not held and self.leader:
            self._forget_gauges()
        self.leader = held
        metrics.SCHEDULER_LEADER.set(1 if held else 0)
        if took or not held:
            # Taken: the blocking wait listens as a standby; make it take the shared lists now.
            # Lost: make it leave them to the new leader.
            await self._relisten()
        return held

    def _forget_gauges(self) -> None:
        """Drop the queue depths this scheduler reported: only the leader's count (an autoscaler sums them)."""
        for (name, version), levels in self._levels_reported.items():
            for level in levels:
                try:
                    metrics.PENDING_REQUESTS.remove(name, version, str(level))
                except KeyError:
                    pass
        self._levels_reported.clear()

    # -- one step ----------------------------------------------------------

    async def step(self) -> float | None:
        """Read state, decide, act. Returns when to look again (epoch seconds) if nothing happens."""
        if time.monotonic() - self._registry_at >= self.settings.registry_refresh_s or not self.registry.models:
            self.registry = await Registry.load(self.redis)
            self._registry_at = time.monotonic()
            self._notify = {contract.notify(*k): contract.queue(*k) for k in sorted(self.registry.models)}
            if self.registry.stale:
                await self._recover(self.registry.stale)
        queues = sorted(self.registry.models)
        executors = sorted(self.registry.executors)
        # The load view is "as of" before the read: a request whose enqueue a gateway saw
        # confirmed by then is in it, any later one the gateway still counts itself.
        self._scanned_at = time.time()
        async with self.redis.pipeline(transaction=False) as pipe:
            # The arrivals' tokens go first: the scan below sees every request whose token it drops.
            notices = list(self._notify)
            if notices:
                pipe.delete(*notices)
            pipe.lpop(contract.REPORTS, _DRAIN)
            for name, version in queues:
                pipe.zrange(contract.queue(name, version), 0, self.settings.queue_scan_limit - 1)
                pipe.zcard(contract.queue(name, version))
            for eid in executors:
                pipe.smembers(contract.inflight(eid))
            async with metrics.redis_rtt("scheduler", "scan"):
                results = await pipe.execute()
        if notices:
            del results[0]
        reports = self._reports + (results[0] or [])
        self._reports = []
        self._observe(reports)

        now = time.time()
        inflight = dict(zip(executors, results[1 + 2 * len(queues) :]))
        free_at = {eid: self._free_at(eid, {b.decode() for b in held}, now) for eid, held in inflight.items()}
        wake_at: float | None = None
        seen: set[bytes] = set()
        for i, key in enumerate(queues):
            members = results[1 + 2 * i]
            self.depths[key] = results[2 + 2 * i]
            seen.update(members)
            wake = await self._schedule(key, members, free_at, now)
            if wake is not None and (wake_at is None or wake < wake_at):
                wake_at = wake
        # An empty queue planned before another queue's dispatch kept the shared
        # executor busy: look again, so that arrivals to it need no wake-up either.
        for key in queues:
            if not self.depths[key] and contract.queue(*key) not in self._blocked:
                ready = [free_at[e] for e in self._holders(key, free_at) if free_at[e] != float("inf")]
                blocked, ready_at = busy_until(now, ready, self.settings.dispatch_lead_ms / 1000)
                if blocked:
                    self._blocked.add(contract.queue(*key))
                    if ready_at is not None and (wake_at is None or ready_at < wake_at):
                        wake_at = ready_at
        # Forget parsed entries that left every queue.
        for member in list(self._pending_cache):
            if member not in seen:
                del self._pending_cache[member]
                del self._entries[member]
        await self._relisten()
        if time.monotonic() - self._profiles_saved_at >= self.settings.profile_save_s:
            await self._save_profiles()
        return wake_at

    def _free_at(self, eid: str, held: set[str], now: float) -> float:
        """When executor `eid` is predicted able to start another batch (inf: it holds its maximum)."""
        ledger = self._ledger.setdefault(eid, {})
        for bid in list(ledger):
            if bid not in held:
                del ledger[bid]  # answered
        for bid in held - ledger.keys():
            # Sent by an earlier leader: assume it just started.
            ledger[bid] = (now, self.settings.default_execution_ms / 1000)
        ran_until = self._ran_until.get(eid, float("-inf"))
        t = free_after(now, ledger.values(), ran_until)
        self._idle_at[eid] = t
        if len(held) >= self.settings.max_batches_per_executor:
            return float("inf")
        # Idle executors rank by how long they have been idle, so that work spreads over them
        # (the plan takes the earliest): without this the first in order would take every batch
        # that finds them all idle.
        return min(t, ran_until) if not ledger else t

    def _observe(self, reports: list[bytes]) -> None:
        for blob in reports:
            r = pb.ExecutionReport.FromString(blob)
            if r.ran_until_us:
                until = r.ran_until_us / 1e6
                if until > self._ran_until.get(r.executor_id, 0.0):
                    self._ran_until[r.executor_id] = until
            if r.rows:
                seconds = (r.compute_input_ns + r.compute_infer_ns + r.compute_output_ns) / 1e9
                kind = self._kind(r.executor_id, (r.model_name, r.model_version))
                self._profile((r.model_name, r.model_version, kind)).observe(r.units or r.rows, seconds, warm_up=r.warmup)

    def _kind(self, executor_id: str, key: tuple[str, str]) -> str:
        """The execution provider an executor runs a model on: executors of one kind share a profile."""
        info = self.registry.executors.get(executor_id)
        if info is not None:
            for m in info.models:
                if (m.name, m.version) == key and m.providers:
                    return m.providers[0]
        return _UNKNOWN_KIND

    def _profile(self, key: tuple[str, str, str]) -> LatencyProfile:
        p = self.profiles.get(key)
        if p is None:
            p = self.profiles[key] = LatencyProfile(default=self.settings.default_execution_ms / 1000,
                                                    margin_quantile=self.settings.margin_quantile)
        return p

    async def _load_profiles(self, keys: list[tuple[str, str, str]]) -> None:
        """Adopt the samples a previous scheduler saved, for profiles this one has not seen yet."""
        missing = [k for k in keys if k not in self.profiles]
        if not missing:
            return
        blobs = await self.redis.mget([contract.profile(*k) for k in missing])
        for key, blob in zip(missing, blobs):
            profile = self._profile(key)
            if blob:
                for units, seconds in struct.iter_unpack("<ff", blob):
                    # Warm-up samples are saved with negative units.
                    profile.observe(abs(int(units)), float(seconds), warm_up=units < 0)

    async def _save_profiles(self) -> None:
        self._profiles_saved_at = time.monotonic()
        if not self.profiles:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for key, profile in self.profiles.items():
                if len(profile):
                    blob = b"".join([*(struct.pack("<ff", -r, s) for r, s in profile.warm_up_samples()),
                                     *(struct.pack("<ff", r, s) for r, s in profile.samples())])
                    pipe.set(contract.profile(*key), blob, ex=contract.PROFILE_TTL)
            await pipe.execute()

    def _pending(self, member: bytes, seen: dict[str, int]) -> Pending:
        """The queue entry `member`, parsed once; the first time, it raises its gateway's watermark
        in `seen` (its model's): every load view from now on counts it, queued or sent on."""
        p = self._pending_cache.get(member)
        if p is None:
            e = self._entries[member] = pb.QueueEntry.FromString(member)
            if e.enqueued_us > seen.get(e.gateway_id, 0):
                seen[e.gateway_id] = e.enqueued_us
            p = Pending(e.request_id, e.rows, e.priority, e.deadline_us / 1e6, e.enqueued_us / 1e6, member, e.length or 1)
            self._pending_cache[member] = p
        return p

    def _model_profile(self, key: tuple[str, str], holders: list[str]) -> LatencyProfile:
        """The profile to plan with: the slowest kind among the holders errs late, not early."""
        profiles = [self._profile((*key, self._kind(e, key))) for e in holders] or [self._profile((*key, _UNKNOWN_KIND))]
        return max(profiles, key=lambda p: p.predict(1))

    def _holders(self, key: tuple[str, str], free_at: dict[str, float]) -> list[str]:
        """The executors that may take batches of this model."""
        return [e for e in self.registry.holders.get(key, []) if e in free_at and not self.registry.executors[e].draining]

    async def _schedule(self, key: tuple[str, str], members: list[bytes], free_at: dict[str, float], now: float) -> float | None:
        info = self.registry.models[key]
        holders = self._holders(key, free_at)
        await self._load_profiles([(*key, self._kind(e, key)) for e in holders])
        profile = self._model_profile(key, holders)
        seen = self._seen.setdefault(key, {})
        arrivals = sum(1 for m in members if m not in self._pending_cache)
        queue = [self._pending(m, seen) for m in members]
        company = None
        if self.settings.policy != FIFO:  # FIFO is the Triton baseline: it always waits max_queue_delay
            rate = self._company.setdefault(key, CompanyRate())
            at, waiting = self._left.get(key, (now, 0))
            rate.observe(waiting, arrivals, now - at, now)
            company = rate.rate(len(queue), now)
        by_priority = pending_by_level([p.priority for p in queue], self.depths.get(key, len(queue)))
        # Levels reported before are set back to 0 once they empty.
        levels = self._levels_reported.setdefault(key, set(range(1, max(1, info.priority_levels) + 1)))
        levels.update(by_priority)
        for level in levels:
            metrics.PENDING_REQUESTS.labels(key[0], key[1], str(level)).set(by_priority.get(level, 0))
        policy = ModelPolicy(
            max_batch_size=info.max_batch_size,
            max_queue_delay=info.max_queue_delay_ms / 1000,
            preferred_batch_sizes=tuple(info.preferred_batch_sizes),
            kind=self.settings.policy,
        )
        cost = profile.cost(self.settings.overhead_ms / 1000)
        ready = [e for e in holders if free_at[e] != float("inf")]
        decision = plan(
            now, queue, policy, [free_at[e] for e in ready], cost,
            lead=self.settings.dispatch_lead_ms / 1000, company=company,
        )
        if decision.blocked:
            self._blocked.add(contract.queue(*key))
        else:
            self._blocked.discard(contract.queue(*key))
        # What the step does goes to Redis in one round trip: sheds, dispatches, the load view.
        async with self.redis.pipeline(transaction=False) as pipe:
            if decision.expired:
                self._shed(pipe, key, decision.expired)
            sends = []
            for planned in decision.batches:
                eid = ready[planned.executor]
                free_at[eid] = planned.finish
                self._idle_at[eid] = max(self._idle_at.get(eid, now), planned.finish)
                sends.append((len(pipe), self._send(pipe, key, eid, planned)))
            # The view shows what is left after this step: a batch just sent must not
            # look joinable to a request admitted against it.
            gone = {m.request_id for b in decision.batches for m in b.members} | {p.request_id for p in decision.expired}
            left = [p for p in queue if p.request_id not in gone] if gone else queue
            self._left[key] = (now, len(left))
            self._publish_load(pipe, key, info, holders, cost, left, now, changed=bool(gone))
            try:
                results = await pipe.execute() if len(pipe) else []
            finally:
                for _, sent in sends:
                    if sent.span is not None:
                        sent.span.end()
        if decision.expired:
            self.counts["shed"] += len(decision.expired)
            metrics.SHED.labels(*key).inc(len(decision.expired))
        for i, sent in sends:
            self._sent(key, sent, results[i])
        return decision.wake_at

    def _publish_load(self, pipe, key, info: pb.ModelInfo, holders: list[str], cost: BatchCost,
                      queue: list[Pending], now: float, changed: bool = True) -> None:
        """Queue on `pipe` the model's load view for the gateways' admission control (deadline
        policy only): at most every 20 ms, unless the step changed the queue."""
        if self.settings.policy == FIFO or (not changed and now - self._load_at.get(key, 0.0) < _LOAD_EVERY_S):
            return
        self._load_at[key] = now
        seen = self._seen.setdefault(key, {})
        for gateway in [g for g, t in seen.items() if now - t / 1e6 > _SEEN_KEEP_S]:
            del seen[gateway]
        # One slot per level up to the lowest queued, so that a request is only
        # counted behind rows of its own priority or higher.
        rows = [0] * max([1, info.priority_levels, *(p.priority for p in queue)])
        for p in queue:
            rows[p.priority - 1] += p.rows
        idle_at = [max(now, self._idle_at.get(e, now)) for e in holders]
        tails = queue_tails(queue, idle_at or [now], info.max_batch_size, info.preferred_batch_sizes, cost)
        load = pb.ModelLoad(
            **cost.load_fields(),
            executors=len(holders),
            backlog_s=sum(t - now for t in idle_at),
            queued_rows=rows, policy=self.settings.policy, updated_us=int(min(now, self._scanned_at or now) * 1e6),
            tails=tails,
            seen_us=seen,
        )
        pipe.set(contract.load(*key), load.SerializeToString(), px=contract.LOAD_TTL_MS)

    def _send(self, pipe, key: tuple[str, str], executor_id: str, planned: PlannedBatch) -> "_Sent":
        """Queue on `pipe` the dispatch of `planned` to `executor_id` (DISPATCH_LUA); `_sent` books it."""
        batch_id = uuid.uuid4().hex
        entries = [self._entries[m.member] for m in planned.members]
        dispatched_us = now_us()
        span = None
        if telemetry.enabled():
            # The batch is a trace of its own, linked to every member's request span.
            links = [lk for lk in (telemetry.link(e.traceparent, e.tracestate) for e in entries) if lk]
            span = _tracer.start_span("batch", context=telemetry.extract(""), links=links, attributes={
                "batchline.model": key[0], "batchline.model_version": key[1], "batchline.batch_size": planned.rows,
                "batchline.requests": len(entries), "batchline.dispatch_reason": planned.reason,
                "batchline.min_slack_ms": planned.slack * 1e3, "batchline.executor_id": executor_id,
            })
        batch = pb.Batch(
            batch_id=batch_id,
            model_name=key[0],
            model_version=key[1],
            members=entries,
            executor_id=executor_id,
            dispatched_us=dispatched_us,
            reason=planned.reason,
            attempt=1,
            traceparent=(telemetry.inject(span)[0] if span else "") or tracecontext.child(None),
        )
        latest = max(e.deadline_us for e in entries)
        ttl_ms = contract.payload_ttl_ms(latest, dispatched_us)
        keys = [contract.queue(*key), contract.batch(batch_id), contract.work(executor_id), contract.inflight(executor_id)]
        args = [batch_id, ttl_ms, contract.WORK_TTL, batch.SerializeToString(), *(m.member for m in planned.members)]
        # A plain EVAL: a Script object on a pipeline asks Redis whether it has the script first.
        pipe.eval(contract.DISPATCH_LUA, len(keys), *keys, *args)
        return _Sent(batch_id, executor_id, planned, entries, dispatched_us, span)

    def _sent(self, key: tuple[str, str], sent: "_Sent", taken: int) -> None:
        if not taken:
            return  # every member had left the queue: nothing was dispatched
        planned = sent.planned
        self._ledger.setdefault(sent.executor_id, {})[sent.batch_id] = (planned.start, planned.finish - planned.start)
        self.counts["batches"] += 1
        self.counts["requests"] += int(taken)
        self.counts[f"reason:{planned.reason}"] += 1
        metrics.BATCHES_DISPATCHED.labels(key[0], key[1], planned.reason).inc()
        metrics.BATCH_SIZE.labels(key[0], key[1]).observe(planned.rows)
        metrics.DISPATCH_SLACK.labels(key[0], key[1]).observe(planned.slack)  # negative: late, in the le="0" bucket
        if sent.span is not None:
            for m, e in zip(planned.members, sent.entries):
                telemetry.record_span(
                    _tracer, "queue_wait", e.enqueued_us, sent.dispatched_us,
                    context=telemetry.extract(e.traceparent, e.tracestate),
                    attributes={"batchline.batch_id": sent.batch_id, "batchline.dispatch_reason": planned.reason,
                                "batchline.slack_ms": (m.deadline - planned.finish) * 1e3},
                )
        log.debug("%s:%s batch of %d rows (%s) -> %s", key[0], key[1], planned.rows, planned.reason, sent.executor_id)

    def _shed(self, pipe, key: tuple[str, str], expired: list[Pending]) -> None:
        """Queue on `pipe` the answers to requests that cannot make their deadline, and their removal."""
        now = time.time()
        pipe.zrem(contract.queue(*key), *(p.member for p in expired))
        pipe.delete(*(contract.payload(p.request_id) for p in expired))
        replies: dict[str, list[bytes]] = {}
        for p in expired:
            entry = self._entries[p.member]
            # The time it had to be run in: its budget less the gateway's answer margin.
            budget = f"{duration_text(p.deadline - p.enqueued)} it had to run in"
            why = (f"the {budget} ran out in the queue of model '{key[0]}'" if p.deadline <= now else
                   f"the {budget} cannot be met: model '{key[0]}' would finish it too late")
            reply = pb.Reply(
                request_id=p.request_id,
                code=grpc.StatusCode.DEADLINE_EXCEEDED.value[0],
                message=f"deadline exceeded: {why} (shed before running; retry with a larger timeout or less load)",
            )
            replies.setdefault(contract.reply(entry.gateway_id), []).append(reply.SerializeToString())
        for reply_list, blobs in replies.items():
            pipe.eval(contract.PUSH_WITH_TTL_LUA, 1, reply_list, contract.REPLY_TTL, *blobs)
        pipe.eval(contract.COUNT_WITH_TTL_LUA, 1, contract.stats(*key), contract.STATS_TTL, "fail_count", len(expired))

    async def _recover(self, stale: list[str]) -> None:
        """Hand back the batches of executors whose heartbeat expired, then forget them."""
        for eid in stale:
            requeued = await requeue_held_batches(self.redis, eid, include_queued=True)
            await self.redis.srem(contract.EXECUTORS, eid)
            self._ledger.pop(eid, None)
            for key, count in requeued.items():
                metrics.REDISPATCHED.labels(*key).inc(count)
            n = sum(requeued.values())
            if n:
                self.counts["redispatched"] += n
                log.warning("executor %s stopped heartbeating; requeued %d of its requests", eid, n)

    def status(self) -> pb.SchedulerStatus:
        return pb.SchedulerStatus(
            scheduler_id=self.scheduler_id,
            queues=[pb.SchedulerStatus.ModelQueue(model_name=f"{n}:{v}", depth=d) for (n, v), d in sorted(self.depths.items())],
            executors=list(self.registry.executors.values()),
            dispatched_batches=self.counts["batches"],
            dispatched_requests=self.counts["requests"],
            shed_requests=self.counts["shed"],
            leader=self.leader,
            redispatched_requests=self.counts["redispatched"],
        )


class SchedulerControl(internal_pb2_grpc.SchedulerServicer):
    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler

    async def Status(self, request, context):
        return self.scheduler.status()
