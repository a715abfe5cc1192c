"""What the gateway writes to Redis: queue entries with trace context, payloads with expiry."""
from __future__ import annotations

import queue
import time

import numpy as np
import redis
import tritonclient.grpc as tc

from batchline import contract, tracecontext
from batchline.embedded_redis import EmbeddedRedis
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import internal_pb2 as pb

CLIENT_TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _queued(r: redis.Redis, key: str, timeout: float = 10) -> list[bytes]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        members = r.zrange(key, 0, -1)
        if members:
            return members
        time.sleep(0.01)
    raise AssertionError(f"nothing was queued under {key}")


def test_queue_entry_carries_trace_context_deadline_and_expiring_payload(mesh_factory):
    # A scheduler that may give no executor any batch: requests stay queued for inspection.
    m = mesh_factory(models=["mlp"], max_batches_per_executor=0)
    r = redis.Redis.from_url(m.redis_url)
    client = tc.InferenceServerClient(m.address)
    answers: queue.Queue = queue.Queue()
    x = np.zeros((3, 32), dtype=np.float32)
    inp = tc.InferInput("features", [3, 32], "FP32")
    inp.set_data_from_numpy(x)
    sent = time.time()
    client.async_infer("mlp", [inp], callback=lambda result, error: answers.put(error), request_id="traced",
                       timeout=1_500_000, priority=2, headers={"traceparent": CLIENT_TRACE, "tracestate": "k=v"})
    try:
        members = _queued(r, contract.queue(("mlp", "1")))
        assert len(members) == 1
        entry = pb.QueueEntry.FromString(members[0])
        assert entry.rows == 3 and entry.priority == 2 and entry.model_version == "1"
        assert abs(entry.deadline_us / 1e6 - (sent + 1.5)) < 0.5
        # Same trace as the client's, a span of its own.
        assert tracecontext.trace_id(entry.traceparent) == tracecontext.trace_id(CLIENT_TRACE)
        assert entry.traceparent != CLIENT_TRACE and entry.tracestate == "k=v"
        payload_key = contract.payload(("mlp", "1"), entry.request_id)
        payload = ipb.ModelInferRequest.FromString(r.get(payload_key))
        assert payload.id == "traced" and payload.inputs[0].name == "features"
        assert 0 < r.pttl(payload_key) <= 1_500 + contract.PAYLOAD_GRACE_MS
        assert r.ttl(contract.queue(("mlp", "1"))) > 0
        # The budget runs out; the answer says so and the request leaves Redis.
        err = answers.get(timeout=10)
        assert err is not None and err.status() == "StatusCode.DEADLINE_EXCEEDED", err
        deadline = time.monotonic() + 5
        while (r.exists(payload_key) or r.zcard(contract.queue(("mlp", "1")))) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not r.exists(payload_key) and r.zcard(contract.queue(("mlp", "1"))) == 0
    finally:
        client.close()


def test_request_without_trace_context_gets_a_new_trace(mesh_factory):
    m = mesh_factory(models=["mlp"], max_batches_per_executor=0)
    r = redis.Redis.from_url(m.redis_url)
    client = tc.InferenceServerClient(m.address)
    inp = tc.InferInput("features", [1, 32], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 32), dtype=np.float32))
    done: queue.Queue = queue.Queue()
    client.async_infer("mlp", [inp], callback=lambda result, error: done.put(error), timeout=500_000)
    try:
        entry = pb.QueueEntry.FromString(_queued(r, contract.queue(("mlp", "1")))[0])
        assert tracecontext.parse(entry.traceparent) is not None
        assert entry.tracestate == ""
        done.get(timeout=10)
    finally:
        client.close()


def test_tracecontext_helpers():
    assert tracecontext.parse("garbage") is None
    assert tracecontext.parse("00-" + "0" * 32 + "-00f067aa0ba902b7-01") is None
    child = tracecontext.child(CLIENT_TRACE)
    assert child.endswith("-01") and tracecontext.trace_id(child) == tracecontext.trace_id(CLIENT_TRACE)
    fresh = tracecontext.child(None)
    assert tracecontext.trace_id(fresh) != tracecontext.trace_id(tracecontext.child(None))


def test_group_commit_script_queues_refuses_when_full_and_clears_abandoned():
    """The gateway's one-command group commit (ENQUEUE_LUA), on a real Redis: a bounded queue that
    is full refuses (and stores no payload), every queue written to is announced on its own notify
    list with one token at most and keeps a TTL, the heartbeat key is refreshed, and abandoned
    requests leave nothing behind."""
    with EmbeddedRedis() as server:  # its own: the keys below must not meet a mesh's
        r = redis.Redis.from_url(server.url)
        try:
            _group_commit_checks(r)
        finally:
            r.close()


def _group_commit_checks(r: redis.Redis) -> None:
    bounded, open_ = ("t-bounded", "1"), ("t-open", "1")
    r.zadd(contract.queue(bounded), {b"gone": 1})
    r.set(contract.payload(bounded, "gone"), b"x")
    r.rpush(contract.notify(open_), 1)  # a token the scheduler has not read yet
    writes = [contract.QueueWrite(rid, model, b"payload-" + rid.encode(), 60_000, member, 5, cap)
              for rid, model, member, cap in [("a", bounded, b"ma", 2), ("b", bounded, b"mb", 2),
                                              ("c", open_, b"mc", 0), ("d", open_, b"md", 0)]]
    # "gone" holds one of the bounded queue's two places: "a" takes the other and "b" is refused
    # (abandoned requests are cleared after the writes of the same commit).
    assert contract.enqueue(r, "t-gw", "127.0.0.1:1", 30_000, writes,
                            [contract.Abandoned("gone", bounded, b"gone")]) == [1, 0, 1, 1]
    assert r.zrange(contract.queue(bounded), 0, -1) == [b"ma"]
    assert sorted(r.zrange(contract.queue(open_), 0, -1)) == [b"mc", b"md"]
    assert r.get(contract.payload(bounded, "a")) == b"payload-a"
    assert 0 < r.pttl(contract.payload(bounded, "a")) <= 60_000
    assert r.get(contract.payload(bounded, "b")) is None and r.get(contract.payload(bounded, "gone")) is None
    # One token per queue, however many writes: the scheduler takes a list's tokens all at once.
    notify = [contract.notify(bounded), contract.notify(open_)]
    assert [r.llen(n) for n in notify] == [1, 1]
    assert 0 < r.ttl(notify[0]) <= contract.QUEUE_TTL
    assert all(0 < r.ttl(contract.queue(m)) <= contract.QUEUE_TTL for m in (bounded, open_))
    heartbeat = contract.gateway("t-gw")
    assert r.get(heartbeat) == b"127.0.0.1:1" and 0 < r.pttl(heartbeat) <= 30_000
    # Only abandoned requests: nothing announced, no heartbeat written.
    r.delete(*notify, heartbeat)
    assert contract.enqueue(r, "t-gw", "127.0.0.1:1", 30_000, [], [contract.Abandoned("c", open_, b"mc")]) == []
    assert r.zrange(contract.queue(open_), 0, -1) == [b"md"] and r.get(contract.payload(open_, "c")) is None
    assert not r.exists(*notify) and not r.exists(heartbeat)


def test_batch_done_script_writes_a_batch_of_thousands():
    """An executor's one-command write for a finished batch (BATCH_DONE_LUA), on a real Redis, with
    more replies and payload keys than Lua's unpack() takes: every reply lands, every payload and
    the batch key go, the report is queued and the statistics counted."""
    n = 9_000
    with EmbeddedRedis() as server:
        r = redis.Redis.from_url(server.url)
        try:
            batch = pb.Batch(batch_id="b1", model_name="m", model_version="1", executor_id="e1",
                             members=[pb.QueueEntry(request_id=f"p{i}") for i in range(n)])
            payloads = [contract.payload(("m", "1"), f"p{i}") for i in range(n)]
            r.mset({k: b"x" for k in payloads} | {contract.batch(("m", "1"), "b1"): b"batch"})
            r.sadd(contract.inflight(("m", "1"), "e1"), "b1")
            replies = [f"r{i}".encode() for i in range(n)]
            report = pb.ExecutionReport(executor_id="e1", batch_id="b1")
            stats = ["success_count", n, "execution_count", 1]
            contract.batch_done(r, contract.FinishedBatch(batch, report, {"g1": replies}, stats, 1234))
            assert r.lrange(contract.reply("g1"), 0, -1) == replies
            assert 0 < r.ttl(contract.reply("g1")) <= contract.REPLY_TTL
            assert r.exists(*payloads, contract.batch(("m", "1"), "b1")) == 0
            assert r.smembers(contract.inflight(("m", "1"), "e1")) == set()
            assert r.lrange(contract.REPORTS, 0, -1) == [report.SerializeToString()]
            stats = contract.stats(("m", "1"))
            assert r.hgetall(stats) == {b"success_count": str(n).encode(), b"execution_count": b"1",
                                        b"last_inference_ms": b"1234"}
            assert 0 < r.ttl(stats) <= contract.STATS_TTL
        finally:
            r.close()


def test_an_idle_queue_outlives_the_longest_budget_its_entries_can_have():
    # Only arrivals refresh a queue's expiry: one whose executors are down keeps its entries only
    # if it outlives every budget the gateway grants (it caps longer ones at MAX_BUDGET_S).
    from gateway.request import MAX_BUDGET_S

    assert contract.QUEUE_TTL > contract.MAX_BUDGET_S == MAX_BUDGET_S


def test_push_with_ttl_appends_and_sets_the_expiry_in_one_command():
    with EmbeddedRedis() as server:
        r = redis.Redis.from_url(server.url)
        try:
            replies, many_replies = contract.reply("t"), contract.reply("many")
            r.rpush(replies, b"old")  # a list that lost its expiry, or never had one
            contract.push_with_ttl(r, replies, contract.REPLY_TTL, [b"a", b"b"])
            assert r.lrange(replies, 0, -1) == [b"old", b"a", b"b"]
            assert 0 < r.ttl(replies) <= contract.REPLY_TTL
            # More values than Lua's unpack() takes (a scheduler shedding a backlog at once).
            many = [f"r{i}".encode() for i in range(9_000)]
            contract.push_with_ttl(r, many_replies, contract.REPLY_TTL, many)
            assert r.lrange(many_replies, 0, -1) == many
            assert 0 < r.ttl(many_replies) <= contract.REPLY_TTL
        finally:
            r.close()


def test_count_with_ttl_adds_and_sets_the_expiry_in_one_command():
    with EmbeddedRedis() as server:
        r = redis.Redis.from_url(server.url)
        try:
            stats = contract.stats(("m", "1"))
            r.hset(stats, "fail_count", 2)  # a hash that lost its expiry, or never had one
            contract.count(r, ("m", "1"), "fail_count", 3)
            assert r.hget(stats, "fail_count") == b"5"
            assert 0 < r.ttl(stats) <= contract.STATS_TTL
        finally:
            r.close()


def test_a_token_bucket_holds_its_burst_says_when_the_next_token_comes_and_expires():
    with EmbeddedRedis() as server:
        r = redis.Redis.from_url(server.url)
        try:
            takes = [contract.take_token(r, "t", 1, 3) for _ in range(4)]
            assert [taken for taken, _ in takes] == [1, 1, 1, 0]
            assert 0 < takes[3][1] <= 1000  # one token a second: the next within a second
            assert 0 < r.pttl(contract.rate("t")) <= 4000  # gone once it would be full again
        finally:
            r.close()


def test_a_dispatch_takes_all_its_members_or_none():
    """DISPATCH_LUA on one Redis: a batch one of whose members left the queue (taken by another
    scheduler's batch around a lease change) is not dispatched, so no executor runs that member
    twice; its other members stay queued for the next plan."""
    from batchline.contract import calls

    with EmbeddedRedis() as server:
        r = redis.Redis.from_url(server.url)
        try:
            model = ("t-dispatch", "1")
            r.zadd(contract.queue(model), {b"x": 1, b"z": 2})
            first = pb.Batch(batch_id="b1", model_name="t-dispatch", model_version="1", executor_id="e1")
            assert calls.dispatch(r, first, [b"x"], 60_000) == 1
            second = pb.Batch(batch_id="b2", model_name="t-dispatch", model_version="1", executor_id="e2")
            assert calls.dispatch(r, second, [b"x", b"z"], 60_000) == 0
            assert r.zrange(contract.queue(model), 0, -1) == [b"z"]
            assert r.get(contract.batch(model, "b2")) is None and r.llen(contract.work("e2")) == 0
            assert r.llen(contract.work("e1")) == 1
        finally:
            r.close()


def test_a_batch_handed_back_twice_is_requeued_once_and_never_after_its_redispatch():
    """Recovery for an executor the scheduler thinks dead and that executor's own hand-back race
    on one batch: its member goes back once; a hand-back arriving after the member was dispatched
    again leaves it out of the queue (else it would run twice), and an answered batch is not
    requeued at all."""
    import asyncio

    import redis.asyncio as aioredis

    from batchline.contract import calls
    from batchline.contract.recovery import RecoveryStore

    model = ("t-handback", "1")
    entry = pb.QueueEntry(request_id="r1", gateway_id="g", model_version="1", rows=1,
                          deadline_us=2**50, priority=1)
    member = entry.SerializeToString()
    batch = pb.Batch(batch_id="b1", model_name=model[0], model_version="1", executor_id="e1",
                     members=[entry])

    async def run(url: str) -> None:
        client = aioredis.Redis.from_url(url)
        store = RecoveryStore(client)
        r = redis.Redis.from_url(url)
        try:
            r.set(contract.payload(model, "r1"), b"tensors", px=60_000)
            r.zadd(contract.queue(model), {member: 1})
            assert calls.dispatch(r, batch, [member], 60_000) == 1
            # The scheduler's recovery takes the batch back...
            assert (await store.requeue_held_batches("e1", include_queued=True))[model] == 1
            assert r.zrange(contract.queue(model), 0, -1) == [member]
            # ... and dispatches its member again, to another executor.
            again = pb.Batch(batch_id="b2", model_name=model[0], model_version="1", executor_id="e2",
                             members=[entry])
            assert calls.dispatch(r, again, [member], 60_000) == 1
            # The first executor's own hand-back of the old batch, late: nothing goes back.
            assert await store.hand_back("e1", batch) == 0
            assert r.zcard(contract.queue(model)) == 0
            # The second executor answers (the batch leaves its in-flight set); a hand-back then
            # finds it gone too.
            r.srem(contract.inflight(model, "e2"), "b2")
            assert await store.hand_back("e2", again) == 0
            assert r.zcard(contract.queue(model)) == 0
        finally:
            r.close()
            await client.aclose()

    with EmbeddedRedis() as server:
        asyncio.run(run(server.url))


def _one_dispatched_and_one_to_land_during_the_next_recovery(r: redis.Redis, model, monkeypatch) -> None:
    """Executor e1 holds batch b1 (request r1); batch b2 (r2) is dispatched to it between the next
    recovery's read of what e1 holds and its write, once, as a scheduler that has not seen e1 go would."""
    from batchline.contract import calls, recovery

    entries = [pb.QueueEntry(request_id=f"r{i}", gateway_id="g", model_version="1", rows=1, deadline_us=2**50,
                             priority=1) for i in (1, 2)]
    batches = [pb.Batch(batch_id=f"b{i}", model_name=model[0], model_version="1", executor_id="e1",
                        members=[e]) for i, e in zip((1, 2), entries)]
    real, late = recovery.get_many, [entries[1]]

    def late_dispatch_then_read(client, names):
        if late:
            member = late.pop().SerializeToString()
            r.zadd(contract.queue(model), {member: 1})
            assert calls.dispatch(r, batches[1], [member], 60_000) == 1
        return real(client, names)

    for e in entries:
        r.set(contract.payload(model, e.request_id), b"tensors", px=60_000)
    r.zadd(contract.queue(model), {entries[0].SerializeToString(): 1})
    assert calls.dispatch(r, batches[0], [entries[0].SerializeToString()], 60_000) == 1
    monkeypatch.setattr(recovery, "get_many", late_dispatch_then_read)


def test_a_recovery_leaves_a_batch_dispatched_after_its_read(monkeypatch):
    """The scheduler may dispatch to an executor being recovered (it has not seen it go yet): a
    batch that lands between recovery's read and its write stays in the work list and in-flight
    set, for the next recovery, instead of being deleted with what was read."""
    import asyncio

    import redis.asyncio as aioredis

    from batchline.contract.recovery import RecoveryStore

    model = ("t-late", "1")

    async def run(url: str) -> None:
        client = aioredis.Redis.from_url(url)
        r = redis.Redis.from_url(url)
        try:
            _one_dispatched_and_one_to_land_during_the_next_recovery(r, model, monkeypatch)
            assert (await RecoveryStore(client).requeue_held_batches("e1", include_queued=True))[model] == 1
            assert [pb.Batch.FromString(b).batch_id for b in r.lrange(contract.work("e1"), 0, -1)] == ["b2"]
            assert r.smembers(contract.inflight(model, "e1")) == {b"b2"}
        finally:
            r.close()
            await client.aclose()

    with EmbeddedRedis() as server:
        asyncio.run(run(server.url))


def test_arrival_counts_are_written_with_their_expiry_in_one_command():
    import asyncio

    import redis.asyncio as aioredis

    from batchline.contract.gateway_store import GatewayStore

    async def run(url: str) -> None:
        client = aioredis.Redis.from_url(url)
        try:
            store = GatewayStore(client)
            await store.add_arrivals({("t-arrivals", "1"): 3})
            await store.add_arrivals({("t-arrivals", "1"): 2})
            key = contract.arrivals(("t-arrivals", "1"))
            assert int(await client.get(key)) == 5
            assert 0 < await client.ttl(key) <= contract.ARRIVALS_TTL
        finally:
            await client.aclose()

    with EmbeddedRedis() as server:
        asyncio.run(run(server.url))


def test_arrival_counts_a_paused_redis_did_not_take_are_added_once_at_the_next_flush():
    """A flush that times out while Redis is paused: the client gives its connection up, and Redis
    drops the command it held, so the next flush adds the counts, once."""
    import asyncio

    from batchline.contract.gateway_store import GatewayStore
    from batchline.redis_client import connect
    from gateway.arrivals import Arrivals

    model = ("t-late", "1")

    async def run(url: str, sync: redis.Redis) -> int:
        client = connect(url, 0.3)
        try:
            arrivals = Arrivals(GatewayStore(client))
            for _ in range(5):
                arrivals.count(model)
            sync.execute_command("CLIENT", "PAUSE", 10_000, "WRITE")
            await arrivals.flush()  # times out
            sync.execute_command("CLIENT", "UNPAUSE")
            arrivals.count(model)
            await arrivals.flush()
            return int(sync.get(contract.arrivals(model)))
        finally:
            await client.aclose()

    with EmbeddedRedis() as server:
        assert asyncio.run(run(server.url, redis.Redis.from_url(server.url))) == 6


def test_a_removal_redis_failed_goes_again_with_the_next_commit():
    """A given-up request's removal that Redis failed (paused past the client's timeout here) is
    tried again until it lands: left queued, the request would run (a generation to its end) for
    nobody."""
    import asyncio

    from batchline.contract.gateway_store import GatewayStore
    from batchline.redis_client import connect
    from gateway.commit import GroupCommit

    model = ("t-removal", "1")

    async def run(url: str, sync: redis.Redis) -> tuple:
        client = connect(url, 0.3)
        try:
            commit = GroupCommit(GatewayStore(client), "gw", 30_000, 0.0, lambda: 0)
            await commit.write(contract.QueueWrite("r1", model, b"p", 60_000, b"r1", 5, 0), 2**62, 1.0)
            sync.execute_command("CLIENT", "PAUSE", 1000, "WRITE")
            landed = await asyncio.wait_for(commit.abandon("r1", model, b"r1"), 10)
            return landed, sync.zcard(contract.queue(model)), sync.exists(contract.payload(model, "r1"))
        finally:
            await client.aclose()

    with EmbeddedRedis() as server:
        assert asyncio.run(run(server.url, redis.Redis.from_url(server.url))) == (True, 0, 0)


def test_repository_calls_land_in_their_numbers_order_whatever_order_their_writes_arrive():
    """A load and an unload of one model racing: the load took number 5, the unload 6, and the
    unload's record was written first. The load's, arriving late, must not replace it (executors
    that applied 6 would skip 5, the others load: a split mesh)."""
    from batchline.contract import calls

    with EmbeddedRedis() as server:
        r = redis.Redis.from_url(server.url)
        try:
            load, unload = int(calls.next_call(r)), int(calls.next_call(r))
            assert unload == load + 1 and 0 < r.ttl(contract.CONTROL_SEQ) <= contract.CONTROL_TTL
            assert calls.record_call(r, "m", "unload", unload) == 1
            assert calls.record_call(r, "m", "load", load) == 0
            assert contract.parse_control(r.hget(contract.CONTROL, "m")) == ("unload", unload)
            assert 0 < r.ttl(contract.CONTROL) <= contract.CONTROL_TTL
        finally:
            r.close()


def test_a_shed_takes_only_what_is_still_queued():
    """A scheduler paused past its lease sheds a request the new leader dispatched meanwhile: that
    one keeps its payload (its executor runs it) and gets no answer from the shed; one still queued
    is taken out, its payload dropped and its answer sent."""
    from batchline.contract import calls

    model = ("t-shed", "1")
    queued = pb.QueueEntry(request_id="q", gateway_id="g1", model_version="1", rows=1, deadline_us=1, priority=1)
    taken = pb.QueueEntry(request_id="t", gateway_id="g2", model_version="1", rows=1, deadline_us=1, priority=1)
    with EmbeddedRedis() as server:
        r = redis.Redis.from_url(server.url)
        try:
            r.zadd(contract.queue(model), {queued.SerializeToString(): 1})  # `taken` left it: dispatched
            for e in (queued, taken):
                r.set(contract.payload(model, e.request_id), b"tensors", px=60_000)
            replies = {g: [pb.Reply(request_id=rid, code=4, message="shed")] for g, rid in (("g1", "q"), ("g2", "t"))}
            pipe = r.pipeline(transaction=False)
            calls.shed(pipe, model, [queued.SerializeToString(), taken.SerializeToString()], ["q", "t"], replies)
            assert pipe.execute() == [1]
            assert r.zcard(contract.queue(model)) == 0 and not r.exists(contract.payload(model, "q"))
            assert r.exists(contract.payload(model, "t"))  # the run elsewhere still reads it
            assert [pb.Reply.FromString(b).request_id for b in r.lrange(contract.reply("g1"), 0, -1)] == ["q"]
            assert r.llen(contract.reply("g2")) == 0
            assert r.hget(contract.stats(model), "fail_count") == b"1" and r.ttl(contract.reply("g1")) > 0
        finally:
            r.close()


def test_a_dead_executor_is_forgotten_only_once_a_recovery_finds_nothing_left(monkeypatch):
    """A batch dispatched to it while its recovery ran (by a scheduler that had not seen it go) is
    recovered at the next refresh, not stranded with an executor nobody looks at any more."""
    import asyncio

    import redis.asyncio as aioredis

    from batchline.contract.scheduler_store import SchedulerStore
    from scheduler.fleet import Fleet

    async def run(url: str) -> list:
        client = aioredis.Redis.from_url(url)
        r = redis.Redis.from_url(url)
        try:
            r.sadd(contract.EXECUTORS, "e1")
            _one_dispatched_and_one_to_land_during_the_next_recovery(r, ("t-forget", "1"), monkeypatch)
            fleet = Fleet(SchedulerStore(client), 0.5)
            steps = []
            for _ in range(3):
                steps.append((await fleet._recover("e1", []), r.sismember(contract.EXECUTORS, "e1")))
            return steps
        finally:
            r.close()
            await client.aclose()

    with EmbeddedRedis() as server:
        # b1 requeued (b2 landed meanwhile: kept), then b2, then nothing: only then forgotten.
        assert asyncio.run(run(server.url)) == [(1, True), (1, True), (0, False)]


def test_scripts_without_an_answer_of_their_own_answer_something():
    """redis-py's cluster pipeline, after a connection error on any node, sends again each command
    whose result is empty: a hand-over, push, count or report that answered nil would run twice
    (a batch run twice, a count doubled). Each answers a value."""
    from batchline.contract import scripts

    with EmbeddedRedis() as server:
        r = redis.Redis.from_url(server.url)
        try:
            runs = [
                (scripts.HAND_OVER_LUA, ["t-w", "t-served"], [b"batch", 60, "tag"]),
                (scripts.REPORT_LUA, ["t-reports"], [b"report", 100, 60]),
                (scripts.ANNOUNCE_LUA, ["t-gateway", "t-notify"], ["127.0.0.1:1", 1000, 60]),
                (scripts.PUSH_WITH_TTL_LUA, ["t-list"], [60, b"a", b"b"]),
                (scripts.COUNT_WITH_TTL_LUA, ["t-hash"], [60, "field", 2]),
                (scripts.INCR_WITH_TTL_LUA, ["t-count"], [60, 3]),
            ]
            for script, keys, args in runs:
                assert r.eval(script, len(keys), *keys, *args), script.strip().splitlines()[-2]
            assert r.llen("t-w") == 1 and r.llen("t-list") == 2 and r.ttl("t-count") > 0
        finally:
            r.close()


def test_a_batch_whose_hand_over_never_landed_is_recovered_by_the_models_served():
    """On a cluster a dispatch's two halves land apart: the model's (in-flight set, batch key) may
    land where the executor's (work list, served set) failed. The executor's served set then does
    not name the model; recovery told the models the executor served finds the batch anyway."""
    import asyncio

    import redis.asyncio as aioredis

    from batchline.contract.recovery import RecoveryStore

    model = ("t-unserved", "1")
    entry = pb.QueueEntry(request_id="r1", gateway_id="g", model_version="1", rows=1, deadline_us=1, priority=1)
    batch = pb.Batch(batch_id="b1", model_name=model[0], model_version=model[1], executor_id="e1",
                     members=[entry])

    async def run(url: str) -> None:
        client = aioredis.Redis.from_url(url)
        r = redis.Redis.from_url(url)
        try:
            r.set(contract.payload(model, "r1"), b"tensors", px=60_000)
            r.set(contract.batch(model, "b1"), batch.SerializeToString(), px=60_000)
            r.sadd(contract.inflight(model, "e1"), "b1")
            store = RecoveryStore(client)
            assert not await store.requeue_held_batches("e1", include_queued=True)  # the served set names nothing
            assert (await store.requeue_held_batches("e1", include_queued=True, models=[model]))[model] == 1
            assert r.zcard(contract.queue(model)) == 1 and not r.exists(contract.inflight(model, "e1"))
        finally:
            r.close()
            await client.aclose()

    with EmbeddedRedis() as server:
        asyncio.run(run(server.url))


def test_lookups_of_names_nobody_serves_share_the_registry_read_under_way(monkeypatch):
    """Each lookup of an unknown name reads the registry again (an executor may have registered
    since): a flood of them at once shares one read, not one each, and still answers NOT_FOUND."""
    import asyncio

    from batchline.contract.gateway_store import GatewayStore
    from batchline.errors import NotFound
    from batchline.redis_client import connect
    from batchline.registry import Registry
    from gateway.catalog import Catalog

    reads = []
    real = Registry.load

    async def counted(store):
        reads.append(1)
        await asyncio.sleep(0.05)  # a read that takes a while, as against a busy Redis
        return await real(store)

    monkeypatch.setattr(Registry, "load", staticmethod(counted))

    async def flood(url: str) -> list:
        client = connect(url, 2)
        try:
            catalog = Catalog(GatewayStore(client))
            return await asyncio.gather(*(catalog.model(f"nope-{i}") for i in range(50)), return_exceptions=True)
        finally:
            await client.aclose()

    with EmbeddedRedis() as server:
        answers = asyncio.run(flood(server.url))
    assert all(isinstance(a, NotFound) for a in answers)
    assert len(reads) == 1


def test_a_lookup_made_after_a_registry_read_began_does_not_take_that_reads_answer(monkeypatch):
    """A read under way since before a lookup may miss an executor that registered since (a model
    just loaded): the lookup waits for it, then shares the next, and finds the model."""
    import asyncio

    from batchline.contract.gateway_store import GatewayStore
    from batchline.errors import NotFound
    from batchline.redis_client import connect
    from batchline.registry import Registry
    from gateway.catalog import Catalog

    real = Registry.load
    read = asyncio.Event()

    async def read_then_linger(store):
        found = await real(store)
        read.set()
        await asyncio.sleep(0.1)  # the answer travels back while the registry changes
        return found

    monkeypatch.setattr(Registry, "load", staticmethod(read_then_linger))
    info = pb.ExecutorInfo(executor_id="e1", heartbeat_us=10**16,
                           models=[pb.ModelInfo(name="fresh", version="1", max_batch_size=1)])

    async def scenario(url: str) -> tuple:
        client = connect(url, 2)
        try:
            catalog = Catalog(GatewayStore(client))
            early = asyncio.ensure_future(catalog.model("fresh"))
            await read.wait()
            read.clear()
            await client.sadd(contract.EXECUTORS, "e1")
            await client.set(contract.executor("e1"), info.SerializeToString(), px=60_000)
            late = await catalog.model("fresh")
            return await asyncio.gather(early, return_exceptions=True), late
        finally:
            await client.aclose()

    with EmbeddedRedis() as server:
        (early,), late = asyncio.run(scenario(server.url))
    assert isinstance(early, NotFound)  # it asked before the executor registered
    assert late.name == "fresh"


def test_a_scheduler_that_never_saw_a_dead_executor_recovers_its_batch_of_a_model_served_now():
    """A new leader never saw the executor that died; its served set lacks the model (on a cluster
    the dispatch's half that writes it failed): the models served now are looked at, and the batch
    in its in-flight set goes back to its queue."""
    import asyncio

    import redis.asyncio as aioredis

    from batchline.clock import now_us
    from batchline.contract.scheduler_store import SchedulerStore
    from scheduler.fleet import Fleet

    model = ("t-new-leader", "1")
    entry = pb.QueueEntry(request_id="r1", gateway_id="g", model_version="1", rows=1, deadline_us=1, priority=1)
    batch = pb.Batch(batch_id="b1", model_name=model[0], model_version=model[1], executor_id="dead",
                     members=[entry])
    alive = pb.ExecutorInfo(executor_id="alive", heartbeat_us=now_us(),
                            models=[pb.ModelInfo(name=model[0], version=model[1], max_batch_size=1)])

    async def run(url: str) -> dict:
        client = aioredis.Redis.from_url(url)
        r = redis.Redis.from_url(url)
        try:
            r.sadd(contract.EXECUTORS, "dead", "alive")  # "dead" has no registration left: stale
            r.set(contract.executor("alive"), alive.SerializeToString(), px=60_000)
            r.set(contract.payload(model, "r1"), b"tensors", px=60_000)
            r.set(contract.batch(model, "b1"), batch.SerializeToString(), px=60_000)
            r.sadd(contract.inflight(model, "dead"), "b1")
            return await Fleet(SchedulerStore(client), 0.5).refresh()
        finally:
            r.close()
            await client.aclose()

    with EmbeddedRedis() as server:
        assert asyncio.run(run(server.url)) == {"dead": 1}
