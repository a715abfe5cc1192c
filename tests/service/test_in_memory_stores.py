"""A scheduling step and the executor's batch path against the in-memory stores
(batchline/contract/memory.py): what they decide and write, without a Redis. The Redis-backed
paths are tested end to end elsewhere (test_scheduler_service.py, test_e2e.py)."""
from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from batchline.clock import now_us
from batchline.contract.memory import MemoryExecutorStore, MemorySchedulerStore, MemoryState
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import internal_pb2 as pb
from executor.repository import load_repository
from executor.service import Executor
from executor.settings import ExecutorSettings
from scheduler.service import Scheduler
from scheduler.settings import SchedulerSettings

MLP = ("mlp", "1")


def _entry(request_id: str, deadline_us: int, rows: int = 1) -> pb.QueueEntry:
    return pb.QueueEntry(request_id=request_id, gateway_id="gw", model_version="1", rows=rows,
                         deadline_us=deadline_us, enqueued_us=now_us(), priority=1)


def _request(rows: int) -> ipb.ModelInferRequest:
    req = ipb.ModelInferRequest(model_name="mlp", id="by-hand")
    req.inputs.add(name="features", datatype="FP32", shape=[rows, 32])
    req.raw_input_contents.append(np.ones((rows, 32), dtype=np.float32).tobytes())
    return req


def _registered(state: MemoryState, executor_id: str, info: pb.ModelInfo) -> None:
    state.registrations[executor_id] = pb.ExecutorInfo(
        executor_id=executor_id, models=[info], heartbeat_us=now_us()).SerializeToString()


def test_a_step_dispatches_what_is_due_and_sheds_what_cannot_make_its_deadline():
    state = MemoryState()
    _registered(state, "x1", pb.ModelInfo(name="mlp", version="1", max_batch_size=8, max_queue_delay_ms=0,
                                          providers=["CPUExecutionProvider"]))
    due = now_us() + 2_000_000
    for rid in ("a", "b"):
        state.enqueue(MLP, _entry(rid, due), b"payload")
    state.enqueue(MLP, _entry("late", now_us() - 1_000), b"payload")  # its deadline passed in the queue
    scheduler = Scheduler(SchedulerSettings(redis_url="redis://unused", policy="fifo"),
                          store=MemorySchedulerStore(state))

    asyncio.run(scheduler.step())

    assert not state.queues[MLP]
    (blob,) = state.work["x1"]
    batch = pb.Batch.FromString(blob)
    assert sorted(m.request_id for m in batch.members) == ["a", "b"]
    assert state.inflight[("x1", MLP)] == {batch.batch_id.encode()}
    (shed,) = [pb.Reply.FromString(r) for r in state.replies["gw"]]
    assert shed.request_id == "late" and shed.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert ("late" not in {r for _, r in state.payloads}) and state.stats[MLP]["fail_count"] == 1
    assert scheduler.counts["batches"] == 1 and scheduler.counts["shed"] == 1


def test_a_shed_counts_only_the_requests_still_queued_when_it_is_written():
    """A late request another scheduler took between this step's read and its writes is neither
    answered nor counted as shed here."""
    state = MemoryState()
    _registered(state, "x1", pb.ModelInfo(name="mlp", version="1", max_batch_size=8, max_queue_delay_ms=0,
                                          providers=["CPUExecutionProvider"]))
    for rid in ("late", "gone"):
        state.enqueue(MLP, _entry(rid, now_us() - 1_000), b"payload")
    store = MemorySchedulerStore(state)
    scan = store.scan

    async def scan_then_lose_one(*args, **kwargs):
        read = await scan(*args, **kwargs)
        gone = next(m for m in state.queues[MLP] if pb.QueueEntry.FromString(m).request_id == "gone")
        del state.queues[MLP][gone]
        return read

    store.scan = scan_then_lose_one  # type: ignore[method-assign]
    scheduler = Scheduler(SchedulerSettings(redis_url="redis://unused", policy="fifo"), store=store)

    asyncio.run(scheduler.step())

    assert [pb.Reply.FromString(r).request_id for r in state.replies["gw"]] == ["late"]
    assert scheduler.counts["shed"] == 1 and state.stats[MLP]["fail_count"] == 1


def test_one_step_sends_an_executor_no_more_batches_than_it_may_hold_across_models():
    """Two models' queues, one executor that may hold one batch: one step sends it one batch, not
    one for each model."""
    state = MemoryState()
    infos = [pb.ModelInfo(name=name, version="1", max_batch_size=8, max_queue_delay_ms=0,
                          providers=["CPUExecutionProvider"]) for name in ("mlp", "other")]
    state.registrations["x1"] = pb.ExecutorInfo(executor_id="x1", models=infos,
                                                heartbeat_us=now_us()).SerializeToString()
    for model in (MLP, ("other", "1")):
        state.enqueue(model, _entry(f"{model[0]}-a", now_us() + 5_000_000), b"payload")
    # A lead longer than a batch runs: without the bound the executor looks free again at once.
    settings = SchedulerSettings(redis_url="redis://unused", policy="fifo", max_batches_per_executor=1,
                                 dispatch_lead_ms=50)
    scheduler = Scheduler(settings, store=MemorySchedulerStore(state))

    asyncio.run(scheduler.step())

    assert len(state.work["x1"]) == 1 and scheduler.counts["batches"] == 1
    assert sum(len(q) for q in state.queues.values()) == 1  # the other model's request waits for the report


def test_an_unreadable_queue_entry_is_dropped_and_the_rest_dispatched():
    state = MemoryState()
    _registered(state, "x1", pb.ModelInfo(name="mlp", version="1", max_batch_size=8, max_queue_delay_ms=0,
                                          providers=["CPUExecutionProvider"]))
    state.queues[MLP][b"\xff\xff not a QueueEntry"] = 0.0
    state.enqueue(MLP, _entry("a", now_us() + 2_000_000), b"payload")
    scheduler = Scheduler(SchedulerSettings(redis_url="redis://unused", policy="fifo"),
                          store=MemorySchedulerStore(state))

    asyncio.run(scheduler.step())

    assert not state.queues[MLP]  # the unreadable one removed, the readable one sent
    (blob,) = state.work["x1"]
    assert [m.request_id for m in pb.Batch.FromString(blob).members] == ["a"]


def test_a_model_served_no_more_leaves_no_pending_gauge_behind():
    from prometheus_client import REGISTRY

    state = MemoryState()
    _registered(state, "x1", pb.ModelInfo(name="gone-model", version="1", max_batch_size=8, max_queue_delay_ms=0))
    scheduler = Scheduler(SchedulerSettings(redis_url="redis://unused", policy="fifo"),
                          store=MemorySchedulerStore(state))
    asyncio.run(scheduler.step())

    def gauge() -> float | None:
        return REGISTRY.get_sample_value("batchline_pending_requests",
                                         {"model": "gone-model", "version": "1", "priority": "1"})

    assert gauge() == 0.0 and ("gone-model", "1") in scheduler.depths
    state.registrations.clear()  # its executor gone: the model is served no more
    scheduler.fleet.read_again()
    asyncio.run(scheduler.step())
    assert gauge() is None and ("gone-model", "1") not in scheduler.depths


def test_a_step_leaves_a_queue_whose_only_executor_is_busy():
    state = MemoryState()
    _registered(state, "x1", pb.ModelInfo(name="mlp", version="1", max_batch_size=8, max_queue_delay_ms=0))
    settings = SchedulerSettings(redis_url="redis://unused", policy="fifo", max_batches_per_executor=1)
    for i in range(settings.max_batches_per_executor):
        state.inflight[("x1", MLP)].add(f"held{i}".encode())
    state.enqueue(MLP, _entry("a", now_us() + 30_000_000), b"payload")
    scheduler = Scheduler(settings, store=MemorySchedulerStore(state))

    asyncio.run(scheduler.step())

    assert len(state.queues[MLP]) == 1 and not state.work["x1"]
    assert scheduler.depths[MLP] == 1


@pytest.fixture(scope="module")
def mlp(model_repository):
    (model,) = load_repository(model_repository, only=["mlp"])
    return model


def _executor(mlp, state: MemoryState) -> Executor:
    return Executor(ExecutorSettings(redis_url="redis://unused", model_repository="unused"), [mlp], "x1",
                    store=MemoryExecutorStore(state))


def test_the_batch_path_answers_each_member_and_counts_the_batch(mlp):
    state = MemoryState()
    state.gateways["gw"] = "127.0.0.1:1"
    members = [_entry("a", now_us() + 30_000_000), _entry("b", now_us() + 30_000_000, rows=3),
               _entry("gone", now_us() + 30_000_000)]  # answered already: its payload is gone
    for entry, rows in zip(members[:2], (1, 3)):
        state.payloads[(MLP, entry.request_id)] = _request(rows).SerializeToString()
    batch = pb.Batch(batch_id="b1", model_name="mlp", model_version="1", members=members, executor_id="x1",
                     dispatched_us=now_us(), attempt=1)
    state.batches["b1"] = batch
    executor = _executor(mlp, state)

    asyncio.run(executor.process(batch))

    replies = {r.request_id: r for r in map(pb.Reply.FromString, state.replies["gw"])}
    assert sorted(replies) == ["a", "b"]
    assert all(r.code == 0 for r in replies.values())
    assert [len(r.response.outputs) for r in replies.values()] == [1, 1]
    assert "b1" not in state.batches and not state.payloads
    (report,) = [pb.ExecutionReport.FromString(r) for r in state.reports]
    assert report.batch_id == "b1" and report.requests == 2 and report.rows == 4 and report.failed == 0
    assert state.stats[MLP]["success_count"] == 2 and state.stats[MLP]["execution_count"] == 1
    assert executor.written.batches() == [batch]


def test_the_batch_path_answers_a_member_whose_deadline_passed_without_running_it(mlp):
    state = MemoryState()
    state.gateways["gw"] = "127.0.0.1:1"
    late = _entry("late", now_us() - 1_000)
    state.payloads[(MLP, "late")] = _request(1).SerializeToString()
    batch = pb.Batch(batch_id="b2", model_name="mlp", model_version="1", members=[late], executor_id="x1",
                     dispatched_us=now_us(), attempt=1)

    asyncio.run(_executor(mlp, state).process(batch))

    (reply,) = [pb.Reply.FromString(r) for r in state.replies["gw"]]
    assert reply.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0] and "was not run" in reply.message
    assert state.stats[MLP]["fail_count"] == 1 and state.stats[MLP]["success_count"] == 0


def test_a_drain_out_of_time_ends_a_generation_before_its_batch_goes_back(mlp):
    state = MemoryState()
    executor = _executor(mlp, state)
    store = executor.store
    tasks: list[asyncio.Task] = []
    seen: list[bool] = []
    real = store.requeue_held_batches

    async def requeue(executor_id, **kwargs):
        seen.append(tasks[0].cancelled())  # handed back only once it streams no more
        return await real(executor_id, **kwargs)

    async def register(*args) -> None:  # the registry is not what this is about
        pass

    async def waiting_work(executor_id) -> int:
        return 0

    store.requeue_held_batches, store.register, store.waiting_work = requeue, register, waiting_work  # type: ignore

    async def scenario() -> None:
        tasks.append(asyncio.create_task(asyncio.sleep(3600)))  # a generation longer than the drain's time
        executor._generating.add(tasks[0])
        await executor.drain(0.1)

    asyncio.run(scenario())
    assert seen == [True]


def test_a_batch_that_fails_unforeseen_is_answered_once_not_handed_back(mlp, monkeypatch):
    from executor import running as running_module

    state = MemoryState()
    state.gateways["gw"] = "127.0.0.1:1"
    entry = _entry("a", now_us() + 30_000_000)
    state.payloads[(MLP, "a")] = _request(1).SerializeToString()
    batch = pb.Batch(batch_id="b9", model_name="mlp", model_version="1", members=[entry], executor_id="x1",
                     dispatched_us=now_us(), attempt=1)
    state.batches["b9"] = batch
    state.inflight[("x1", MLP)].add(b"b9")

    async def broken(model, members, executor_id=""):
        raise RuntimeError("a bug nobody foresaw")

    monkeypatch.setattr(running_module, "run", broken)
    asyncio.run(_executor(mlp, state).process(batch))

    (reply,) = [pb.Reply.FromString(r) for r in state.replies["gw"]]
    assert reply.code == grpc.StatusCode.INTERNAL.value[0] and "a bug nobody foresaw" in reply.message
    assert "b9" not in state.batches and not state.inflight[("x1", MLP)]  # done: nothing for the sweep


def test_a_step_reads_a_surge_from_the_queue_its_requests_filled():
    """The leader's demand takes the rate the queue shows arriving now: 200 requests queued over the
    last 20 ms while the executor is busy, far more than a quarter of what it finishes in the budget."""
    state = MemoryState()
    _registered(state, "x1", pb.ModelInfo(name="mlp", version="1", max_batch_size=8, max_queue_delay_ms=0,
                                          default_timeout_ms=200))
    settings = SchedulerSettings(redis_url="redis://unused", policy="fifo", max_batches_per_executor=1)
    state.inflight[("x1", MLP)].add(b"held")
    start = now_us() - 20_000
    for i in range(200):
        entry = _entry(f"r{i}", now_us() + 30_000_000)
        entry.enqueued_us = start + i * 100
        state.enqueue(MLP, entry, b"payload")
    scheduler = Scheduler(settings, store=MemorySchedulerStore(state))

    asyncio.run(scheduler.step())

    (model,) = pb.MeshDemand.FromString(state.demand).models
    assert (200 - 2 * 200 ** 0.5) / 0.03 < model.queued_rate <= 200 / 0.02  # its oldest, 20 ms (and a step) old
    assert model.queued_rate > model.forecast_rate
    assert model.by_forecast == pytest.approx(model.queued_rate / (model.capacity * 0.85))
