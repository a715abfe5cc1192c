"""The executor's place in the mesh: its registration and heartbeats in Redis, what it tells the
scheduler and gateways at start (warm-up reports, tokenizers), the sweep of batches it dropped,
and its drain and stop.

The batches themselves, taken off its work list and run, are executor/batch_worker.py's: the
Executor is a BatchWorker, and its __init__ sets up the state both use.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Awaitable, Callable, TypeVar

from batchline import regions
from batchline.contract.keys import ModelKey
from batchline.contract.executor_store import ExecutorStore
from batchline.clock import now_us
from batchline.lifecycle import stop_tasks
from batchline.heartbeats import HeartbeatTrust
from batchline.protocol import internal_pb2 as pb
from batchline.redis_client import REDIS_ERRORS, WAIT_RETRY_S, connect, connect_blocking
from executor import outcome
from executor.batch_worker import BatchWorker
from executor.generation_serving import GenerationModel
from executor.repository import LoadedModel
from executor.warmup import warm_up
from executor.settings import ExecutorSettings

log = logging.getLogger(__name__)
T = TypeVar("T")
# How often drain() looks whether the batches sent here are done.
_DRAIN_POLL_S = 0.05
_ORPHAN_SWEEP_S = 2.0  # also the age below which a batch may still be on its way to a worker



async def until_redis(what: str, call: Callable[[], Awaitable[T]]) -> T:
    """`call()`, tried again until Redis answers: an executor that starts before Redis (a pod
    scheduled before it, a Sentinel group still electing) waits for it instead of exiting and
    loading its models again."""
    delay = WAIT_RETRY_S
    while True:
        try:
            return await call()
        except REDIS_ERRORS as exc:
            log.warning("%s: Redis is unreachable (%s); trying again in %.1f s", what, exc, delay)
            await asyncio.sleep(delay)
            delay = min(2.0, delay * 2)

class Executor(BatchWorker):
    def __init__(self, settings: ExecutorSettings, models: list[LoadedModel], executor_id: str,
                 store: ExecutorStore | None = None, generators: list[GenerationModel] | None = None):
        self.settings = settings
        self.executor_id = executor_id  # one lane's id (executor/app.py: executor_lanes)
        self.models = {(m.name, m.version): m for m in models}
        # Generative models (executor/generation_batches.py): their batches run as tasks of their own.
        self.generators = {(g.name, g.version): g for g in generators or []}
        self._generating: set[asyncio.Task] = set()
        self.store = store or ExecutorStore(connect(settings.redis_url, settings.redis_timeout_s),
                                            # each of its batch workers waits for work on its own connection
                                            connect_blocking(settings.redis_url, settings.redis_timeout_s,
                                                             settings.concurrent_batches + 1))
        self.address = ""
        self.started_us = now_us()
        self.start_s = 0.0  # process start to its first registration (ExecutorApp sets it)
        self.executed_batches = 0
        self.busy_batches = 0
        self.busy_s = 0.0  # time spent on batches, fetch to write
        self._busy_mark = (time.monotonic(), 0.0)  # (when, busy_s then) at the previous heartbeat
        self.busy_share = 0.0  # of the time between the last two heartbeats
        # One run at a time per executor id, while fetching and answering overlap with it: a
        # model's runs use its share of the cores (all of them, unless instance_count splits
        # them), and a model with more instances gets more ids (executor lanes, executor/app.py).
        self._compute = asyncio.Lock()
        self._tasks: list[asyncio.Task] = []
        self._workers: list[asyncio.Task] = []
        self._in_progress: set[str] = set()
        self.heartbeats = HeartbeatTrust()  # whether a gateway without a heartbeat is gone
        self.draining = False
        self._warmup_reports: list[pb.ExecutionReport] = []
        self.host = regions.host_id()  # advertised: a gateway on the same one references regions
        self.running: Counter[ModelKey] = Counter()  # batches being processed, per model version
        # Versions released here (time.monotonic()): a batch of one that a scheduler sent before it saw
        # the release goes back to its queue for another executor instead of failing.
        self.released: dict[ModelKey, float] = {}
        # The first lane publishes the process's model repository: (entries, control mode, calls applied).
        self.catalog: Callable[[], tuple[list[pb.RepositoryEntry], str, dict[str, int]]] | None = None
        self.written = outcome.Written()  # its last batches' writes, for a new primary that lacks them

    # -- lifecycle ---------------------------------------------------------

    def warmup(self) -> None:
        """Run each model before serving (executor/warmup.py); the reports go out at start()."""
        for model in self.models.values():
            self._warmup_reports += warm_up(model, self.executor_id)

    def _served(self) -> list[tuple[str, str]]:
        """The models this executor serves now, batch and generative."""
        return [*self.models, *self.generators]

    def info(self) -> pb.ExecutorInfo:
        entries, mode, applied = self.catalog() if self.catalog is not None else ([], "", {})
        return pb.ExecutorInfo(
            repository=entries,
            model_control_mode=mode,
            control_applied=applied,
            executor_id=self.executor_id,
            address=self.address,
            models=[m.info for m in self.models.values()] + [g.info for g in self.generators.values()],
            started_us=self.started_us,
            heartbeat_us=now_us(),
            busy_batches=self.busy_batches,
            executed_batches=self.executed_batches,
            draining=self.draining,
            busy_share=self.busy_share,
            start_s=self.start_s,
            host=self.host,
        )

    async def register(self) -> None:
        # The busy share is measured from one registration (heartbeat) to the next.
        now = time.monotonic()
        since, busy_then = self._busy_mark
        self._busy_mark = (now, self.busy_s)
        if now > since:
            self.busy_share = min(1.0, (self.busy_s - busy_then) / (now - since))
        ttl_ms = int(self.settings.heartbeat_ttl_s * 1000)
        await self.store.register(self.executor_id, self.info().SerializeToString(), ttl_ms)

    async def start(self, address: str) -> None:
        self.address = address
        # A previous process with this id may have died holding batches it
        # had taken off its work list: hand those back (the rest it runs now).
        # Only batches older than a moment: on a Redis Cluster a dispatch's two halves (the in-flight
        # set, the work list) land apart, and one whose work-list half is still on its way is this
        # process's to run, not to hand back.
        requeued = await until_redis("handing back what it held", lambda: self.store.requeue_held_batches(
            self.executor_id, include_queued=False, older_than_us=now_us() - int(_ORPHAN_SWEEP_S * 1e6),
            models=self._served()))
        n = sum(requeued.values())
        if n:
            log.warning("requeued %d requests a previous %s had taken but not answered", n, self.executor_id)
        await until_redis("registering", self.register)
        await until_redis("publishing its warm-up runs", lambda: self.publish_reports(self._warmup_reports))
        await until_redis("publishing tokenizers", lambda: self.publish_tokenizers(list(self.models.values())))
        self._tasks.append(asyncio.create_task(self._heartbeat(), name="heartbeat"))
        for i in range(max(1, self.settings.concurrent_batches)):
            self._workers.append(asyncio.create_task(self._work_loop(), name=f"worker-{i}"))
        log.info("executor %s serving %s", self.executor_id, sorted(f"{n}:{v}" for n, v in self.models))

    async def publish_tokenizers(self, models: list[LoadedModel]) -> None:
        """The tokenizers of models that take text, where the gateways read them."""
        await self.store.publish_tokenizers({m.info.text.tokenizer_sha256: m.tokenizer_json
                                             for m in models if m.tokenizer_json})

    async def publish_reports(self, reports: list[pb.ExecutionReport]) -> None:
        """Warm-up runs' reports, which seed the scheduler's latency profiles."""
        await self.store.publish_reports([r.SerializeToString() for r in reports])

    async def drain(self, timeout: float) -> None:
        """Take no new batches; finish the ones already sent here, or hand them back after `timeout`."""
        self.draining = True
        try:
            await self.register()  # the scheduler stops sending us batches
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                idle = self.busy_batches == 0 and not self._generating
                if idle and not await self.store.waiting_work(self.executor_id):
                    break
                await asyncio.sleep(_DRAIN_POLL_S)
        except REDIS_ERRORS as exc:
            log.warning("drain: Redis failed (%s); handing back what is left", exc)
        # Generations still running end here, before their batches go back: another executor continues
        # each from the tokens recorded, and this one must stream no more of them meanwhile.
        await stop_tasks(self._workers + list(self._generating))
        try:
            n = sum((await self.store.requeue_held_batches(self.executor_id, include_queued=True,
                                                           models=self._served())).values())
            if n:
                log.info("drain: handed %d unstarted requests back to their queues", n)
        except REDIS_ERRORS:
            pass  # recovery by the scheduler hands them back once our heartbeat expires

    async def stop(self) -> None:
        await stop_tasks(self._workers + self._tasks + list(self._generating))
        try:
            await self.store.deregister(self.executor_id)
        except REDIS_ERRORS:
            pass
        await self.store.aclose()

    async def _heartbeat(self) -> None:
        swept = time.monotonic()
        while True:
            try:
                await self.register()
                if time.monotonic() - swept >= _ORPHAN_SWEEP_S:
                    swept = time.monotonic()
                    await self._sweep_orphans()
            except REDIS_ERRORS as exc:
                log.warning("heartbeat failed: %s", exc)
            except Exception:  # e.g. Redis out of memory: an executor that stopped
                log.exception("heartbeat failed")  # beating would drop out of the registry for good
            await asyncio.sleep(self.settings.heartbeat_interval_s)

    async def _sweep_orphans(self) -> None:
        """Hand back batches held here that no worker runs (their processing failed on Redis)."""
        requeued = await self.store.requeue_held_batches(
            self.executor_id, include_queued=False,
            skip=self._in_progress, older_than_us=now_us() - int(_ORPHAN_SWEEP_S * 1e6), models=self._served(),
        )
        if requeued:
            log.warning("requeued %d requests of batches this executor had dropped", sum(requeued.values()))
