"""The executor: takes dispatched batches from Redis, runs them, writes the answers back.

Per batch: one MGET for every member's payload, one model run per shape
group (off the event loop), one pipelined write of all replies, statistics
and the execution report. A member that cannot be decoded or that makes the
model fail is answered alone; its neighbours still get their results.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Callable

from batchline import logs, metrics, regions, telemetry, tracecontext
from batchline.contract.keys import ModelKey
from batchline.contract.executor_store import ExecutorStore
from batchline.clock import now_us
from batchline.lifecycle import stop_tasks
from batchline.heartbeats import HeartbeatTrust
from batchline.protocol import internal_pb2 as pb
from batchline.redis_client import REDIS_ERRORS, WAIT_RETRY_S, connect, connect_blocking
from executor import decoupled, generation_batches, outcome, running, sequences
from executor.generation_serving import GenerationModel
from executor.outcome import Timing
from executor.running import Member
from executor.repository import LoadedModel
from executor.warmup import warm_up
from executor.settings import ExecutorSettings

log = logging.getLogger(__name__)
_tracer = telemetry.tracer("batchline.executor")
# A batch whose processing Redis failed is tried again WAIT_RETRY_S later, for up to this long in
# all: a failover promotes a replica within a few seconds, and the batch's requests wait on it.
_REDIS_PATIENCE_S = 5.0
# How often drain() looks whether the batches sent here are done.
_DRAIN_POLL_S = 0.05
# The longest wait for work in one blocking pop (s): a stopping worker notices within it.
_WORK_WAIT_S = 1
# How long after releasing a model version a batch of it is handed back rather than failed.
_HAND_BACK_S = 30.0
_ORPHAN_SWEEP_S = 2.0  # also the age below which a batch may still be on its way to a worker


def _phase(name: str, traced: bool):
    return _tracer.start_as_current_span(name) if traced else contextlib.nullcontext()


class Executor:
    def __init__(self, settings: ExecutorSettings, models: list[LoadedModel], executor_id: str,
                 store: ExecutorStore | None = None, generators: list[GenerationModel] | None = None):
        self.settings = settings
        self.executor_id = executor_id  # one lane's id (executor/app.py: executor_lanes)
        self.models = {(m.name, m.version): m for m in models}
        # Generative models (executor/generation_batches.py): their batches run as tasks of their own.
        self.generators = {(g.name, g.version): g for g in generators or []}
        self._generating: set[asyncio.Task] = set()
        self.store = store or ExecutorStore(connect(settings.redis_url, settings.redis_timeout_s),
                                            connect_blocking(settings.redis_url, settings.redis_timeout_s))
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
        n = sum((await self.store.requeue_held_batches(self.executor_id, include_queued=False)).values())
        if n:
            log.warning("requeued %d requests a previous %s had taken but not answered", n, self.executor_id)
        await self.register()
        await self.publish_reports(self._warmup_reports)
        await self.publish_tokenizers(list(self.models.values()))
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
        await stop_tasks(self._workers)
        try:
            n = sum((await self.store.requeue_held_batches(self.executor_id, include_queued=True)).values())
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
            skip=self._in_progress, older_than_us=now_us() - int(_ORPHAN_SWEEP_S * 1e6),
        )
        if requeued:
            log.warning("requeued %d requests of batches this executor had dropped", sum(requeued.values()))

    async def _work_loop(self) -> None:
        while True:
            try:
                item = await self.store.take_work(self.executor_id, _WORK_WAIT_S)
            except REDIS_ERRORS as exc:
                log.warning("waiting for work failed: %s", exc)
                await asyncio.sleep(WAIT_RETRY_S)
                continue
            if item is None:
                continue
            try:
                batch = pb.Batch.FromString(item)
            except Exception:  # one unreadable batch must not stop the worker
                log.exception("an unreadable batch (%d bytes) was dropped", len(item))
                continue
            generator = self.generators.get((batch.model_name, batch.model_version))
            if generator is not None:
                self._generate(batch, generator)
                continue
            self._in_progress.add(batch.batch_id)
            try:
                give_up, attempt = time.monotonic() + _REDIS_PATIENCE_S, 0
                while True:
                    attempt += 1
                    try:
                        await self.process(batch)
                        break
                    except REDIS_ERRORS as exc:
                        # A dropped connection (Redis restarted or failed over) must not strand
                        # the batch: try again; if Redis stays away, the orphan sweep hands it back.
                        self.heartbeats.redis_trouble()
                        if time.monotonic() >= give_up:
                            log.warning("batch %s: Redis failed while processing (attempt %d); left to the orphan "
                                        "sweep: %s", batch.batch_id, attempt, exc)
                            break
                        if attempt == 1 or attempt % 5 == 0:
                            log.warning("batch %s: Redis failed while processing (attempt %d): %s",
                                        batch.batch_id, attempt, exc)
                        await asyncio.sleep(WAIT_RETRY_S)
            except Exception:  # one bad batch must not kill the worker
                log.exception("batch %s failed", batch.batch_id)
            finally:
                self._in_progress.discard(batch.batch_id)

    def _generate(self, batch: pb.Batch, model: GenerationModel) -> None:
        """Run a generative model's batch beside the workers, held (not swept as an orphan) until its write."""
        self._in_progress.add(batch.batch_id)
        model.begin()  # now, not when the task starts: a release in between must wait for it

        async def run() -> None:
            try:
                await generation_batches.run_batch(self.store, self.executor_id, batch, model, self.written,
                                                   self.heartbeats)
            except Exception:  # left to recovery: the orphan sweep hands the batch back
                log.exception("generation batch %s failed", batch.batch_id)
            finally:
                model.end()
                self._in_progress.discard(batch.batch_id)

        task = asyncio.create_task(run(), name=f"generate-{batch.batch_id}")
        self._generating.add(task)
        task.add_done_callback(self._generating.discard)

    # -- one batch ---------------------------------------------------------

    async def process(self, batch: pb.Batch) -> None:
        self.busy_batches += 1
        key = (batch.model_name, batch.model_version)
        self.running[key] += 1
        started = time.monotonic()
        try:
            with logs.context(batch_id=batch.batch_id, trace_id=tracecontext.trace_id(batch.traceparent) or ""):
                await self._process(batch)
        finally:
            self.busy_s += time.monotonic() - started
            self.busy_batches -= 1
            self.running[key] -= 1
            self.executed_batches += 1

    async def _process(self, batch: pb.Batch) -> None:
        model = self.models.get((batch.model_name, batch.model_version))
        released_at = self.released.get((batch.model_name, batch.model_version), -1e9)
        if model is None and time.monotonic() - released_at < _HAND_BACK_S:
            n = await self.store.hand_back(self.executor_id, batch)
            log.info("batch %s: %s version %s was released here; %d requests went back to its queue",
                     batch.batch_id, batch.model_name, batch.model_version, n)
            return
        provider = model.info.providers[0] if model is not None and model.info.providers else ""
        if not telemetry.enabled():
            await self._run_batch(batch, model, provider, False)
            return
        with _tracer.start_as_current_span("run_batch", context=telemetry.extract(batch.traceparent), attributes={
            "batchline.model": batch.model_name, "batchline.model_version": batch.model_version,
            "batchline.provider": provider, "batchline.executor_id": self.executor_id,
            "batchline.batch_id": batch.batch_id,
        }):
            await self._run_batch(batch, model, provider, True)

    async def _run_batch(self, batch: pb.Batch, model: LoadedModel | None, provider: str, traced: bool) -> None:
        """A batch in three phases: take and decode its members, run them, answer them."""
        taken = await self._take(batch, model, traced)
        steps = await sequences.begin(self.store, model, taken.members) if sequences.is_sequence_model(model) else []
        ran = await self._run(batch, model, taken, traced)
        if steps:
            await sequences.finish(self.store, model, steps)
        await self._answer(batch, model, provider, taken, ran, traced)

    async def _take(self, batch: pb.Batch, model: LoadedModel | None, traced: bool) -> Taken:
        """The members still awaited (payload there, gateway alive), decoded; one that cannot be
        is answered alone."""
        start_us, t0 = now_us(), time.perf_counter_ns()
        entries = list(batch.members)  # (each access to a repeated field's element makes a new wrapper)
        gateways = sorted({e.gateway_id for e in entries})
        with _phase("fetch", traced):
            async with metrics.redis_rtt("executor", "fetch"):
                payloads, beats = await self.store.fetch((batch.model_name, batch.model_version),
                                                         [e.request_id for e in entries], gateways)
        gone = {g for g, beat in zip(gateways, beats) if beat is None} if self.heartbeats.heartbeats_tell() else ()
        members = [running.decoded(entry, blob, model, batch, self.executor_id)
                   for entry, blob in zip(entries, payloads)
                   # answered, abandoned, or its gateway died: nobody is waiting
                   if blob is not None and (not gone or entry.gateway_id not in gone)]
        return Taken(members, start_us, t0, time.perf_counter_ns())

    async def _run(self, batch: pb.Batch, model: LoadedModel | None, taken: Taken, traced: bool) -> Ran:
        """Run the runnable members, one batch at a time per executor id; a member whose deadline
        passed while it waited for the model is answered without running."""
        runnable = [m for m in taken.members if m.error is None]
        if not runnable or model is None:
            return Ran(taken.decoded_ns, taken.decoded_ns)
        units = 0
        async with self._compute:
            # Waiting for the other batch's run is not this batch's cost.
            held_ns = time.perf_counter_ns()
            # Its gateway gives up at the deadline: running it would be for nobody.
            runnable = running.expire_late(runnable, now_us(), batch.model_name, self.executor_id)
            if runnable:
                with _phase("infer", traced):
                    units = await running.run(model, runnable)
                if units:
                    real = sum(m.entry.rows * max(1, m.entry.length) for m in runnable)
                    efficiency = min(1.0, real / units)
                    metrics.PADDING_EFFICIENCY.labels(model.name, model.version).observe(efficiency)
                    if traced:
                        telemetry.current_span().set_attribute("batchline.padding_efficiency", efficiency)
        return Ran(held_ns, time.perf_counter_ns(), units)

    async def _answer(self, batch: pb.Batch, model: LoadedModel | None, provider: str, taken: Taken, ran: Ran,
                      traced: bool) -> None:
        """Encode each member's reply and write the finished batch in one command."""
        ran_anything = ran.ended_ns > taken.decoded_ns
        ran_until_us = taken.start_us + (ran.ended_ns - taken.started_ns) // 1000 if ran_anything else 0
        replies: dict[str, list[bytes]] = defaultdict(list)
        ahead: dict[str, list[bytes]] = defaultdict(list)  # a decoupled model's responses
        is_decoupled = model is not None and model.info.decoupled
        for m in taken.members:
            if is_decoupled and model is not None:
                partial, r = decoupled.replies(model, m)
                ahead[m.entry.gateway_id] += [p.SerializeToString() for p in partial]
            else:
                r = running.reply(model, m)
            if r.code == 0:
                r.ran_until_us = ran_until_us
            replies[m.entry.gateway_id].append(r.SerializeToString())
        encoded_ns = time.perf_counter_ns()
        timing = Timing(taken.start_us, taken.decoded_ns - taken.started_ns, ran.ended_ns - ran.held_ns,
                        encoded_ns - ran.ended_ns, ran_until_us, ran.units)
        with _phase("write", traced):
            if ahead:
                await self.store.send_replies(ahead)
            await outcome.write(self.store, self.executor_id, batch, model, taken.members, replies, timing,
                                self.written)
        if traced:
            rows = sum(m.rows for m in batch.members)
            for e in batch.members:
                telemetry.record_span(_tracer, "execute", taken.start_us, now_us(),
                                      context=telemetry.extract(e.traceparent, e.tracestate),
                                      attributes={"batchline.batch_id": batch.batch_id, "batchline.batch_size": rows,
                                                  "batchline.executor_id": self.executor_id,
                                                  "batchline.provider": provider})


@dataclass(slots=True)
class Taken:
    """A batch's members once fetched and decoded, and when (perf_counter ns) that began and ended."""
    members: list[Member]
    start_us: int    # when the executor took the batch (epoch µs)
    started_ns: int
    decoded_ns: int


@dataclass(slots=True)
class Ran:
    """When the batch held the model and when its runs ended (perf_counter ns; equal: nothing ran)."""
    held_ns: int
    ended_ns: int
    units: int = 0   # the work run, in the latency profile's units
