"""The leader's demand step (scheduler/demand.py) with explicit times, on the in-memory store: how
the horizon, the rates, the backlog and the published demand follow what it is given."""
from __future__ import annotations

import asyncio

import prometheus_client
import pytest

from batchline.contract.memory import MemorySchedulerStore, MemoryState
from batchline.planning import BatchCost, BatchingRule
from batchline.protocol import internal_pb2 as pb
from batchline.registry import Registry
from scheduler.demand import DEFAULT_HORIZON_S, Demand, DemandSettings

MODEL = ("m", "1")
COST = BatchCost(per_unit_s=0.001, fixed_s=0.004)  # 36 ms for 32 rows: 888/s at most


def registry(*executors: tuple[str, float]) -> Registry:
    r = Registry()
    for eid, start_s in executors:
        r.add(pb.ExecutorInfo(executor_id=eid, start_s=start_s, models=[pb.ModelInfo(
            name="m", version="1", max_batch_size=32, default_timeout_ms=1000)]))
    return r


def step(demand: Demand, reg: Registry, now: float, depth: int = 0) -> pb.MeshDemand:
    plans = {MODEL: (BatchingRule(32), COST, sorted(reg.executors), 1)}
    return asyncio.run(demand.step(reg, plans, {MODEL: depth}, now))


def test_the_horizon_is_the_median_start_time_until_one_is_configured():
    state = MemoryState()
    demand = Demand(MemorySchedulerStore(state), "s", DemandSettings())
    assert step(demand, registry(("e0", 0.0)), 0.0).horizon_s == DEFAULT_HORIZON_S
    d = step(demand, registry(("e0", 2.0), ("e1", 4.0), ("e2", 9.0)), 1.0)
    assert (d.horizon_s, d.executor_start_s) == (4.0, 4.0)
    fixed = Demand(MemorySchedulerStore(state), "s", DemandSettings(horizon_s=30.0))
    assert step(fixed, registry(("e0", 2.0)), 0.0).horizon_s == 30.0


def test_arrivals_become_a_forecast_and_executors_wanted():
    state = MemoryState()
    demand = Demand(MemorySchedulerStore(state), "s", DemandSettings(target_utilisation=0.5))
    reg = registry(("e0", 3.0))
    for t in range(10):
        state.arrivals[MODEL] = 1000 * t  # 1000/s
        d = step(demand, reg, float(t))
    (m,) = d.models
    assert m.arrival_rate == pytest.approx(1000.0)
    assert m.forecast_rate == pytest.approx(1000.0, rel=0.01)
    assert m.capacity == pytest.approx(32 / 0.036)  # a 1 s budget: full batches back to back
    assert d.executors_wanted == 3  # 1000 / (888 x 0.5) = 2.25
    assert pb.MeshDemand.FromString(state.demand).executors_wanted == 3
    assert prometheus_client.REGISTRY.get_sample_value("batchline_executors_wanted") == 3


def test_a_backlog_wants_executors_no_arrival_rate_asked_for():
    demand = Demand(MemorySchedulerStore(MemoryState()), "s", DemandSettings())
    d = step(demand, registry(("e0", 3.0)), 0.0, depth=2000)
    assert d.models[0].by_forecast == 0.0
    assert d.executors_wanted == 3  # 2000 queued / (888/s x 1 s budget)


def test_a_standby_wants_nothing():
    state = MemoryState()
    demand = Demand(MemorySchedulerStore(state), "s", DemandSettings())
    step(demand, registry(("e0", 3.0)), 0.0, depth=2000)
    demand.forget_gauges()
    assert prometheus_client.REGISTRY.get_sample_value("batchline_executors_wanted") == 0
    assert prometheus_client.REGISTRY.get_sample_value("batchline_executor_capacity",
                                                       {"model": "m", "version": "1"}) is None


def test_the_gauges_go_with_a_model_no_longer_served_and_a_standbys_generative_ones_too():
    state = MemoryState()
    demand = Demand(MemorySchedulerStore(state), "s", DemandSettings())
    gpt = ("gpt", "1")
    reg = registry(("e0", 3.0))
    reg.add(pb.ExecutorInfo(executor_id="e1", models=[pb.ModelInfo(
        name="gpt", version="1", default_timeout_ms=30_000, generation=True, generation_slots=16,
        generation_running=4, decode_step_s=0.01)]))
    plans = {MODEL: (BatchingRule(32), COST, ["e0"], 1)}

    def gauge(name: str, key: tuple[str, str]) -> float | None:
        return prometheus_client.REGISTRY.get_sample_value(name, {"model": key[0], "version": key[1]})

    for t in range(3):
        state.arrivals[gpt] = state.arrivals[MODEL] = 10 * t
        asyncio.run(demand.step(reg, plans, {MODEL: 0, gpt: 0}, float(t), {gpt: (["e1"], 4, 10 * t)}))
    assert gauge("batchline_arrival_rate_forecast", gpt) is not None
    asyncio.run(demand.step(reg, {}, {gpt: 0}, 3.0, {gpt: (["e1"], 4, 30)}))  # m is served no more
    assert gauge("batchline_arrival_rate_forecast", MODEL) is None
    assert gauge("batchline_executor_capacity", MODEL) is None
    demand.forget_gauges()  # the lease lost
    assert gauge("batchline_arrival_rate_forecast", gpt) is None and gauge("batchline_executor_capacity", gpt) is None
    demand.forget()  # and taken again: nothing of the last term stays
    assert not demand.rates and not demand._in_flight and not demand._capacity


GPT = ("gpt", "1")


def _generative(**learned) -> tuple[MemoryState, Demand, Registry]:
    """A generative model of 16 slots an executor on three executors, a demand at utilisation 0.5."""
    state = MemoryState()
    reg = Registry()
    for eid in ("e0", "e1", "e2"):
        reg.add(pb.ExecutorInfo(executor_id=eid, models=[pb.ModelInfo(
            name="gpt", version="1", default_timeout_ms=30_000, generation=True, generation_slots=16, **learned)]))
    return state, Demand(MemorySchedulerStore(state), "s", DemandSettings(target_utilisation=0.5)), reg


def test_a_generative_model_wants_executors_by_its_sequences_in_flight():
    # 10 requests/s, 40 sequences in flight: each holds its slot 4 s; 16 slots an executor is
    # 4 requests/s each, so 10/s at 0.5 utilisation wants 5 executors.
    state, demand, reg = _generative(generation_running=13, decode_step_s=0.013)
    gpt = GPT
    for t in range(10):
        state.arrivals[gpt] = 10 * t
        d = asyncio.run(demand.step(reg, {}, {gpt: 0}, float(t), {gpt: (sorted(reg.executors), 40, 10 * t)}))
    (m,) = d.models
    assert (m.name, m.arrival_rate) == ("gpt", pytest.approx(10.0))
    assert m.capacity == pytest.approx(4.0)
    assert d.executors_wanted == 5
    # A 5 ms budget per token, with steps of 1 ms per sequence: 5 sequences at once, not 16.
    reg.models[gpt].tpot_ms = 5
    state.arrivals[gpt] = 100
    d = asyncio.run(demand.step(reg, {}, {gpt: 0}, 10.0, {gpt: (sorted(reg.executors), 40, 100)}))
    assert d.models[0].capacity == pytest.approx(5 / 4)


def test_a_saturated_generative_model_is_sized_by_what_it_serves_not_what_it_refuses():
    # Every slot full (3 executors of 16), 100 requests/s arriving and 10/s sent: each sequence
    # holds its slot 48 / 10 = 4.8 s, so one executor serves 16 / 4.8 a second. By arrivals (refused
    # ones included) it would read 0.48 s and 33/s: N / utilisation executors, whatever the demand.
    state, demand, reg = _generative()
    gpt = GPT
    for t in range(10):
        state.arrivals[gpt] = 100 * t
        d = asyncio.run(demand.step(reg, {}, {gpt: 0}, float(t), {gpt: (sorted(reg.executors), 48, 10 * t)}))
    (m,) = d.models
    assert m.capacity == pytest.approx(16 / 4.8)
    assert d.executors_wanted == 60  # 100 / (3.33 x 0.5)


def test_the_capacity_is_played_with_the_reported_elements_per_row():
    from scheduler.profiles import Profiles

    reg = registry(("e1", 2.0))
    reg.models[MODEL] = reg.executors["e1"].models[0]
    profiles = Profiles(MemorySchedulerStore(MemoryState()), 0.005, 0.99)
    assert profiles.length(MODEL) == 1
    profiles.observe(reg, pb.ExecutionReport(executor_id="e1", model_name="m", model_version="1", rows=4, units=4 * 90,
                                             warmup=True, compute_infer_ns=10**6))
    assert profiles.length(MODEL) == 1  # warm-up runs are not what clients send
    for _ in range(200):
        profiles.observe(reg, pb.ExecutionReport(executor_id="e1", model_name="m", model_version="1", rows=4,
                                                 units=4 * 16, compute_infer_ns=10**6))
    assert profiles.length(MODEL) == 16
    demand = Demand(MemorySchedulerStore(MemoryState()), "s", DemandSettings())
    one = demand.capacity(MODEL, BatchingRule(32), COST, 1.0, 1)
    sixteen = demand.capacity(MODEL, BatchingRule(32), COST, 1.0, 1, profiles.length(MODEL))
    assert sixteen < one / 4


def test_a_new_leaders_profile_keeps_the_saved_samples_under_its_first_reports():
    import struct

    from scheduler.profiles import Profiles

    state = MemoryState()
    key = ("m", "1", "cpu")
    # What the previous leader saved: 200 batches at 10 ms a unit.
    state.profiles[key] = b"".join(struct.pack("<ff", u, u * 0.010) for u in [8, 16, 4, 32] * 50)
    profiles = Profiles(MemorySchedulerStore(state), 0.005, 0.99)
    profiles.of(key).observe(8, 0.080)  # this step's report, read before the plan adopts
    asyncio.run(profiles.adopt([key]))
    assert len(profiles.of(key)) == 201
    assert profiles.of(key).predict(8) == pytest.approx(0.080, rel=0.05)
    asyncio.run(profiles.save())
    assert len(state.profiles[key]) == 201 * 8  # the saved ones kept, not overwritten by one
    profiles.forget()  # the lease lost and taken again: what the other leader saved is read again
    asyncio.run(profiles.adopt([key]))
    assert len(profiles.of(key)) == 201


def test_a_surge_the_queue_shows_wants_executors_before_the_rate_over_a_step_does():
    state = MemoryState()
    demand = Demand(MemorySchedulerStore(state), "s", DemandSettings(target_utilisation=0.5))
    reg = registry(("e0", 3.0))
    plans = {MODEL: (BatchingRule(32), COST, sorted(reg.executors), 1)}
    for t in range(5):
        state.arrivals[MODEL] = 100 * t  # 100/s: one executor
        d = asyncio.run(demand.step(reg, plans, {MODEL: 0}, float(t)))
    assert d.executors_wanted == 1
    # 400 requests queued over the last 0.16 s (capacity x budget = 888, a quarter 222): at least
    # (400 - 40) / 0.16 = 2,250/s arriving now; the arrivals counted over the step do not show it yet.
    state.arrivals[MODEL] = 500
    d = asyncio.run(demand.step(reg, plans, {MODEL: 400}, 5.0, queued={MODEL: (400, 0.16)}))
    (m,) = d.models
    assert m.queued_rate == pytest.approx(2250.0) and m.forecast_rate < 200
    assert d.executors_wanted == 6  # 2250 / (888 x 0.5) = 5.07
    # Under a quarter of what the serving executors finish in the budget: a batching queue, no surge.
    d = asyncio.run(demand.step(reg, plans, {MODEL: 200}, 6.0, queued={MODEL: (200, 0.01)}))
    assert d.models[0].queued_rate == 0.0
