"""The scheduler loop: reads queues and executor load from Redis, applies the policy, dispatches.

All decisions come from `scheduler.policy.plan`; this module only does I/O.
It never touches tensors: it moves queue members (request metadata) into
batches and tells executors which batches are theirs.

Wake-ups: a BLPOP task wakes the loop when a gateway enqueues or an executor
reports; timers (a batch's delay or deadline) are kept locally because Redis
only honours blocking timeouts to its cron tick (100 ms by default).
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter

import grpc

from batchline import contract, tracecontext
from batchline.clock import now_us
from batchline.protocol import internal_pb2 as pb
from batchline.protocol import internal_pb2_grpc
from batchline.redis_client import REDIS_ERRORS, connect, connect_blocking
from batchline.registry import Registry
from scheduler.policy import ModelPolicy, Pending, plan
from scheduler.profile import LatencyProfile
from scheduler.settings import SchedulerSettings

log = logging.getLogger(__name__)

_DRAIN = 10_000


class Scheduler:
    def __init__(self, settings: SchedulerSettings):
        self.settings = settings
        self.scheduler_id = settings.scheduler_id or f"sched-{uuid.uuid4().hex[:12]}"
        self.redis = connect(settings.redis_url, settings.redis_timeout_s)
        self.blocking = connect_blocking(settings.redis_url, settings.redis_timeout_s)
        self.registry = Registry()
        self._registry_at = 0.0
        self.profiles: dict[tuple[str, str], LatencyProfile] = {}
        # Queue members parsed once, for as long as they stay queued.
        self._pending_cache: dict[bytes, Pending] = {}
        self._entries: dict[bytes, pb.QueueEntry] = {}
        self._wake = asyncio.Event()
        self._reports: list[bytes] = []
        self._tasks: list[asyncio.Task] = []
        self._dispatch = None
        self.depths: dict[tuple[str, str], int] = {}
        self.counts: Counter[str] = Counter()

    async def start(self) -> None:
        self._dispatch = self.redis.register_script(contract.DISPATCH_LUA)
        self._tasks = [
            asyncio.create_task(self._listen(), name="listen"),
            asyncio.create_task(self._loop(), name="loop"),
        ]
        log.info("scheduler %s started", self.scheduler_id)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.redis.aclose()
        await self.blocking.aclose()

    # -- wake-ups ----------------------------------------------------------

    async def _listen(self) -> None:
        while True:
            try:
                item = await self.blocking.blpop([contract.NOTIFY, contract.REPORTS], timeout=1)
            except REDIS_ERRORS as exc:
                log.warning("waiting for events failed: %s", exc)
                await asyncio.sleep(0.5)
                continue
            if item is not None:
                if item[0].decode() == contract.REPORTS:
                    self._reports.append(item[1])
                self._wake.set()

    async def _loop(self) -> None:
        wake_at: float | None = None
        while True:
            timeout = self.settings.registry_refresh_s
            if wake_at is not None:
                timeout = min(timeout, max(0.0, wake_at - time.time()))
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            try:
                wake_at = await self.step()
            except REDIS_ERRORS as exc:
                log.warning("scheduling step failed: %s", exc)
                wake_at = None
                await asyncio.sleep(0.5)
            except Exception:  # noqa: BLE001 - the loop must survive a bad step
                log.exception("scheduling step failed")
                wake_at = None
                await asyncio.sleep(0.1)

    # -- one step ----------------------------------------------------------

    async def step(self) -> float | None:
        """Read state, decide, act. Returns when to look again (epoch seconds) if nothing happens."""
        if time.monotonic() - self._registry_at >= self.settings.registry_refresh_s or not self.registry.models:
            self.registry = await Registry.load(self.redis)
            self._registry_at = time.monotonic()
        queues = sorted(self.registry.models)
        executors = sorted(self.registry.executors)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.lpop(contract.NOTIFY, _DRAIN)
            pipe.lpop(contract.REPORTS, _DRAIN)
            for name, version in queues:
                pipe.zrange(contract.queue(name, version), 0, self.settings.queue_scan_limit - 1)
                pipe.zcard(contract.queue(name, version))
            for eid in executors:
                pipe.scard(contract.inflight(eid))
            results = await pipe.execute()
        reports = self._reports + (results[1] or [])
        self._reports = []
        self._observe(reports)

        busy = dict(zip(executors, results[2 + 2 * len(queues) :]))
        free = {eid: max(0, self.settings.max_batches_per_executor - n) for eid, n in busy.items()}
        now = time.time()
        wake_at: float | None = None
        seen: set[bytes] = set()
        for i, key in enumerate(queues):
            members = results[2 + 2 * i]
            self.depths[key] = results[3 + 2 * i]
            seen.update(members)
            if not members:
                continue
            wake = await self._schedule(key, members, free, now)
            if wake is not None and (wake_at is None or wake < wake_at):
                wake_at = wake
        # Forget parsed entries that left every queue.
        for member in list(self._pending_cache):
            if member not in seen:
                del self._pending_cache[member]
                del self._entries[member]
        return wake_at

    def _observe(self, reports: list[bytes]) -> None:
        for blob in reports:
            r = pb.ExecutionReport.FromString(blob)
            if r.rows:
                seconds = r.compute_infer_ns / 1e9
                self._profile((r.model_name, r.model_version)).observe(r.rows, seconds)

    def _profile(self, key: tuple[str, str]) -> LatencyProfile:
        p = self.profiles.get(key)
        if p is None:
            p = self.profiles[key] = LatencyProfile(default=self.settings.default_execution_ms / 1000)
        return p

    def _pending(self, member: bytes) -> Pending:
        p = self._pending_cache.get(member)
        if p is None:
            e = self._entries[member] = pb.QueueEntry.FromString(member)
            p = Pending(e.request_id, e.rows, e.priority, e.deadline_us / 1e6, e.enqueued_us / 1e6, member)
            self._pending_cache[member] = p
        return p

    async def _schedule(self, key: tuple[str, str], members: list[bytes], free: dict[str, int], now: float) -> float | None:
        info = self.registry.models[key]
        holders = [e for e in self.registry.holders.get(key, []) if e in free]
        policy = ModelPolicy(
            max_batch_size=info.max_batch_size,
            max_queue_delay=info.max_queue_delay_ms / 1000,
            preferred_batch_sizes=tuple(info.preferred_batch_sizes),
            overhead=self.settings.overhead_ms / 1000,
        )
        queue = [self._pending(m) for m in members]
        decision = plan(now, queue, policy, sum(free[e] for e in holders), self._profile(key).predict)
        if decision.expired:
            await self._shed(key, decision.expired)
        for planned in decision.batches:
            # Least-loaded executor holding the model.
            eid = max(holders, key=lambda e: free[e])
            free[eid] -= 1
            await self._send(key, eid, planned)
        return decision.wake_at

    async def _send(self, key: tuple[str, str], executor_id: str, planned) -> None:
        batch_id = uuid.uuid4().hex
        entries = [self._entries[m.member] for m in planned.members]
        batch = pb.Batch(
            batch_id=batch_id,
            model_name=key[0],
            model_version=key[1],
            members=entries,
            executor_id=executor_id,
            dispatched_us=now_us(),
            reason=planned.reason,
            attempt=1,
            # The batch is its own trace, linked to its members' (#4 exports it).
            traceparent=tracecontext.child(None),
        )
        latest = max(e.deadline_us for e in entries)
        ttl_ms = contract.payload_ttl_ms(latest, now_us())
        taken = await self._dispatch(
            keys=[contract.queue(*key), contract.batch(batch_id), contract.work(executor_id), contract.inflight(executor_id)],
            args=[batch_id, ttl_ms, contract.WORK_TTL, batch.SerializeToString(), *(m.member for m in planned.members)],
        )
        self.counts["batches"] += 1 if taken else 0
        self.counts["requests"] += int(taken)
        self.counts[f"reason:{planned.reason}"] += 1 if taken else 0
        log.debug("%s:%s batch of %d rows (%s) -> %s", key[0], key[1], planned.rows, planned.reason, executor_id)

    async def _shed(self, key: tuple[str, str], expired: list[Pending]) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zrem(contract.queue(*key), *(p.member for p in expired))
            pipe.delete(*(contract.payload(p.request_id) for p in expired))
            for p in expired:
                entry = self._entries[p.member]
                reply = pb.Reply(
                    request_id=p.request_id,
                    code=grpc.StatusCode.DEADLINE_EXCEEDED.value[0],
                    message=f"deadline exceeded: its {1e3 * (p.deadline - p.enqueued):.1f} ms budget ran out in the queue of "
                    f"model '{key[0]}' (no executor could take it in time)",
                )
                pipe.rpush(contract.reply(entry.gateway_id), reply.SerializeToString())
                pipe.expire(contract.reply(entry.gateway_id), contract.REPLY_TTL)
            skey = contract.stats(*key)
            pipe.hincrby(skey, "fail_count", len(expired))
            pipe.expire(skey, contract.STATS_TTL)
            await pipe.execute()
        self.counts["shed"] += len(expired)

    def status(self) -> pb.SchedulerStatus:
        return pb.SchedulerStatus(
            scheduler_id=self.scheduler_id,
            queues=[pb.SchedulerStatus.ModelQueue(model_name=f"{n}:{v}", depth=d) for (n, v), d in sorted(self.depths.items())],
            executors=list(self.registry.executors.values()),
            dispatched_batches=self.counts["batches"],
            dispatched_requests=self.counts["requests"],
            shed_requests=self.counts["shed"],
        )


class SchedulerControl(internal_pb2_grpc.SchedulerServicer):
    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler

    async def Status(self, request, context):
        return self.scheduler.status()
