"""The scheduler's I/O around the policy, against a real Redis and executor."""
from __future__ import annotations

import asyncio
import time
import uuid

import numpy as np
import redis
from prometheus_client import REGISTRY

from batchline import contract
from batchline.clock import now_us
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import internal_pb2 as pb
from batchline.testing.polling import poll
from scheduler.load_views import pending_by_level


def _enqueue(r, gateway_id: str, deadline_us: int, request: ipb.ModelInferRequest, rows: int = 1,
             model: str = "mlp") -> str:
    """What a gateway writes for one request (see gateway/core.py), done by hand."""
    request_id = uuid.uuid4().hex
    entry = pb.QueueEntry(request_id=request_id, gateway_id=gateway_id, model_version="1", rows=rows,
                          deadline_us=deadline_us, enqueued_us=now_us(), priority=1)
    r.set(contract.gateway(gateway_id), "by-hand", px=60_000)  # the gateway is alive: executors skip orphans
    r.set(contract.payload((model, "1"), request_id), request.SerializeToString(), px=60_000)
    r.zadd(contract.queue((model, "1")), {entry.SerializeToString(): contract.queue_score(1, deadline_us)})
    r.rpush(contract.notify((model, "1")), 1)
    return request_id


def _dropped(reason: str) -> float:
    labels = {"model": "mlp", "version": "1", "reason": reason}
    return REGISTRY.get_sample_value("batchline_requests_dropped_total", labels) or 0.0


def _replies(r: redis.Redis, gateway_id: str, want: int, timeout: float = 10) -> dict[str, pb.Reply]:
    got: dict[str, pb.Reply] = {}
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        item = r.blpop([contract.reply(gateway_id)], timeout=1)
        if item:
            reply = pb.Reply.FromString(item[1])
            got[reply.request_id] = reply
    return got


def _mlp_request(x: np.ndarray) -> ipb.ModelInferRequest:
    req = ipb.ModelInferRequest(model_name="mlp", id="by-hand")
    req.inputs.add(name="features", datatype="FP32", shape=list(x.shape))
    req.raw_input_contents.append(x.astype(np.float32).tobytes())
    return req


def _leader_of_mlp(mesh_factory):
    """A mesh whose timers are long (only events make steps) and its scheduler once it leads and
    sees mlp: (mesh, Redis client, scheduler, mlp's executor id)."""
    m = mesh_factory(models=["mlp"], registry_refresh_s=30.0, lease_ttl_s=90.0)
    r = redis.Redis.from_url(m.redis_url)
    s = m.scheduler.scheduler
    m.loop.call_soon_threadsafe(s.wakeups.wake)
    poll(lambda: s.leader and ("mlp", "1") in s.registry.models, 15, "the leader to see mlp")
    return m, r, s, s.registry.holders[("mlp", "1")][0]


def _fill_executor(r: redis.Redis, s, eid: str) -> list[str]:
    """Make mlp's executor hold as many batches as it may, and a step see it so: mlp's queue
    waits for a report. Returns the held batch ids."""
    held = [f"held{i}" for i in range(s.settings.max_batches_per_executor)]
    r.sadd(contract.inflight(("mlp", "1"), eid), *held)
    r.rpush(contract.REPORTS,
            pb.ExecutionReport(executor_id="x", model_name="mlp", model_version="1").SerializeToString())
    poll(lambda: contract.queue(("mlp", "1")) in s.wakeups.blocked, 15, "mlp's queue to wait for its executor")
    return held


def test_expired_requests_are_answered_by_the_scheduler_and_never_executed(mesh_factory):
    m = mesh_factory(models=["mlp"])
    r = redis.Redis.from_url(m.redis_url)
    gateway_id = "gw-test"
    expired = _enqueue(r, gateway_id, now_us() - 1_000, _mlp_request(np.zeros((1, 32))))
    live = _enqueue(r, gateway_id, now_us() + 5_000_000, _mlp_request(np.ones((1, 32))))
    replies = _replies(r, gateway_id, 2)
    assert replies[expired].code == 4  # DEADLINE_EXCEEDED
    assert "deadline exceeded" in replies[expired].message and "'mlp'" in replies[expired].message
    assert not r.exists(contract.payload(("mlp", "1"), expired))
    assert replies[live].code == 0 and replies[live].response.id == "by-hand"
    stats = r.hgetall(contract.stats(("mlp", "1")))
    assert int(stats[b"inference_count"]) == 1  # only the live one ran
    assert int(stats[b"fail_count"]) == 1
    assert 0 < r.ttl(contract.stats(("mlp", "1"))) <= contract.STATS_TTL
    assert m.scheduler.scheduler.counts["shed"] == 1


def test_a_full_batch_goes_out_at_once_and_records_why(mesh_factory):
    m = mesh_factory(models=["mlp"])
    r = redis.Redis.from_url(m.redis_url)
    gateway_id = "gw-full"
    # Queued atomically, so the scheduler sees all 64 rows (mlp's max_batch_size) in one step.
    with r.pipeline(transaction=True) as pipe:
        ids = [_enqueue(pipe, gateway_id, now_us() + 30_000_000, _mlp_request(np.full((16, 32), k)), rows=16)
               for k in range(4)]
        pipe.execute()
    replies = _replies(r, gateway_id, 4)
    assert all(replies[i].code == 0 for i in ids)
    firsts = []
    for i in ids:
        out = np.frombuffer(replies[i].response.raw_output_contents[0], dtype=np.float32)
        assert out.shape == (16,) and np.all(out == out[0])  # its own 16 identical rows came back to it
        firsts.append(float(out[0]))
    assert len(set(firsts)) == 4  # and not a neighbour's
    stats = r.hgetall(contract.stats(("mlp", "1")))
    assert int(stats[b"inference_count"]) == 64 and int(stats[b"execution_count"]) == 1
    assert int(stats[b"batch:64:count"]) == 1
    assert m.scheduler.scheduler.counts["reason:full"] == 1


def test_requests_of_a_dead_gateway_are_not_executed(mesh_factory):
    m = mesh_factory(models=["mlp"])
    r = redis.Redis.from_url(m.redis_url)
    alive, dead = "gw-alive", "gw-dead"
    reasons = ("gateway_gone", "payload_gone")
    before = {why: _dropped(why) for why in reasons}
    with r.pipeline(transaction=True) as pipe:  # queued at once, the dead gateway already gone
        kept = _enqueue(pipe, alive, now_us() + 30_000_000, _mlp_request(np.ones((1, 32))))
        orphan = _enqueue(pipe, dead, now_us() + 30_000_000, _mlp_request(np.zeros((1, 32))))
        pipe.delete(contract.gateway(dead))  # its heartbeat key expired: nobody waits for its answers
        cancelled = _enqueue(pipe, alive, now_us() + 30_000_000, _mlp_request(np.ones((1, 32))))
        pipe.delete(contract.payload(("mlp", "1"), cancelled))  # answered, cancelled or timed out
        pipe.execute()
    replies = _replies(r, alive, 1)
    assert replies[kept].code == 0
    deadline = time.monotonic() + 10
    while r.exists(contract.payload(("mlp", "1"), orphan)):  # cleaned up with its batch ...
        assert time.monotonic() < deadline, "the orphan's payload was never cleaned up"
        time.sleep(0.02)
    stats = r.hgetall(contract.stats(("mlp", "1")))
    assert int(stats[b"inference_count"]) == 1  # ... but never run
    assert not r.exists(contract.reply(dead))
    # Both dropped unread, and counted with why (the in-process mesh's executors count here).
    poll(lambda: all(_dropped(why) == before[why] + 1 for why in reasons), 10, "both drops to be counted")
    assert int(r.hgetall(contract.stats(("mlp", "1")))[b"inference_count"]) == 1  # the cancelled one did not run


def test_right_after_redis_was_away_a_gateway_without_a_heartbeat_is_still_answered(mesh_factory):
    """A heartbeat that expired while Redis was away (an outage, a failover) does not say the
    gateway died: for a while after, the executor runs its requests rather than skip them."""
    m = mesh_factory(models=["mlp"])
    r = redis.Redis.from_url(m.redis_url)

    async def redis_was_away() -> None:
        for app in m.executors:
            app.executor.heartbeats.redis_trouble()

    m.call(redis_was_away())
    gateway_id = "gw-not-beaten-yet"
    with r.pipeline(transaction=True) as pipe:
        rid = _enqueue(pipe, gateway_id, now_us() + 30_000_000, _mlp_request(np.ones((1, 32))))
        pipe.delete(contract.gateway(gateway_id))
        pipe.execute()
    assert _replies(r, gateway_id, 1)[rid].code == 0


def test_right_after_redis_was_away_an_executor_without_a_heartbeat_keeps_its_batches(mesh_factory):
    """An executor's heartbeat that expired while Redis was away does not say it died: for a while
    after, the scheduler leaves its batches to it (handing them back would run them twice)."""
    m, r, s, _ = _leader_of_mlp(mesh_factory)
    other = ("other", "1")
    # An executor of its own for "other" that takes a batch and never runs it.
    ghost = pb.ExecutorInfo(executor_id="ghost-x", address="127.0.0.1:1",
                            models=[pb.ModelInfo(name="other", version="1", max_batch_size=8)])
    r.set(contract.executor("ghost-x"), ghost.SerializeToString(), px=120_000)
    r.sadd(contract.EXECUTORS, "ghost-x")

    def refresh_registry() -> None:
        refreshed = s.fleet.read_at
        m.loop.call_soon_threadsafe(s.fleet.read_again)
        m.loop.call_soon_threadsafe(s.wakeups.wake)
        poll(lambda: s.fleet.read_at > refreshed, 15, "the leader to read the registry again")

    refresh_registry()
    _enqueue(r, "gw-ghost", now_us() + 60_000_000, _mlp_request(np.ones((1, 32))), model="other")
    poll(lambda: r.scard(contract.inflight(other, "ghost-x")) == 1, 15, "the batch to go to ghost-x")

    # Redis was away, and the heartbeat expired meanwhile.
    m.loop.call_soon_threadsafe(s.fleet.heartbeats.redis_trouble)
    r.delete(contract.executor("ghost-x"))
    refresh_registry()
    assert s.registry.stale == ["ghost-x"]
    assert r.scard(contract.inflight(other, "ghost-x")) == 1 and r.zcard(contract.queue(other)) == 0
    assert r.sismember(contract.EXECUTORS, "ghost-x")

    # Once the grace is over, a missing heartbeat is a death: the batch goes back to its queue.
    m.loop.call_soon_threadsafe(setattr, s.fleet.heartbeats, "trouble_at", float("-inf"))
    refresh_registry()
    assert r.zcard(contract.queue(other)) == 1
    refresh_registry()  # forgotten once a recovery finds nothing left of it
    assert not r.sismember(contract.EXECUTORS, "ghost-x")


def test_the_leader_leaves_the_arrivals_of_a_queue_waiting_for_a_busy_executor_alone(mesh_factory):
    # Long timers: only events make steps.
    m = mesh_factory(models=["mlp"], registry_refresh_s=30.0, lease_ttl_s=90.0)
    r = redis.Redis.from_url(m.redis_url)
    s = m.scheduler.scheduler
    mlp, other = contract.notify(("mlp", "1")), contract.notify(("other", "1"))
    # A second model on an idle executor of its own: its queue is not blocked, so the leader
    # keeps listening to arrivals while mlp's queue waits.
    idle = pb.ExecutorInfo(executor_id="idle-x", address="127.0.0.1:1",
                           models=[pb.ModelInfo(name="other", version="1", max_batch_size=8)])
    r.set(contract.executor("idle-x"), idle.SerializeToString(), px=120_000)
    r.sadd(contract.EXECUTORS, "idle-x")
    m.loop.call_soon_threadsafe(s.fleet.read_again)
    m.loop.call_soon_threadsafe(s.wakeups.wake)
    poll(lambda: s.leader and ("other", "1") in s.registry.models and ("mlp", "1") in s.registry.models,
           15, "the leader to see both models")
    poll(lambda: {mlp, other} <= s.wakeups.listening, 15, "the leader to listen to both queues' arrivals")

    # mlp's executor holds as many batches as it may: its queue waits for a report.
    eid = s.registry.holders[("mlp", "1")][0]
    held = [f"held{i}" for i in range(s.settings.max_batches_per_executor)]
    r.sadd(contract.inflight(("mlp", "1"), eid), *held)
    report = pb.ExecutionReport(executor_id="idle-x", model_name="other", model_version="1", rows=1,
                                compute_infer_ns=1_000_000).SerializeToString()
    r.rpush(contract.REPORTS, report)  # a step, which finds it so
    poll(lambda: contract.queue(("mlp", "1")) in s.wakeups.blocked, 15, "mlp's queue to wait for its executor")
    r.rpush(mlp, 1)  # the wait begun before that verdict may take this one, and then leave the list
    poll(lambda: mlp not in s.wakeups.listening and other in s.wakeups.listening, 15,
         "the wait to leave mlp's arrivals alone")

    waiting = s.wakeups.listening
    rid = _enqueue(r, "gw-blocked", now_us() + 30_000_000, _mlp_request(np.ones((1, 32))))
    # End that wait through the scheduler's own wake list, which it lists after every queue's: a
    # wait that listened to mlp's arrivals would take the arrival's token first.
    r.rpush(contract.scheduler_wake(s.scheduler_id), 1)
    poll(lambda: s.wakeups.listening is not waiting, 15, "the next wait to begin")
    assert r.llen(mlp) == 1, "the leader woke for an arrival that cannot be dispatched before a report"
    assert r.zcard(contract.queue(("mlp", "1"))) == 1

    # The report that frees the executor brings the step that dispatches it and drops the token.
    r.srem(contract.inflight(("mlp", "1"), eid), *held)
    r.rpush(contract.REPORTS, report)
    replies = _replies(r, "gw-blocked", 1)
    assert replies[rid].code == 0
    assert r.llen(mlp) == 0
    r.delete(contract.executor("idle-x"))


def test_after_a_redis_outage_the_leader_looks_at_a_queue_that_waited_for_a_lost_report(mesh_factory):
    m, r, s, eid = _leader_of_mlp(mesh_factory)
    held = _fill_executor(r, s, eid)

    # The executor finished, but its report went with the outage: the arrival is left waiting.
    r.srem(contract.inflight(("mlp", "1"), eid), *held)
    rid = _enqueue(r, "gw-outage", now_us() + 30_000_000, _mlp_request(np.ones((1, 32))))
    waiting = s.wakeups.listening
    r.rpush(contract.scheduler_wake(s.scheduler_id), 1)
    poll(lambda: s.wakeups.listening is not waiting, 15, "the next wait to begin")
    assert r.zcard(contract.queue(("mlp", "1"))) == 1

    # Redis answers again: the leader looks at every queue at once.
    m.loop.call_soon_threadsafe(s.wakeups.after_outage)
    assert _replies(r, "gw-outage", 1)[rid].code == 0


def test_batches_handed_back_by_the_executor_a_queue_waits_for_are_dispatched_at_once(mesh_factory):
    # Long timers: without the hand-back's event, the next step would come in 30 s.
    m, r, s, eid = _leader_of_mlp(mesh_factory)
    # The executor holds as many batches as it may (one of them with a live request); mlp's queue waits.
    gateway_id, request_id = "gw-handback", uuid.uuid4().hex
    deadline = now_us() + 30_000_000
    entry = pb.QueueEntry(request_id=request_id, gateway_id=gateway_id, model_version="1", rows=1,
                          deadline_us=deadline, enqueued_us=now_us(), priority=1)
    r.set(contract.gateway(gateway_id), "by-hand", px=60_000)
    r.set(contract.payload(("mlp", "1"), request_id), _mlp_request(np.ones((1, 32))).SerializeToString(), px=60_000)
    batch = pb.Batch(batch_id="held0", model_name="mlp", model_version="1", members=[entry], executor_id=eid,
                     dispatched_us=now_us(), attempt=1)
    r.set(contract.batch(("mlp", "1"), batch.batch_id), batch.SerializeToString(), px=60_000)
    r.sadd(contract.served(eid), contract.model_tag(("mlp", "1")))
    assert batch.batch_id in _fill_executor(r, s, eid)

    # A restarted executor hands back what it held: the request goes back to the queue.
    requeued = m.call(s.store.requeue_held_batches(eid, include_queued=False))
    assert requeued[("mlp", "1")] == 1
    assert _replies(r, gateway_id, 1)[request_id].code == 0


def test_an_arrival_noticed_while_a_step_is_under_way_gets_a_step_of_its_own(mesh_factory):
    # Long timers: an arrival whose notice was lost would wait 30 s for the next timed step.
    m = mesh_factory(models=["mlp"], registry_refresh_s=30.0, lease_ttl_s=90.0)
    r = redis.Redis.from_url(m.redis_url)
    s = m.scheduler.scheduler
    gateway_id, queue = "gw-race", contract.queue(("mlp", "1"))
    m.loop.call_soon_threadsafe(s.wakeups.wake)  # the first step, which takes the lease, without waiting 30 s
    deadline = time.monotonic() + 10
    while not s.leader:
        assert time.monotonic() < deadline, "the scheduler never took the lease"
        time.sleep(0.02)
    eid = s.registry.holders[("mlp", "1")][0]
    ran_before = s.timeline.ran_until.get(eid, 0.0)
    warm = _enqueue(r, gateway_id, now_us() + 30_000_000, _mlp_request(np.zeros((1, 32))))
    assert _replies(r, gateway_id, 1)[warm].code == 0  # the executor is idle again
    # ... and the scheduler knows it: a step took the batch's report and found the queue not waiting
    # for the executor, and the wait under way listens to the queue's notices. (The reply and the
    # report land together: the report the test sends below must not be the second to end a wait.)
    notify = contract.notify(("mlp", "1"))
    while not (s.timeline.ran_until.get(eid, 0.0) > ran_before and queue not in s.wakeups.blocked
               and notify in s.wakeups.listening):
        assert time.monotonic() < deadline + 10, "the scheduler never took the batch's report"
        time.sleep(0.01)
    real_load_profiles, arrived, missed = s.profiles.adopt, [], []

    async def arrival_after_the_scan(keys):
        # Called by the step once it has read the queues (still empty), before it decides on them.
        if not arrived:
            # The race, made certain: the step before counted the queue as waiting for a busy
            # executor; the next request arrives now, and the listener takes its notice while
            # this step, which will find the executor free, is still under way. The listener's
            # next wait must include the queue's notices first: the report that began this step
            # also ended its last one.
            for _ in range(500):
                if s.wakeups.listening is not before and contract.notify(("mlp", "1")) in s.wakeups.listening:
                    break
                await asyncio.sleep(0.01)
            s.wakeups.blocked.add(queue)
            arrived.append(_enqueue(r, gateway_id, now_us() + 30_000_000, _mlp_request(np.ones((1, 32)))))
            for _ in range(500):
                if not await s.store.client.llen(contract.notify(("mlp", "1"))):
                    break
                await asyncio.sleep(0.01)
            else:
                missed.append("the listener never took the arrival's notice: the race did not happen")
        return await real_load_profiles(keys)

    s.profiles.adopt = arrival_after_the_scan
    before = s.wakeups.listening  # the wait under way, which the report below ends
    r.rpush(contract.REPORTS, pb.ExecutionReport(executor_id="x", model_name="other", model_version="1", rows=1,
                                                 compute_infer_ns=1_000_000).SerializeToString())  # a step
    replies = _replies(r, gateway_id, 1)
    assert not missed, missed
    assert arrived and replies.get(arrived[0]) is not None and replies[arrived[0]].code == 0


def test_queue_depth_by_level_counts_what_the_scan_did_not_reach():
    # The scan reads the queue's head (priority-major order) up to its limit; the gauges must
    # still add up to the whole depth, and the unread tail starts at the last level read.
    assert pending_by_level([1, 1, 2], 3) == {1: 2, 2: 1}
    assert pending_by_level([1, 1, 2], 10) == {1: 2, 2: 8}
    assert pending_by_level([], 0) == {}
