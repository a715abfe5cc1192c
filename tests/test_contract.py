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
        members = _queued(r, contract.queue("mlp", "1"))
        assert len(members) == 1
        entry = pb.QueueEntry.FromString(members[0])
        assert entry.rows == 3 and entry.priority == 2 and entry.model_version == "1"
        assert abs(entry.deadline_us / 1e6 - (sent + 1.5)) < 0.5
        # Same trace as the client's, a span of its own.
        assert tracecontext.trace_id(entry.traceparent) == tracecontext.trace_id(CLIENT_TRACE)
        assert entry.traceparent != CLIENT_TRACE and entry.tracestate == "k=v"
        payload_key = contract.payload(entry.request_id)
        payload = ipb.ModelInferRequest.FromString(r.get(payload_key))
        assert payload.id == "traced" and payload.inputs[0].name == "features"
        assert 0 < r.pttl(payload_key) <= 1_500 + contract.PAYLOAD_GRACE_MS
        assert r.ttl(contract.queue("mlp", "1")) > 0
        # The budget runs out; the answer says so and the request leaves Redis.
        err = answers.get(timeout=10)
        assert err is not None and err.status() == "StatusCode.DEADLINE_EXCEEDED", err
        deadline = time.monotonic() + 5
        while (r.exists(payload_key) or r.zcard(contract.queue("mlp", "1"))) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not r.exists(payload_key) and r.zcard(contract.queue("mlp", "1")) == 0
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
        entry = pb.QueueEntry.FromString(_queued(r, contract.queue("mlp", "1"))[0])
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
    bounded, open_ = "bl:queue:t-bounded:1", "bl:queue:t-open:1"
    notify = {bounded: contract.notify("t-bounded", "1"), open_: contract.notify("t-open", "1")}
    r.zadd(bounded, {b"gone": 1})
    r.set("bl:payload:gone", b"x")
    r.rpush(notify[open_], 1)  # a token the scheduler has not read yet
    writes = [("a", bounded, b"ma", 2), ("b", bounded, b"mb", 2), ("c", open_, b"mc", 0), ("d", open_, b"md", 0)]
    keys = ["bl:gateway:t-gw"]
    args = [len(writes), 1, "127.0.0.1:1", 30_000, contract.QUEUE_TTL]
    for rid, q, member, cap in writes:
        keys += [f"bl:payload:{rid}", q, notify[q]]
        args += [b"payload-" + rid.encode(), 60_000, 5, member, cap]
    keys += [bounded, "bl:payload:gone"]
    args.append(b"gone")
    # "gone" holds one of the bounded queue's two places: "a" takes the other and "b" is refused
    # (abandoned requests are cleared after the writes of the same commit).
    assert r.eval(contract.ENQUEUE_LUA, len(keys), *keys, *args) == [1, 0, 1, 1]
    assert r.zrange(bounded, 0, -1) == [b"ma"]
    assert sorted(r.zrange(open_, 0, -1)) == [b"mc", b"md"]
    assert r.get("bl:payload:a") == b"payload-a" and 0 < r.pttl("bl:payload:a") <= 60_000
    assert r.get("bl:payload:b") is None and r.get("bl:payload:gone") is None
    # One token per queue, however many writes: the scheduler takes a list's tokens all at once.
    assert r.llen(notify[bounded]) == 1 and r.llen(notify[open_]) == 1
    assert 0 < r.ttl(notify[bounded]) <= contract.QUEUE_TTL
    assert 0 < r.ttl(bounded) <= contract.QUEUE_TTL and 0 < r.ttl(open_) <= contract.QUEUE_TTL
    assert r.get("bl:gateway:t-gw") == b"127.0.0.1:1" and 0 < r.pttl("bl:gateway:t-gw") <= 30_000
    # Only abandoned requests: nothing announced, no heartbeat written.
    r.delete(*notify.values(), "bl:gateway:t-gw")
    assert r.eval(contract.ENQUEUE_LUA, 3, "bl:gateway:t-gw", open_, "bl:payload:c",
                  0, 1, "127.0.0.1:1", 30_000, contract.QUEUE_TTL, b"mc") == []
    assert r.zrange(open_, 0, -1) == [b"md"] and r.get("bl:payload:c") is None
    assert not r.exists(*notify.values()) and not r.exists("bl:gateway:t-gw")


def test_batch_done_script_writes_a_batch_of_thousands():
    """An executor's one-command write for a finished batch (BATCH_DONE_LUA), on a real Redis, with
    more replies and payload keys than Lua's unpack() takes: every reply lands, every payload and
    the batch key go, the report is queued and the statistics counted."""
    n = 9_000
    with EmbeddedRedis() as server:
        r = redis.Redis.from_url(server.url)
        try:
            payloads = [f"bl:payload:p{i}" for i in range(n)]
            r.mset({k: b"x" for k in payloads} | {"bl:batch:b1": b"batch"})
            r.sadd("bl:inflight:e1", "b1")
            keys = [contract.REPORTS, "bl:inflight:e1", "bl:stats:m:1", "bl:batch:b1", "bl:reply:g1", *payloads]
            replies = [f"r{i}".encode() for i in range(n)]
            args = [1, n, "b1", b"report", contract.REPORTS_CAP, contract.QUEUE_TTL, contract.REPLY_TTL,
                    contract.STATS_TTL, 1234, n, *replies, "success_count", n, "execution_count", 1]
            r.eval(contract.BATCH_DONE_LUA, len(keys), *keys, *args)
            assert r.lrange("bl:reply:g1", 0, -1) == replies
            assert 0 < r.ttl("bl:reply:g1") <= contract.REPLY_TTL
            assert r.exists(*payloads, "bl:batch:b1") == 0
            assert r.smembers("bl:inflight:e1") == set()
            assert r.lrange(contract.REPORTS, 0, -1) == [b"report"]
            assert r.hgetall("bl:stats:m:1") == {b"success_count": str(n).encode(), b"execution_count": b"1",
                                                 b"last_inference_ms": b"1234"}
            assert 0 < r.ttl("bl:stats:m:1") <= contract.STATS_TTL
        finally:
            r.close()


def test_an_idle_queue_outlives_the_longest_budget_its_entries_can_have():
    # Only arrivals refresh a queue's expiry: one whose executors are down keeps its entries only
    # if it outlives every budget the gateway grants (it caps longer ones at MAX_BUDGET_S).
    from gateway.core import MAX_BUDGET_S

    assert contract.QUEUE_TTL > contract.MAX_BUDGET_S == MAX_BUDGET_S


def test_push_with_ttl_appends_and_sets_the_expiry_in_one_command():
    with EmbeddedRedis() as server:
        r = redis.Redis.from_url(server.url)
        try:
            r.rpush("bl:reply:t", b"old")  # a list that lost its expiry, or never had one
            r.eval(contract.PUSH_WITH_TTL_LUA, 1, "bl:reply:t", contract.REPLY_TTL, b"a", b"b")
            assert r.lrange("bl:reply:t", 0, -1) == [b"old", b"a", b"b"]
            assert 0 < r.ttl("bl:reply:t") <= contract.REPLY_TTL
            # More values than Lua's unpack() takes (a scheduler shedding a backlog at once).
            many = [f"r{i}".encode() for i in range(9_000)]
            r.eval(contract.PUSH_WITH_TTL_LUA, 1, "bl:reply:many", contract.REPLY_TTL, *many)
            assert r.lrange("bl:reply:many", 0, -1) == many
            assert 0 < r.ttl("bl:reply:many") <= contract.REPLY_TTL
        finally:
            r.close()


def test_count_with_ttl_adds_and_sets_the_expiry_in_one_command():
    with EmbeddedRedis() as server:
        r = redis.Redis.from_url(server.url)
        try:
            r.hset("bl:stats:m:1", "fail_count", 2)  # a hash that lost its expiry, or never had one
            r.eval(contract.COUNT_WITH_TTL_LUA, 1, "bl:stats:m:1", contract.STATS_TTL, "fail_count", 3)
            assert r.hget("bl:stats:m:1", "fail_count") == b"5"
            assert 0 < r.ttl("bl:stats:m:1") <= contract.STATS_TTL
        finally:
            r.close()
