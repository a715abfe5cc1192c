"""The executor's workers: each takes dispatched batches off the executor's work list and runs
them; a generative model's batch goes to a task of its own.

Per batch: one MGET for every member's payload, one model run per shape
group (off the event loop), one pipelined write of all replies, statistics
and the execution report. A member that cannot be decoded or that makes the
model fail is answered alone; its neighbours still get their results.

Apart from executor/service.py (the executor's registration, heartbeats, drain and stop) because
this is the path every request takes, and it changes with how batches run, not with how the
executor joins the mesh. BatchWorker's methods run on the Executor; the state of it they read and
count is declared on the class, so that what they rely on is in view here.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, defaultdict
from dataclasses import dataclass

from batchline import logs, metrics, telemetry, tracecontext
from batchline.contract.keys import ModelKey
from batchline.contract.executor_store import ExecutorStore
from batchline.clock import now_us
from batchline.errors import DeadlineExceeded, Internal, status_value
from batchline.heartbeats import HeartbeatTrust
from batchline.protocol import internal_pb2 as pb
from batchline.redis_client import REDIS_ERRORS, WAIT_RETRY_S
from batchline.redis_url import BLOCKING_WAIT_S
from executor import decoupled, generation_batches, outcome, running, sequences, shared_memory
from executor.awaited import awaited
from executor.generation_serving import GenerationModel
from executor.outcome import Timing
from executor.running import Member
from executor.repository import LoadedModel

log = logging.getLogger(__name__)
_tracer = telemetry.tracer("batchline.executor")
# A batch whose processing Redis failed is tried again WAIT_RETRY_S later, for up to this long in
# all: a failover promotes a replica within a few seconds, and the batch's requests wait on it.
_REDIS_PATIENCE_S = 5.0
# The longest wait for work in one blocking pop (s): a stopping worker notices within it.
_WORK_WAIT_S = BLOCKING_WAIT_S
# How long after releasing a model version a batch of it is handed back rather than failed.
_HAND_BACK_S = 30.0


def _phase(name: str, traced: bool):
    return _tracer.start_as_current_span(name) if traced else contextlib.nullcontext()


class BatchWorker:
    """The work loop and one batch's take, run and answer, as methods of the Executor."""
    # The executor's state (executor/service.py: Executor.__init__ sets it).
    executor_id: str
    models: dict[ModelKey, LoadedModel]
    generators: dict[ModelKey, GenerationModel]
    store: ExecutorStore
    heartbeats: HeartbeatTrust
    written: outcome.Written
    released: dict[ModelKey, float]
    running: Counter[ModelKey]
    busy_batches: int
    busy_s: float
    executed_batches: int
    _compute: asyncio.Lock
    _in_progress: set[str]
    _generating: set[asyncio.Task]

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
                try:
                    await self._process(batch)
                except REDIS_ERRORS:
                    raise  # tried again by the worker; if Redis stays away, the orphan sweep hands it back
                except Exception as exc:  # noqa: BLE001 - answered once, not handed back to fail again
                    await self._fail(batch, exc)
        finally:
            self.busy_s += time.monotonic() - started
            self.busy_batches -= 1
            self.running[key] -= 1
            self.executed_batches += 1

    async def _fail(self, batch: pb.Batch, exc: Exception) -> None:
        """Answer every member of a batch whose processing failed unforeseen INTERNAL, and write it as
        done: left to the orphan sweep, it would go back to its queue and fail again, batch after batch,
        until its members' deadlines passed (each member's own failures are answered in its reply)."""
        log.exception("batch %s failed; its %d requests are answered INTERNAL", batch.batch_id, len(batch.members))
        error = Internal(f"executor {self.executor_id} failed on this request's batch ({type(exc).__name__}: {exc})")
        members = [Member(e) for e in batch.members]
        replies: dict[str, list[bytes]] = defaultdict(list)
        for m in members:
            m.error = error
            reply = pb.Reply(request_id=m.entry.request_id, code=status_value(error), message=str(error))
            replies[m.entry.gateway_id].append(reply.SerializeToString())
        model = self.models.get((batch.model_name, batch.model_version))
        await outcome.write(self.store, self.executor_id, batch, model, members, replies, Timing(now_us(), 0, 0, 0),
                            self.written)

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
            taken.members[:] = [m for m in taken.members if not m.answered_elsewhere]
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
        members = [running.decoded(entries[i], payloads[i], model, batch, self.executor_id)  # type: ignore[arg-type]
                   for i in awaited(batch, entries, payloads, gateways, beats, self.heartbeats)]
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
                    units = await running.run(model, runnable, self.executor_id)
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
        await self._drop_unawaited_region_writes(batch, taken.members)
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


    async def _drop_unawaited_region_writes(self, batch: pb.Batch, members: list[Member]) -> None:
        """Outputs go into a client's regions only while the client still awaits them: one answered
        at its deadline may be using the region again, for its retry. Asked only of members whose
        deadline has passed (a run that overran it): the others cost no round trip."""
        now = now_us()
        writing = [m for m in members if m.error is None and m.outputs is not None
                   and 0 < m.entry.deadline_us <= now and shared_memory.writes_outputs(m.request)]
        if not writing:
            return
        model = (batch.model_name, batch.model_version)
        awaited = await self.store.payloads_held([(m.entry.request_id, model) for m in writing])
        for m, ok in zip(writing, awaited):
            if not ok:
                m.outputs = None
                m.error = DeadlineExceeded("nobody awaits this request any more (answered, or given up): its output "
                                           "regions were left as they were")


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
