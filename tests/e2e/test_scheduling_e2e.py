"""Scheduler lease, executor recovery, latency profiles, admission and drain against a real mesh and Redis.

Where a test needs requests to stay queued, it makes a fake scheduler hold
the lease, so the real one stands by and nothing is dispatched: no sleeps,
no races with the scheduling loop.
"""
from __future__ import annotations

import pathlib
import re
import shutil
import time
import uuid

import grpc
import numpy as np
import prometheus_client
import pytest
import redis

from batchline import contract
from batchline.clock import now_us
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import inference_pb2_grpc
from batchline.protocol import internal_pb2 as pb
from batchline.protocol import internal_pb2_grpc
from batchline.testing.polling import poll
from scheduler.app import SchedulerApp
from scheduler.settings import SchedulerSettings

WAIT_S = 15.0  # how long a test waits for the mesh to reach a state


def _request(value: float = 0.0, timeout_us: int | None = None, priority: int | None = None) -> ipb.ModelInferRequest:
    req = ipb.ModelInferRequest(model_name="mlp", id="t")
    req.inputs.add(name="features", datatype="FP32", shape=[1, 32])
    req.raw_input_contents.append(np.full((1, 32), value, np.float32).tobytes())
    if timeout_us is not None:
        req.parameters["timeout"].int64_param = timeout_us
    if priority is not None:
        req.parameters["priority"].uint64_param = priority
    return req


def _hold_lease(m) -> redis.Redis:
    """Make the mesh's scheduler a standby: nothing gets dispatched until the lease is released."""
    r = redis.Redis.from_url(m.redis_url)
    taken = time.monotonic()
    r.set(contract.LEADER, "someone-else", px=120_000)
    scheduler = m.scheduler.scheduler
    # Only a lease attempt made after ours counts: one in flight may have taken it just before.
    poll(lambda: scheduler.lease.attempted_at > taken and not scheduler.leader, WAIT_S, "the scheduler to stand by")
    return r


def _stub(m):
    channel = grpc.insecure_channel(m.address)
    return channel, inference_pb2_grpc.GRPCInferenceServiceStub(channel)


def _dispatch_by_hand(r: redis.Redis, executor_id: str, batch_id: str, gateway_id: str, values: list[float],
                      deadlines_us: list[int] | None = None) -> list[pb.QueueEntry]:
    """What the scheduler's dispatch leaves in Redis: payloads, and the batch under its key, in the
    executor's work list and in its inflight set. Returns the members (deadlines: 30 s from now)."""
    entries = []
    for i, value in enumerate(values):
        rid = uuid.uuid4().hex
        r.set(contract.payload(("mlp", "1"), rid), _request(value).SerializeToString(), px=60_000)
        deadline = deadlines_us[i] if deadlines_us else now_us() + 30_000_000
        entries.append(pb.QueueEntry(request_id=rid, gateway_id=gateway_id, model_version="1", rows=1,
                                     deadline_us=deadline, enqueued_us=now_us() - 200_000, priority=1))
    batch = pb.Batch(batch_id=batch_id, model_name="mlp", model_version="1", members=entries, executor_id=executor_id,
                     attempt=1)
    r.set(contract.batch(("mlp", "1"), batch_id), batch.SerializeToString(), px=60_000)
    r.sadd(contract.inflight(("mlp", "1"), executor_id), batch_id)
    r.sadd(contract.served(executor_id), contract.model_tag(("mlp", "1")))
    r.rpush(contract.work(executor_id), batch.SerializeToString())
    return entries


def _dispatch_queued(r: redis.Redis, m, model: str, members: list[bytes], batch_id: str) -> None:
    """Send queued requests (their queue members) to the mesh's first executor as one batch, the
    way the scheduler's dispatch does."""
    eid = m.executors[0].executor.executor_id
    r.zrem(contract.queue((model, "1")), *members)
    batch = pb.Batch(batch_id=batch_id, model_name=model, model_version="1", executor_id=eid, attempt=1,
                     members=[pb.QueueEntry.FromString(x) for x in members])
    r.set(contract.batch((model, "1"), batch_id), batch.SerializeToString(), px=60_000)
    r.sadd(contract.inflight((model, "1"), eid), batch_id)
    r.sadd(contract.served(eid), contract.model_tag((model, "1")))
    r.rpush(contract.work(eid), batch.SerializeToString())


def test_a_second_scheduler_stands_by_and_takes_over_when_the_leader_stops(mesh_factory):
    m = mesh_factory(models=["mlp"])
    first = m.scheduler
    second = m.call(SchedulerApp(SchedulerSettings(redis_url=m.redis_url, port=0, metrics_port=-1)).start())
    try:
        poll(lambda: first.scheduler.leader and second.scheduler.lease.attempted_at, WAIT_S,
             "both schedulers to try the lease")
        assert not second.scheduler.leader
        channel, stub = _stub(m)
        with channel:
            for i in range(5):
                stub.ModelInfer(_request(i), timeout=10)
            assert second.scheduler.counts["batches"] == 0  # the standby dispatched nothing
            assert first.scheduler.counts["requests"] == 5
            m.call(first.stop(0))  # a clean stop gives the lease up at once
            m.scheduler = second
            poll(lambda: second.scheduler.leader, WAIT_S, "the standby to take the lease")
            stub.ModelInfer(_request(7), timeout=10)
        assert second.scheduler.counts["requests"] == 1
    finally:
        if m.scheduler is not second:
            m.call(second.stop(0))


def test_only_the_leader_reports_queue_depths(mesh_factory):
    # An autoscaler sums batchline_pending_requests over every scheduler: a former leader's last
    # depths would count twice, or count requests long gone.
    m = mesh_factory(models=["mlp"])
    depth = {"model": "mlp", "version": "1", "priority": "1"}

    def reported():
        return prometheus_client.REGISTRY.get_sample_value("batchline_pending_requests", depth)

    poll(lambda: m.scheduler.scheduler.leader and reported() is not None, WAIT_S, "the leader to report mlp's depth")
    _hold_lease(m)
    assert reported() is None
    r = redis.Redis.from_url(m.redis_url)
    r.delete(contract.LEADER)
    poll(lambda: m.scheduler.scheduler.leader and reported() is not None, WAIT_S, "the depth back with the lease")


def test_a_standby_leaves_the_shared_event_lists_to_the_leader(mesh_factory):
    m = mesh_factory(models=["mlp"])
    r = _hold_lease(m)
    scheduler = m.scheduler.scheduler

    def next_lease_attempt():
        # Attempts are a third of the lease TTL (1 s) apart, as long as a blocking wait at most.
        attempt = scheduler.lease.attempted_at
        poll(lambda: scheduler.lease.attempted_at > attempt, WAIT_S, "a lease attempt")

    next_lease_attempt()  # the wait begun while it led has ended
    report = pb.ExecutionReport(executor_id="x", model_name="mlp", model_version="1", rows=3,
                                compute_infer_ns=3_000_000).SerializeToString()
    r.rpush(contract.REPORTS, report)
    r.rpush(contract.notify(("mlp", "1")), 1)
    next_lease_attempt()
    next_lease_attempt()
    assert not scheduler.leader
    assert report in r.lrange(contract.REPORTS, 0, -1)  # a leader's profile sample, not the standby's
    assert r.llen(contract.notify(("mlp", "1"))) == 1

    r.delete(contract.LEADER)
    poll(lambda: scheduler.leader, WAIT_S, "the scheduler to take the lease")
    poll(lambda: r.llen(contract.REPORTS) == 0 and r.llen(contract.notify(("mlp", "1"))) == 0, WAIT_S,
         "the leader to take the events")
    # An unregistered executor's report counts for its model's "unknown" kind.
    poll(lambda: (3, 0.003) in scheduler.profiles.of(("mlp", "1", "unknown")).samples(), WAIT_S,
         "the report in the profile")


def test_a_dead_executors_batch_is_requeued_and_answered_by_another(mesh_factory):
    m = mesh_factory(models=["mlp"])
    r = _hold_lease(m)
    gateway_id = "gw-recovery"
    r.set(contract.gateway(gateway_id), "by-hand", px=60_000)
    # What a scheduler would have dispatched to an executor that then died.
    entries = _dispatch_by_hand(r, "dead", "lost", gateway_id, [0.0, 1.0, 2.0])
    r.sadd(contract.EXECUTORS, "dead")  # registered once, but its heartbeat key is gone
    r.delete(contract.LEADER)

    replies = {}
    deadline = time.monotonic() + 15
    while len(replies) < 3 and time.monotonic() < deadline:
        item = r.blpop([contract.reply(gateway_id)], timeout=1)
        if item:
            reply = pb.Reply.FromString(item[1])
            replies[reply.request_id] = reply
    assert sorted(replies) == sorted(e.request_id for e in entries)
    assert all(reply.code == 0 for reply in replies.values())
    assert m.scheduler.scheduler.counts["redispatched"] == 3
    # The dead executor's keys are gone and it is forgotten (at the refresh whose recovery finds
    # nothing left of it).
    assert not r.exists(contract.work("dead"), contract.inflight(("mlp", "1"), "dead"),
                        contract.batch(("mlp", "1"), "lost"))
    poll(lambda: not r.sismember(contract.EXECUTORS, "dead"), WAIT_S, "the dead executor to be forgotten")


def test_warm_up_seeds_the_profile_and_a_restarted_scheduler_loads_it(mesh_factory):
    m = mesh_factory(models=["mlp"])
    key = ("mlp", "1", "CPUExecutionProvider")
    # Before any request, the executor's warm-up runs (batch sizes 1..64, twice each) are the profile.
    profile = poll(lambda: m.scheduler.scheduler.profiles.by_key.get(key), WAIT_S, "the warm-up reports")
    poll(lambda: len(profile) >= 14, WAIT_S, "all warm-up samples")
    assert {rows for rows, _ in profile.warm_up_samples()} == {1, 2, 4, 8, 16, 32, 64}
    assert profile.samples() == []  # no real batch yet
    assert profile.predict(64) >= profile.predict(1) > 0  # mlp is so cheap that noise may flatten the slope
    m.call(m.scheduler.stop(0))  # saves the profile
    r = redis.Redis.from_url(m.redis_url)
    assert r.ttl(contract.profile(key[:2], key[2])) > 0
    again = m.call(SchedulerApp(SchedulerSettings(redis_url=m.redis_url, port=0, metrics_port=-1)).start())
    m.scheduler = again
    channel, stub = _stub(m)
    before = time.time()
    with channel:
        stub.ModelInfer(_request(), timeout=10)
    answered = time.time()
    loaded = again.scheduler.profiles.by_key[key]
    assert len(loaded) >= len(profile)  # it started from the saved samples, not from nothing
    # ... still told apart: the warm-up runs, and the one real batch that now steers the fit.
    assert {rows for rows, _ in loaded.warm_up_samples()} == {1, 2, 4, 8, 16, 32, 64}
    poll(lambda: len(loaded.samples()) >= 1, WAIT_S, "the request's execution report")
    assert {rows for rows, _ in loaded.samples()} == {1}
    # The report said when the batch released the model: batches fetched behind it date their start from it.
    [executor_id] = [e.settings.executor_id for e in m.executors]
    assert before < again.scheduler.timeline.ran_until[executor_id] < answered


def _backed_up(m, cost_per_unit_s: float = 0.001) -> redis.Redis:
    """Hold the scheduling lease and publish the load view the (deadline-policy) scheduler would for
    an mlp queue backed up for as long as the view lives, a minute (5000 rows queued at priority 1,
    and the executor busy until then): however slow the host, no request fits in the test's time.
    Returns the Redis client."""
    r = _hold_lease(m)
    now = time.time()
    backed_up = pb.QueueTail(free_s=[now + 60.0])  # the executor's queued work, nothing more to join
    view = pb.ModelLoad(cost_per_unit_s=cost_per_unit_s, cost_fixed_s=0.01, executors=1, queued_rows=[5000, 0],
                        policy="deadline", updated_us=now_us() + 60_000_000, tails=[backed_up, backed_up])
    r.set(contract.load(("mlp", "1")), view.SerializeToString(), px=60_000)
    # (the real scheduler published a view of its own before standing by: wait for ours)
    poll(lambda: getattr(m.gateway.gateway.loads.get(("mlp", "1")), "queued_rows", [0])[0] == 5000, WAIT_S,
         "the gateway to read the load view")
    return r


def test_overload_is_refused_at_once_with_a_retry_hint(mesh_factory):
    m = mesh_factory(models=["mlp"])
    r = _backed_up(m)
    channel, stub = _stub(m)
    with channel:
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(_request(timeout_us=200_000), timeout=10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "overloaded" in info.value.details() and "5000 rows queued ahead" in info.value.details()
        retry = dict(info.value.trailing_metadata())["retry-after-ms"]
        assert int(retry) > 0
        # A budget shorter than the model's run time alone: DEADLINE_EXCEEDED, not worth queueing.
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(_request(timeout_us=1_000), timeout=10)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "raise the timeout" in info.value.details()
    # Refused requests left nothing behind.
    assert r.zcard(contract.queue(("mlp", "1"))) == 0


def _refusal_hints(m, n: int) -> list[int]:
    """When `n` requests (200 ms budgets) refused one after another are told to come back, in ms
    on one clock: each retry-after hint plus when its refusal arrived (the clock's start is arbitrary).
    A hint counts from the refusal's arrival at the gateway, which the time its answer came back
    stands in for: the calls' own durations, however long on a busy host, then drop out."""
    channel, stub = _stub(m)
    back_at = []
    with channel:
        for _ in range(n):
            with pytest.raises(grpc.RpcError) as info:
                stub.ModelInfer(_request(timeout_us=200_000), timeout=10)
            answered_ms = time.monotonic() * 1e3
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            back_at.append(answered_ms + int(dict(info.value.trailing_metadata())["retry-after-ms"]))
    return back_at


def test_each_refusal_is_told_to_come_back_after_the_one_before(mesh_factory):
    """Clients that all came back when the first refused one could fit would mostly be refused
    again: each later refusal's hint is one request's share of a batch (here 50 ms) later."""
    m = mesh_factory(models=["mlp"])
    _backed_up(m, cost_per_unit_s=0.05)
    back_at = _refusal_hints(m, 3)
    # 50 ms apart (give or take how much longer one answer took than another to come back)
    assert back_at[1] - back_at[0] > 25 and back_at[2] - back_at[1] > 25, back_at


def test_with_two_gateways_each_spaces_its_own_refusals_twice_as_far(mesh_factory):
    """Each gateway sees about half of the refused clients: to have them all come back at the
    rate the model serves them, each spaces its own twice as far (here 100 ms, not 50)."""
    from gateway.app import GatewayApp
    from gateway.settings import GatewaySettings

    m = mesh_factory(models=["mlp"])
    other = m.call(GatewayApp(GatewaySettings(redis_url=m.redis_url, port=0, metrics_port=-1, http_port=-1,
                                              heartbeat_interval_s=0.1)).start())
    try:
        _backed_up(m, cost_per_unit_s=0.05)
        poll(lambda: m.gateway.gateway.gateways == 2, WAIT_S, "the gateway to count two live gateways")
        assert redis.Redis.from_url(m.redis_url).zcard(contract.GATEWAYS) == 2
        back_at = _refusal_hints(m, 3)
        # 100 ms apart, not 50 (give or take how much longer one answer took than another)
        assert back_at[1] - back_at[0] > 75 and back_at[2] - back_at[1] > 75, back_at
    finally:
        m.call(other.stop(0))
    # A gateway that stops leaves the set at once; the others count one fewer at their next heartbeat.
    assert redis.Redis.from_url(m.redis_url).zcard(contract.GATEWAYS) == 1
    poll(lambda: m.gateway.gateway.gateways == 1, WAIT_S, "the gateway to count one live gateway")


def test_a_refusal_on_a_stream_carries_the_retry_hint_and_the_stream_goes_on(mesh_factory):
    m = mesh_factory(models=["mlp"])
    r = _backed_up(m)
    channel, stub = _stub(m)
    overloaded = _request(timeout_us=200_000)
    overloaded.id = "over"
    too_tight = _request(timeout_us=1_000)
    too_tight.id = "tight"
    with channel:
        answers = list(stub.ModelStreamInfer(iter([overloaded, too_tight]), timeout=10))
    by_id = {a.infer_response.id: a for a in answers}
    assert set(by_id) == {"over", "tight"}
    assert by_id["over"].error_message.startswith("[RESOURCE_EXHAUSTED]")
    assert "overloaded" in by_id["over"].error_message
    assert by_id["over"].infer_response.parameters["retry-after-ms"].int64_param > 0
    # Only a refusal for load says when to come back: a budget too short for the model does not.
    assert by_id["tight"].error_message.startswith("[DEADLINE_EXCEEDED]")
    assert "retry-after-ms" not in by_id["tight"].infer_response.parameters
    assert r.zcard(contract.queue(("mlp", "1"))) == 0


@pytest.mark.parametrize("streaming", [False, True], ids=["unary", "streams"])
def test_the_bench_closed_loop_waits_out_a_refusals_retry_after_hint(mesh_factory, streaming):
    from batchline.bench import run_closed

    m = mesh_factory(models=["mlp"])
    _backed_up(m)  # every request with a 200 ms budget is refused, with a hint of about a minute
    waits = run_closed(m.address, "mlp", 2, 1.0, warmup=0.0, budget_ms=200, streaming=streaming)
    storm = run_closed(m.address, "mlp", 2, 1.0, warmup=0.0, budget_ms=200, retry_after=False, streaming=streaming)
    # Each of the two workers is refused once and waits out the rest of the second.
    assert waits.status_counts == {"RESOURCE_EXHAUSTED": 2}
    assert set(storm.status_counts) == {"RESOURCE_EXHAUSTED"} and storm.status_counts["RESOURCE_EXHAUSTED"] > 20


def _count_load_reads(gw) -> list[float]:
    """Record when the gateway reads mlp's load view (time.monotonic() of each read)."""
    reads: list[float] = []
    real_mget = gw.store.client.mget

    async def counted_mget(keys, *args, **kwargs):
        if contract.load(("mlp", "1")) in keys:
            reads.append(time.monotonic())
        return await real_mget(keys, *args, **kwargs)

    gw.store.client.mget = counted_mget
    return reads


def test_an_idle_gateway_leaves_the_load_views_alone_until_a_request_arrives(mesh_factory, monkeypatch):
    import gateway.views

    monkeypatch.setattr(gateway.views, "IDLE_REFRESH_S", 60.0)  # idle: no read within the test
    m = mesh_factory(models=["mlp"])
    r = _hold_lease(m)  # the scheduler stands by and publishes no view of its own
    gw = m.gateway.gateway
    reads = _count_load_reads(gw)
    now = time.time()
    view = pb.ModelLoad(cost_per_unit_s=0.001, executors=1, queued_rows=[0], policy="deadline",
                        updated_us=now_us(), tails=[pb.QueueTail(free_s=[now])])
    r.set(contract.load(("mlp", "1")), view.SerializeToString(), px=60_000)
    time.sleep(0.3)  # fifteen busy-rate periods
    assert reads == [] and gw.loads.get(("mlp", "1")) != view
    channel, stub = _stub(m)
    with channel:
        pending = stub.ModelInfer.future(_request(1.0), timeout=10)  # stays queued: nothing dispatches
        # The request woke the loop: the view is read now, not a minute later.
        poll(lambda: gw.loads.get(("mlp", "1")) == view, 10, "the gateway to read the view after a request")
        assert reads
        pending.cancel()


def test_the_gateway_reads_the_load_views_as_often_as_the_budgets_in_play_need(mesh_factory, monkeypatch):
    import gateway.views

    monkeypatch.setattr(gateway.views, "IDLE_REFRESH_S", 60.0)  # only requests ask for reads
    m = mesh_factory(models=["mlp"])
    r = _hold_lease(m)  # nothing is dispatched: requests stay queued until their deadlines
    gw = m.gateway.gateway
    reads = _count_load_reads(gw)
    channel, stub = _stub(m)
    with channel:
        # 60 s budgets: a view up to 6 s old will do, so only the first request asks for one.
        relaxed = []
        for _ in range(10):
            relaxed.append(stub.ModelInfer.future(_request(1.0), timeout=60))
            time.sleep(0.05)
        poll(lambda: r.zcard(contract.queue(("mlp", "1"))) == 10, WAIT_S, "all ten admitted and queued")
        assert len(reads) == 1
        for f in relaxed:
            f.cancel()
        # 200 ms budgets want views no older than 20 ms: each request 100 ms apart asks again.
        tight = []
        for _ in range(10):
            tight.append(stub.ModelInfer.future(_request(1.0), timeout=0.2))
            time.sleep(0.1)
        for f in tight:
            with pytest.raises(grpc.RpcError):
                f.result()
        assert len(reads) >= 1 + 6  # a slow host may fold a few into one


def test_requests_admitted_since_the_view_count_until_a_later_view_shows_them(mesh_factory):
    m = mesh_factory(models=["mlp"], gateway_overrides={"admission_headroom": 0.7})
    r = _hold_lease(m)  # nothing is dispatched: admitted requests stay queued
    gateway = m.gateway.gateway

    def publish(queued_rows: int) -> int:
        # 80 ms per row, an idle executor, `queued_rows` rows in the plan's one batch.
        now = time.time()
        tail = pb.QueueTail(free_s=[now + 0.08 * queued_rows])  # a full batch of them on its way
        view = pb.ModelLoad(cost_per_unit_s=0.08, executors=1, queued_rows=[queued_rows], policy="deadline",
                            updated_us=now_us(), tails=[tail] if queued_rows else [pb.QueueTail(free_s=[now])])
        r.set(contract.load(("mlp", "1")), view.SerializeToString(), px=60_000)
        poll(lambda: gateway.loads.get(("mlp", "1")) == view, WAIT_S, "the gateway to read the view")
        return view.updated_us

    publish(0)
    queue = contract.queue(("mlp", "1"))
    channel, stub = _stub(m)
    with channel:
        # Budget 300 ms, planned to 290, admitted up to 0.7 of that (203 ms): 2 rows of 80 ms fit, 3 do not.
        first = stub.ModelInfer.future(_request(1.0), timeout=5)
        poll(lambda: r.zcard(queue) == 1, WAIT_S, "the first request queued")
        second = stub.ModelInfer.future(_request(2.0), timeout=5)  # admitted: 1 row ahead
        poll(lambda: r.zcard(queue) == 2, WAIT_S, "the second request queued")
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(_request(3.0), timeout=0.3)  # behind the 2 queued since the view: refused
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "2 rows queued ahead" in info.value.details()
        # A request whose client gave up is ahead of nobody.
        second.cancel()
        poll(lambda: r.zcard(queue) == 1, WAIT_S, "the second request to leave its queue")
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(_request(4.0), timeout=0.3)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # admitted (1 row ahead), then timed out
        # A view read after the first one's enqueue shows it queued: the gateway stops counting it
        # itself (else 2 rows ahead, and no room).
        publish(1)
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(_request(5.0), timeout=0.3)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        first.cancel()


def test_a_view_that_read_a_request_before_its_gateway_heard_it_was_queued_counts_it_once(mesh_factory, monkeypatch):
    """The scheduler can read a request from Redis before the gateway's write returns: a view dated
    before the confirmation still counts it, and says so in seen_us, so the gateway stops counting it."""
    import gateway.views

    # The views below are the gateway's as set, never read back: a read that a request asked for,
    # begun before a publish and ending after it, would put the older view back in its place.
    monkeypatch.setattr(gateway.views, "IDLE_REFRESH_S", 60.0)
    monkeypatch.setattr(gateway.views, "LOAD_AGE_SHARE", 1e9)
    m = mesh_factory(models=["mlp"], gateway_overrides={"admission_headroom": 0.7})
    r = _hold_lease(m)  # nothing is dispatched: admitted requests stay queued
    gw = m.gateway.gateway
    queue = contract.queue(("mlp", "1"))

    def publish(queued_rows: int, updated_us: int, seen_us: dict[str, int]) -> None:
        # The view as the gateway reads it, at once: the executor is busy with the queued rows for
        # 80 ms each from now, which must not have passed when the next request arrives.
        now = time.time()
        tail = pb.QueueTail(free_s=[now + 0.08 * queued_rows])  # a full batch of them on its way
        view = pb.ModelLoad(cost_per_unit_s=0.08, executors=1, queued_rows=[queued_rows], policy="deadline",
                            updated_us=updated_us, tails=[tail] if queued_rows else [pb.QueueTail(free_s=[now])],
                            seen_us=seen_us)
        r.set(contract.load(("mlp", "1")), view.SerializeToString(), px=60_000)
        gw.views.loads = {**gw.views.loads, ("mlp", "1"): view}

    publish(0, now_us(), {})
    channel, stub = _stub(m)
    with channel:
        first = stub.ModelInfer.future(_request(1.0), timeout=5)
        [member] = poll(lambda: r.zrange(queue, 0, -1), WAIT_S, "the first request queued")
        entry = pb.QueueEntry.FromString(member)
        # A view with the request in its plan, taken before the gateway heard back from Redis.
        # Budget 300 ms, admitted up to 0.7 of 290: 1 row ahead (160 ms with the new one) fits, 2 do not.
        publish(1, entry.enqueued_us, {})
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(_request(2.0), timeout=0.3)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # counted twice: 2 rows ahead
        assert "2 rows queued ahead" in info.value.details()
        publish(1, entry.enqueued_us, {gw.gateway_id: entry.enqueued_us, "another-gateway": now_us() + 10**9})
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(_request(3.0), timeout=0.3)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, info.value.details()  # admitted, never run
        first.cancel()


def test_the_load_view_says_up_to_which_request_of_each_gateway_it_has_read(mesh_factory):
    m = mesh_factory(models=["mlp"])
    r = redis.Redis.from_url(m.redis_url)
    gateway_id = m.gateway.gateway.gateway_id
    channel, stub = _stub(m)
    with channel:
        for i in range(3):
            before = now_us()
            stub.ModelInfer(_request(float(i)), timeout=10)
            # Dispatched, run and answered: its view has counted it (queued or sent on), even if the
            # scheduler never published while it was queued.
            poll(lambda: (b := r.get(contract.load(("mlp", "1")))) and
                         pb.ModelLoad.FromString(b).seen_us.get(gateway_id, 0) >= before, WAIT_S,
                         "a view that has read the request")
            assert pb.ModelLoad.FromString(r.get(contract.load(("mlp", "1")))).seen_us[gateway_id] <= now_us()


def test_an_answered_request_is_ahead_of_nobody_while_no_newer_view_comes(mesh_factory):
    m = mesh_factory(models=["mlp"])
    r = _hold_lease(m)  # the only view is ours, and only we dispatch: like an idle scheduler's last view
    gateway = m.gateway.gateway
    now = time.time()
    view = pb.ModelLoad(cost_per_unit_s=0.08, executors=1, queued_rows=[0], policy="deadline",
                        updated_us=now_us(), tails=[pb.QueueTail(free_s=[now])])
    r.set(contract.load(("mlp", "1")), view.SerializeToString(), px=60_000)
    poll(lambda: gateway.loads.get(("mlp", "1")) == view, WAIT_S, "the gateway to read the view")
    channel, stub = _stub(m)
    with channel:
        queue = contract.queue(("mlp", "1"))
        first = stub.ModelInfer.future(_request(1.0), timeout=10)  # admitted after the view was taken
        members = poll(lambda: r.zrange(queue, 0, -1), WAIT_S, "the first request queued")
        _dispatch_queued(r, m, "mlp", members, "answered")
        assert first.result(timeout=10).outputs
        # Budget 200 ms, planned to 190, admitted up to 133 ms: 80 ms alone fits; behind the answered
        # request, still counted, 160 ms would not.
        second = stub.ModelInfer.future(_request(2.0), timeout=0.2)
        seen = poll(lambda: "queued" if r.zcard(queue) else ("over" if second.done() else None), WAIT_S,
                    "the second request admitted or refused")
        assert seen == "queued", second.exception().details()
        assert second.exception(timeout=5).code() == grpc.StatusCode.DEADLINE_EXCEEDED  # admitted, never run


def test_a_gateway_whose_admitted_requests_come_late_admits_less(mesh_factory):
    m = mesh_factory(models=["mlp"], gateway_overrides={"admission_target": 0.99, "admission_headroom": 0.7})
    r = _hold_lease(m)  # nothing is dispatched: every admitted request times out
    gateway = m.gateway.gateway
    calibration = gateway.calibration(("mlp", "1"))
    calibration.step = 0.2  # so that one late answer shows
    # An idle executor and 80 ms per row. The view is dated now, so the requests admitted after it
    # count on top of it (for 2 s, while it is fresh enough to be used).
    view = pb.ModelLoad(cost_per_unit_s=0.08, executors=1, queued_rows=[0], policy="deadline",
                        updated_us=now_us(), tails=[pb.QueueTail(free_s=[time.time()])])
    r.set(contract.load(("mlp", "1")), view.SerializeToString(), px=60_000)
    poll(lambda: gateway.loads.get(("mlp", "1")) == view, WAIT_S, "the gateway to read the view")
    channel, stub = _stub(m)
    with channel:
        # A request with a long budget is admitted first and stays queued, so the requests below
        # share its batch (2 rows, 160 ms) rather than start alone on the idle executor, which
        # admission allows whatever the headroom.
        ahead = stub.ModelInfer.future(_request(0.0), timeout=30)
        poll(lambda: r.zcard(contract.queue(("mlp", "1"))) == 1, WAIT_S, "the first request queued")
        # Budget 280 ms, planned to 270: 160 ms is within 0.7 of it, so the request is admitted, and comes late.
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(_request(1.0), timeout=0.28)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # (the client's deadline and the gateway's own end the call at about the same moment)
        poll(lambda: calibration.headroom < 0.7, WAIT_S, "the gateway to count the late answer")
        assert calibration.headroom == pytest.approx(0.7 - 0.2 * 0.99)
        # The same request against the same view: 160 ms is past 0.5 of 270 now.
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(_request(2.0), timeout=0.28)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "overloaded" in info.value.details()
        exported = prometheus_client.REGISTRY.get_sample_value("batchline_admission_headroom",
                                                               {"model": "mlp", "version": "1"})
        assert exported == pytest.approx(0.7 - 0.2 * 0.99)
        ahead.cancel()


def test_max_queue_size_refuses_with_resource_exhausted(mesh_factory, model_repository, tmp_path):
    repo = pathlib.Path(tmp_path) / "repo"
    shutil.copytree(pathlib.Path(model_repository) / "mlp", repo / "mlp")
    config = repo / "mlp" / "config.toml"
    config.write_text(config.read_text() + "\nmax_queue_size = 2\n")
    from batchline.testing.in_process import InProcessMesh

    m = InProcessMesh(None, str(repo), models=["mlp"]).start()
    try:
        r = _hold_lease(m)
        channel = grpc.insecure_channel(m.address)
        stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
        waiting = [stub.ModelInfer.future(_request(i), timeout=30) for i in range(2)]
        poll(lambda: r.zcard(contract.queue(("mlp", "1"))) == 2, WAIT_S, "two queued requests")
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(_request(9), timeout=10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue of model 'mlp' is full" in info.value.details() and "max_queue_size" in info.value.details()
        assert r.zcard(contract.queue(("mlp", "1"))) == 2  # the refused one was not queued
        r.delete(contract.LEADER)  # the scheduler takes over and serves the two queued ones
        assert all(f.result(timeout=15).id == "t" for f in waiting)
        channel.close()
    finally:
        m.stop()


def test_a_lone_clients_requests_stop_waiting_for_company_that_cannot_come(model_repository, tmp_path):
    """A client that sends one request at a time: once the scheduler has seen that nothing joins a
    lone request, it sends each at once instead of holding it for max_queue_delay (Triton's way,
    and the FIFO policy's, would hold every one)."""
    repo = pathlib.Path(tmp_path) / "repo"
    shutil.copytree(pathlib.Path(model_repository) / "mlp", repo / "mlp")
    config = repo / "mlp" / "config.toml"
    config.write_text(re.sub(r"max_queue_delay_ms = [0-9.]+", "max_queue_delay_ms = 300.0", config.read_text()))
    assert "max_queue_delay_ms = 300.0" in config.read_text()
    from batchline.testing.in_process import InProcessMesh

    m = InProcessMesh(None, str(repo), models=["mlp"]).start()
    try:
        channel, stub = _stub(m)
        for i in range(8):
            assert stub.ModelInfer(_request(i), timeout=30).id == "t"
        counts = m.scheduler.scheduler.counts
        # The first one or two wait (one may have been queued before the scheduler's first step, and
        # nothing is known yet about company): the rest go at once.
        assert counts["reason:delay"] <= 2 and counts["reason:no_company"] >= 6, dict(counts)
        channel.close()
    finally:
        m.stop()


def test_a_model_with_two_instances_runs_on_two_lanes_of_one_executor(model_repository, tmp_path):
    repo = pathlib.Path(tmp_path) / "repo"
    shutil.copytree(pathlib.Path(model_repository) / "mlp", repo / "mlp")
    shutil.copytree(pathlib.Path(model_repository) / "minilm", repo / "minilm")
    config = repo / "mlp" / "config.toml"
    # Batches of 2: 16 requests at once make more batches than one lane takes.
    config.write_text(config.read_text().replace("max_batch_size = 64", "max_batch_size = 2")
                      + "\ninstance_count = 2\n")
    (repo / "minilm" / "config.toml").write_text(
        (repo / "minilm" / "config.toml").read_text().replace("instance_count = 2", "instance_count = 1"))
    from batchline.testing.in_process import InProcessMesh

    m = InProcessMesh(None, str(repo), models=["mlp", "minilm"]).start()
    try:
        r = redis.Redis.from_url(m.redis_url)
        eid = m.executors[0].executor.executor_id
        lanes = {e: pb.ExecutorInfo.FromString(r.get(contract.executor(e))) for e in (eid, f"{eid}#1")}
        # One process, two ids to the scheduler; the second lane holds only the model with two instances.
        assert {x.address for x in lanes.values()} == {lanes[eid].address}
        assert [x.name for x in lanes[eid].models] == ["minilm", "mlp"]
        assert [x.name for x in lanes[f"{eid}#1"].models] == ["mlp"]
        # All 16 queue while the scheduler stands by, so that its first plan has 8 batches to place.
        held = _hold_lease(m)
        channel, stub = _stub(m)
        futures = [stub.ModelInfer.future(_request(i), timeout=30) for i in range(16)]
        poll(lambda: held.zcard(contract.queue(("mlp", "1"))) == 16, WAIT_S, "16 queued requests")
        held.delete(contract.LEADER)
        assert all(f.result().id == "t" for f in futures)
        channel.close()
        ran = {e: pb.ExecutorInfo.FromString(r.get(contract.executor(e))).executed_batches for e in lanes}
        poll(lambda: all(pb.ExecutorInfo.FromString(r.get(contract.executor(e))).executed_batches for e in lanes),
             WAIT_S, f"both lanes to report batches run (so far {ran})")
        # The process's control endpoint counts the batches of both lanes.
        app = m.executors[0]
        with grpc.insecure_channel(f"127.0.0.1:{app.port}") as control:
            status = internal_pb2_grpc.ExecutorStub(control).Status(pb.StatusRequest(), timeout=5)
        assert status.executor_id == eid
        assert status.executed_batches == sum(lane.executed_batches for lane in app.lanes) >= 8
    finally:
        m.stop()


def test_batches_that_find_every_executor_idle_go_to_the_one_idle_longest(mesh_factory):
    """One request at a time, two idle executors: each batch goes to the one idle longer, so
    both take turns (the first in order used to take them all)."""
    m = mesh_factory(models=["mlp"], executors=2)
    channel, stub = _stub(m)
    for i in range(6):
        assert stub.ModelInfer(_request(i), timeout=30).id == "t"
    # An executor counts a batch once its answer is written: the client may read it first.
    poll(lambda: sum(app.executor.executed_batches for app in m.executors) == 6, WAIT_S,
         "the executors to count the batches they answered")
    ran = [app.executor.executed_batches for app in m.executors]
    assert min(ran) >= 2, ran
    channel.close()


def test_a_stopping_executor_finishes_the_batch_sent_to_it(mesh_factory):
    m = mesh_factory(models=["mlp"], executors=2)
    r = _hold_lease(m)
    gateway_id = "gw-drain"
    r.set(contract.gateway(gateway_id), "by-hand", px=60_000)
    victim = m.executors[0]
    eid = victim.executor.executor_id
    _dispatch_by_hand(r, eid, "b1", gateway_id, [1.0])  # in the same instant as it is told to stop
    m.call(victim.stop(0))
    m.executors.remove(victim)
    item = r.blpop([contract.reply(gateway_id)], timeout=10)
    assert item is not None and pb.Reply.FromString(item[1]).code == 0
    assert not r.exists(contract.executor(eid))
    # Left registered so that anything sent after its hand-back is recovered; the scheduler then forgets it.
    r.delete(contract.LEADER)
    poll(lambda: not r.sismember(contract.EXECUTORS, eid), WAIT_S, "the scheduler to forget the stopped executor")


def test_an_executor_does_not_run_a_member_whose_deadline_passed_while_it_waited(mesh_factory):
    m = mesh_factory(models=["mlp"])
    r = _hold_lease(m)  # a standby leaves execution reports in their list
    r.delete(contract.REPORTS)
    gateway_id = "gw-late"
    r.set(contract.gateway(gateway_id), "by-hand", px=60_000)
    eid = m.executors[0].executor.executor_id
    late, on_time = _dispatch_by_hand(r, eid, "late", gateway_id, [1.0, 2.0],
                                      deadlines_us=[now_us() - 1_000, now_us() + 30_000_000])
    replies = {}
    while len(replies) < 2:
        item = r.blpop([contract.reply(gateway_id)], timeout=10)
        assert item is not None, "no reply"
        reply = pb.Reply.FromString(item[1])
        replies[reply.request_id] = reply
    assert replies[on_time.request_id].code == 0
    assert replies[late.request_id].code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert "it was not run" in replies[late.request_id].message
    # The batch ran one row: the late member was not executed.
    reports = [pb.ExecutionReport.FromString(b) for b in r.lrange(contract.REPORTS, 0, -1)]
    assert [x.rows for x in reports if x.batch_id == "late"] == [1]


def test_an_executor_that_cannot_finish_in_time_hands_its_work_back(mesh_factory):
    m = mesh_factory(models=["mlp"])
    r = _hold_lease(m)
    victim = m.executors[0]
    eid = victim.executor.executor_id
    victim.settings = victim.settings.model_copy(update={"drain_timeout_s": 0.0})
    for task in victim.executor._workers:  # it is stuck: its workers never take the batch
        task.cancel()
    [entry] = _dispatch_by_hand(r, eid, "b2", "gw", [0.0])
    m.call(victim.stop(0))
    m.executors.remove(victim)
    # Back in its queue, with its original score, for another executor.
    queued = r.zrange(contract.queue(("mlp", "1")), 0, -1, withscores=True)
    assert [(pb.QueueEntry.FromString(member).request_id, score) for member, score in queued] == [
        (entry.request_id, contract.queue_score(1, entry.deadline_us))
    ]
    assert not r.exists(contract.work(eid), contract.inflight(("mlp", "1"), eid), contract.batch(("mlp", "1"), "b2"))


def test_the_load_view_counts_queued_rows_per_priority_level(mesh_factory):
    from batchline.planning import BatchingRule, Pending

    m = mesh_factory(models=["mlp"])
    r = _hold_lease(m)  # no step publishes meanwhile
    scheduler = m.scheduler.scheduler
    key = ("mlp", "1")
    info = m.gateway.gateway.catalog.registry.models[key]
    assert info.priority_levels == 0  # levels not configured: any priority up to the cap
    now = time.time()
    queue = [Pending("a", 2, 1, now + 5, now), Pending("b", 3, 5, now + 5, now), Pending("c", 1, 5, now + 5, now)]
    scheduler.views.published_at.clear()

    async def publish():
        async with scheduler.store.step_writes() as pipe:
            cost = scheduler.profiles.of((*key, "test")).cost()
            scheduler.views.publish(pipe, key, info, [], cost, BatchingRule.of_model(info), queue, now, now)
            await pipe.execute()

    m.call(publish())
    view = pb.ModelLoad.FromString(r.get(contract.load(key)))
    # A priority-1 request is behind 2 rows only, not behind the priority-5 ones.
    assert list(view.queued_rows) == [2, 0, 0, 0, 4]
    # The play for level 1 and each level with rows queued (no executor holds the model here,
    # so one virtual one, idle now): level 1 (and 2-4, empty) is a's batch of 2 rows, level 5
    # one batch of all 6 (max_batch_size 64); each may still take arrivals, and starts now.
    assert [(t.level, [i.rows for i in t.items]) for t in view.tails] == [(1, [2]), (5, [2, 3, 1])]
    assert all(list(t.free_s) == [pytest.approx(now)] for t in view.tails)


def _text_request(tokens: int, timeout_us: int | None = None, token_id: int = 1) -> ipb.ModelInferRequest:
    req = ipb.ModelInferRequest(model_name="minilm", id=f"t{tokens}")
    for name, value in (("input_ids", token_id), ("attention_mask", 1)):
        req.inputs.add(name=name, datatype="INT64", shape=[1, tokens])
        req.raw_input_contents.append(np.full((1, tokens), value, np.int64).tobytes())
    if timeout_us is not None:
        req.parameters["timeout"].int64_param = timeout_us
    return req


def test_a_text_requests_length_travels_with_it_and_its_batch_reports_the_padded_work(mesh_factory):
    m = mesh_factory(models=["minilm"])
    r = _hold_lease(m)  # requests stay queued, and a standby leaves execution reports in their list
    r.delete(contract.REPORTS)
    queue = contract.queue(("minilm", "1"))
    channel, stub = _stub(m)
    with channel:
        calls = [stub.ModelInfer.future(_text_request(n), timeout=30) for n in (5, 12)]
        members = poll(lambda: (q := r.zrange(queue, 0, -1)) and len(q) == 2 and q, WAIT_S, "both requests queued")
        assert sorted(pb.QueueEntry.FromString(x).length for x in members) == [5, 12]
        # One batch of both, as the scheduler would send it: the executor pads the 5 tokens to 12.
        _dispatch_queued(r, m, "minilm", members, "mixed")
        for call in calls:
            assert call.result(timeout=30).outputs[0].shape == [1, 384]
    [report] = [x for x in map(pb.ExecutionReport.FromString, r.lrange(contract.REPORTS, 0, -1))
                if x.batch_id == "mixed"]
    assert (report.rows, report.units) == (2, 2 * 12)


def test_a_batch_retried_member_by_member_reports_every_run_it_made(mesh_factory):
    """A token id past the vocabulary fails the padded run of both; the executor then runs each
    alone. The batch's time covers all three runs, so its units must too, or the profile would
    learn that 24 units cost what 41 did."""
    m = mesh_factory(models=["minilm"])
    r = _hold_lease(m)
    r.delete(contract.REPORTS)
    queue = contract.queue(("minilm", "1"))
    channel, stub = _stub(m)
    with channel:
        good = stub.ModelInfer.future(_text_request(5), timeout=30)
        bad = stub.ModelInfer.future(_text_request(12, token_id=10**9), timeout=30)
        members = poll(lambda: (q := r.zrange(queue, 0, -1)) and len(q) == 2 and q, WAIT_S, "both requests queued")
        _dispatch_queued(r, m, "minilm", members, "poisoned")
        assert good.result(timeout=30).outputs[0].shape == [1, 384]
        with pytest.raises(grpc.RpcError) as failed:
            bad.result(timeout=30)
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    [report] = [x for x in map(pb.ExecutionReport.FromString, r.lrange(contract.REPORTS, 0, -1))
                if x.batch_id == "poisoned"]
    assert (report.rows, report.failed, report.units) == (1, 1, 2 * 12 + 5 + 12)


def test_a_short_sequence_is_judged_by_its_own_cost_after_long_ones_taught_the_profile(mesh_factory):
    m = mesh_factory(models=["minilm"])
    r = redis.Redis.from_url(m.redis_url)
    eid = m.executors[0].executor.executor_id
    poll(lambda: m.scheduler.scheduler.profiles.by_key.get(("minilm", "1", "CPUExecutionProvider")), WAIT_S,
         "the warm-up reports")
    # Batches of 8 sequences of 64 and of 128 tokens took 2 ms per token (a very slow host): 1 s and 2 s.
    reports = [pb.ExecutionReport(executor_id=eid, batch_id=f"long{i}", model_name="minilm", model_version="1",
                                  rows=8, requests=8, units=8 * tokens, compute_infer_ns=8 * tokens * 2_000_000)
               for i, tokens in enumerate([64, 128] * 20)]
    r.rpush(contract.REPORTS, *(x.SerializeToString() for x in reports))
    poll(lambda: (view := r.get(contract.load(("minilm", "1")))) and
          pb.ModelLoad.FromString(view).cost_per_unit_s == pytest.approx(0.002, rel=0.01), WAIT_S,
          "the profile's new cost")
    channel, stub = _stub(m)
    with channel:
        # Long budgets, until this gateway reads that view (a request asks for a fresher one).
        poll(lambda: stub.ModelInfer(_text_request(8, timeout_us=10_000_000), timeout=30) and
              (load := m.gateway.gateway.loads.get(("minilm", "1"))) is not None and load.cost_per_unit_s > 0.0015,
             WAIT_S, "the gateway to read the view")  # before its first read it has no view at all
        # 8 tokens: about 16 ms predicted, well within 200 ms. A profile per row would have said 256.
        assert stub.ModelInfer(_text_request(8, timeout_us=200_000), timeout=30).outputs[0].shape == [1, 384]
        # 128 tokens: about 256 ms alone, past the budget: refused at once.
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(_text_request(128, timeout_us=200_000), timeout=30)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "raise the timeout" in info.value.details()


def test_a_spell_of_slow_runs_does_not_lock_tight_budgets_out(mesh_factory):
    """One batch in five stalled for 20 s: the profile's margin (a high quantile of its overruns) is far
    past the clients' 200 ms budgets. Requests that run in a few ms on an idle executor must still
    be served, or nothing would run and report again and the margin would stay up for good; and
    once one has run, the view must show its executor free again, not busy for a whole margin."""
    m = mesh_factory(models=["mlp"])
    r = redis.Redis.from_url(m.redis_url)
    eid = m.executors[0].executor.executor_id
    key = ("mlp", "1")
    poll(lambda: m.scheduler.scheduler.profiles.by_key.get((*key, "CPUExecutionProvider")), WAIT_S,
         "the warm-up reports")
    reports = [pb.ExecutionReport(executor_id=eid, batch_id=f"slow{i}", model_name="mlp", model_version="1",
                                  rows=4, requests=4, units=4, compute_infer_ns=20 * 10**9 if i % 5 == 0 else 2_000_000)
               for i in range(50)]
    r.rpush(contract.REPORTS, *(x.SerializeToString() for x in reports))
    gateway = m.gateway.gateway
    poll(lambda: (view := gateway.loads.get(key)) and view.cost_margin_s > 10, WAIT_S,
         "the gateway to read the new margin")

    def idle_in_view() -> bool:
        return all(f <= time.time() for t in gateway.loads[key].tails for f in t.free_s)

    channel, stub = _stub(m)
    with channel:
        for i in range(3):
            poll(idle_in_view, WAIT_S, "the gateway's view to show the executor free")
            assert stub.ModelInfer(_request(float(i), timeout_us=200_000), timeout=30).outputs[0].shape == [1, 1]


def test_what_a_stopping_gateway_cannot_get_answered_is_told_why(mesh_factory):
    m = mesh_factory(models=["mlp"], gateway_overrides={"drain_timeout_s": 0.2})
    _hold_lease(m)  # nothing gets dispatched: the request outlasts the gateway's drain
    gateway = m.gateway
    channel, stub = _stub(m)
    with channel:
        call = stub.ModelInfer.future(_request(), timeout=30)
        poll(lambda: gateway.gateway.replies.waiting, WAIT_S, "the request to wait in the gateway")
        m.call(gateway.stop())
        m.gateway = None
        with pytest.raises(grpc.RpcError) as err:
            call.result(timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "the gateway is shutting down" in err.value.details()
