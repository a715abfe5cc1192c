"""The scheduler role's store: the step's scan (arrival tokens, reports, queue heads and depths,
in-flight sets) and its writes (dispatches, sheds, load views) in one round trip each, the lease,
the wake-up of its own blocking wait, latency profiles, and forgetting a dead executor (whose
batches recovery, inherited, hands back)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Mapping, Sequence

import redis.exceptions

from batchline.contract import calls, scripts
from batchline.contract import keys as k
from batchline.contract.keys import ModelKey
from batchline.contract.recovery import RecoveryStore
from batchline.contract.slots import get_many, on_cluster
from batchline.protocol import internal_pb2 as pb

log = logging.getLogger(__name__)

# A latency profile's key: model, version, execution provider.
ProfileKey = tuple[str, str, str]


@dataclass(slots=True)
class Scan:
    """What a step reads: the reports taken, each queue's head and depth, each in-flight set."""
    reports: list[bytes]
    heads: list[list[bytes]]
    depths: list[int]
    inflight: list[set[bytes]]


class StepWrites:
    """A step's writes, queued on one pipeline and sent in one round trip by execute(); its
    results are in the order the writes were queued (`len()` before a write is its index)."""

    def __init__(self, pipe: Any, client: Any) -> None:
        self._pipe = pipe
        self._client = client
        # On a cluster, each shed's place in the results and what its answers are: sent once the
        # model's part says which members it shed (their reply lists are in other hash slots).
        self._sheds: list[tuple[int, Sequence[str], Mapping[str, Sequence[pb.Reply]]]] = []

    async def __aenter__(self) -> StepWrites:
        await self._pipe.__aenter__()
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self._pipe.__aexit__(kind, exc, tb)

    def __len__(self) -> int:
        return len(self._pipe)

    def dispatch(self, batch: pb.Batch, members: Sequence[bytes], batch_ttl_ms: int,
                 blob: bytes | None = None) -> None:
        """Move `members` from their queue into `batch` for its executor (contract.dispatch): its
        result is how many were still queued. `blob`: the Batch's bytes, when the caller has them."""
        calls.dispatch(self._pipe, batch, members, batch_ttl_ms, blob)

    def shed(self, model: ModelKey, members: Sequence[bytes], request_ids: Sequence[str],
             replies: Mapping[str, Sequence[pb.Reply]]) -> None:
        """Shed `members` still queued and answer them (calls.shed): its result is how many were."""
        if on_cluster(self._client):
            self._sheds.append((len(self._pipe), request_ids, replies))
        calls.shed(self._pipe, model, members, request_ids, replies)

    def drop(self, model: ModelKey, members: Sequence[bytes]) -> None:
        """Remove queue members nobody can read (no request id to answer: their payloads expire)."""
        self._pipe.zrem(k.queue(model), *members)

    def publish_load(self, model: ModelKey, load: bytes) -> None:
        """The model's ModelLoad, for the gateways' admission (short TTL)."""
        self._pipe.set(k.load(model), load, px=k.LOAD_TTL_MS)

    async def execute(self) -> list[Any]:
        if not len(self._pipe):
            return []
        results = list(await self._pipe.execute())
        if self._sheds:
            sheds, self._sheds = self._sheds, []
            async with self._client.pipeline(transaction=False) as pipe:
                for i, request_ids, replies in sheds:
                    for gateway_id, answers in calls.shed_answers(results[i], request_ids, replies).items():
                        calls.push_with_ttl(pipe, k.reply(gateway_id), k.REPLY_TTL, answers)
                    results[i] = len(results[i])
                try:
                    if len(pipe):
                        await pipe.execute()
                except (redis.exceptions.RedisError, OSError) as exc:
                    # The step's own writes landed and are booked; the clients of the requests shed
                    # hear of it as their own deadline, at their gateway.
                    log.warning("answers to %d shed requests were not written: %s",
                                sum(results[i] for i, _, _ in sheds), exc)
        return results


class SchedulerStore(RecoveryStore):
    def __init__(self, client: Any, blocking: Any = None) -> None:
        super().__init__(client, blocking)
        # Reports a cluster scan took whose later round failed: the next scan returns them first.
        self._untold: list[bytes] = []

    async def scan(self, notices: Sequence[str], models: Sequence[ModelKey],
                   inflight: Sequence[tuple[str, ModelKey]], scan_limit: int, drain: int) -> Scan:
        """One command (scripts.SCAN_LUA; a pipeline on a cluster): drop the arrivals' tokens
        (`notices`), take the reports, read each queue's head (up to `scan_limit`) and depth and each
        (executor, model) in-flight set; up to `drain` reports."""
        if not on_cluster(self.client):
            reports, heads, depths, sets = await self.hot.eval(
                scripts.SCAN_LUA, len(notices) + 1 + len(models) + len(inflight), *notices, k.REPORTS,
                *(k.queue(m) for m in models), *(k.inflight(m, eid) for eid, m in inflight),
                len(notices), len(models), drain, scan_limit)
            return Scan(list(reports), [list(h) for h in heads], [int(d) for d in depths], [set(s) for s in sets])
        # The arrivals' tokens go first (on a cluster, a round of their own): the scan below sees
        # every request whose token it drops.
        async with self.client.pipeline(transaction=False) as first:
            if notices:
                first.delete(*notices)
            first.lpop(k.REPORTS, drain)
            taken = (await first.execute())[-1] or []
        reports, self._untold = self._untold + list(taken), []
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for model in models:
                    pipe.zrange(k.queue(model), 0, scan_limit - 1)
                    pipe.zcard(k.queue(model))
                for eid, model in inflight:
                    pipe.smembers(k.inflight(model, eid))
                results = await pipe.execute() if len(pipe) else []
        except BaseException:
            self._untold = reports  # popped, and not lost with this step
            raise
        n = len(models)
        return Scan(reports, [results[2 * i] for i in range(n)], [results[1 + 2 * i] for i in range(n)],
                    results[2 * n:])

    def step_writes(self) -> StepWrites:
        return StepWrites(self.hot.pipeline(transaction=False), self.client)

    async def wake(self, scheduler_id: str) -> None:
        """Push to the scheduler's own wake list, ending its blocking wait."""
        key = k.scheduler_wake(scheduler_id)
        async with self.hot.pipeline(transaction=True) as pipe:  # (never without its expiry)
            pipe.rpush(key, 1)
            pipe.pexpire(key, k.SCHEDULER_WAKE_TTL_MS)
            await pipe.execute()

    async def forget_executor(self, executor_id: str) -> None:
        await self.client.srem(k.EXECUTORS, executor_id)

    async def take_lease(self, holder_id: str, ttl_ms: int) -> bool:
        """Take or renew the scheduling lease; True when `holder_id` holds it."""
        return bool(await calls.take_lease(self.client, holder_id, ttl_ms))

    async def release_lease(self, holder_id: str) -> None:
        await calls.release_lease(self.client, holder_id)

    async def arrival_counts(self, models: Sequence[ModelKey]) -> list[int]:
        """Requests the gateways received for each model so far (0 where none counted)."""
        return [int(v or 0) for v in await get_many(self.client, [k.arrivals(m) for m in models])]

    async def publish_demand(self, demand: bytes) -> None:
        """The MeshDemand, for the autoscalers (`batchline up --autoscale`, the KEDA trigger reads the gauges)."""
        await self.client.set(k.DEMAND, demand, px=k.DEMAND_TTL_MS)

    async def saved_profiles(self, keys: Sequence[ProfileKey]) -> list[bytes | None]:
        """The latency-profile samples saved under each key (None: none)."""
        return list(await get_many(self.client, [k.profile(key[:2], key[2]) for key in keys]))

    async def save_profiles(self, samples: Mapping[ProfileKey, bytes]) -> None:
        async with self.client.pipeline(transaction=False) as pipe:
            for key, blob in samples.items():
                pipe.set(k.profile(key[:2], key[2]), blob, ex=k.PROFILE_TTL)
            await pipe.execute()
