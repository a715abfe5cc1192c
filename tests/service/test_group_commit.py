"""The gateway's group commit on a real mesh: it waits for company only while requests arrive
close together and many are in flight, and never spends more than a tenth of a waiting request's
budget doing so. The scheduler stands by (its lease held by someone else) while requests arrive, so
that they all stay in flight. And on a real Redis: a burst read in one turn of the event loop goes
in groups as it is read."""
from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import prometheus_client
import redis

from batchline import contract
from batchline.contract.gateway_store import GatewayStore
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import inference_pb2_grpc
from batchline.redis_client import connect
from batchline.testing.polling import poll
from gateway.commit import GroupCommit


def _commits() -> float:
    # The services of the tests' meshes share this process's registry; only differences count.
    return prometheus_client.REGISTRY.get_sample_value(
        "batchline_redis_roundtrip_seconds_count", {"service": "gateway", "op": "enqueue"}) or 0.0


def _request(i: int, timeout_us: int) -> ipb.ModelInferRequest:
    req = ipb.ModelInferRequest(model_name="mlp", id=f"r{i}")
    req.inputs.add(name="features", datatype="FP32", shape=[1, 32])
    req.raw_input_contents.append(np.full((1, 32), i / 100, np.float32).tobytes())
    req.parameters["timeout"].int64_param = timeout_us
    return req


def _paced(stub, n: int, gap_s: float) -> list:
    """n requests with 60 s budgets, one every gap_s; their calls."""
    calls = []
    for i in range(n):
        calls.append(stub.ModelInfer.future(_request(i, 60_000_000), timeout=90))
        time.sleep(gap_s)
    return calls


def _stand_by(m) -> redis.Redis:
    r = redis.Redis.from_url(m.redis_url)
    scheduler = m.scheduler.scheduler
    taken = time.monotonic()
    r.set(contract.LEADER, "someone-else", px=120_000)
    poll(lambda: scheduler.lease.attempted_at > taken and not scheduler.leader, 15, "the scheduler to stand by")
    return r


def _lead(m, r: redis.Redis) -> None:
    r.delete(contract.LEADER)
    poll(lambda: m.scheduler.scheduler.leader, 15, "the scheduler to lead again")


def _commits_for_paced_requests(mesh_factory, linger_ms: float, n: int = 30) -> float:
    m = mesh_factory(models=["mlp"], gateway_overrides={"commit_linger_ms": linger_ms})
    with grpc.insecure_channel(m.address) as channel:
        stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
        stub.ModelInfer(_request(0, 60_000_000), timeout=90)  # warm
        r = _stand_by(m)
        before = _commits()
        calls = _paced(stub, n, 0.01)  # 10 ms apart
        poll(lambda: r.zcard(contract.queue(("mlp", "1"))) == n, 15, "every request to be queued")
        commits = _commits() - before
        _lead(m, r)
        assert [c.result().id for c in calls] == [f"r{i}" for i in range(n)]
    return commits


def test_requests_arriving_within_the_window_share_commits(mesh_factory):
    # A 200 ms window: the first 7 go alone (fewer than 8 in flight), the other 23 about 20 to a commit.
    assert _commits_for_paced_requests(mesh_factory, 200.0) <= 13


def test_without_a_window_requests_apart_are_committed_one_by_one(mesh_factory):
    # The same traffic with no window: each request is alone when its commit goes.
    assert _commits_for_paced_requests(mesh_factory, 0.0) >= 20


def test_a_tight_budget_cuts_a_long_wait_short(mesh_factory):
    m = mesh_factory(models=["mlp"], gateway_overrides={"commit_linger_ms": 20_000.0})
    with grpc.insecure_channel(m.address) as channel:
        stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
        r = _stand_by(m)
        # From the 8th on, the commit waits a tenth of the 60 s budgets: 6 s.
        patient = _paced(stub, 12, 0.01)
        _lead(m, r)
        # A request with a 500 ms budget joins that commit: it must go within 50 ms, or the gateway
        # answers DEADLINE_EXCEEDED when the budget runs out.
        reply = stub.ModelInfer(_request(99, 500_000), timeout=30)
        assert reply.id == "r99"
        assert [c.result().id for c in patient] == [f"r{i}" for i in range(12)]


BURST_MODEL = ("t-burst", "1")
WARM_MODEL = ("t-warm", "1")


def _evalshas(sync: redis.Redis) -> int:
    """The group commits Redis has run (each one EVALSHA, its script loaded)."""
    return sync.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)


def _burst(url: str, max_group: int, n: int = 10, cancel: int | None = None) -> tuple[list[int], int, int]:
    """n writes started in one turn of the event loop; per write, how many of the burst Redis held
    when it was read, then how many group commits went and how many writes Redis holds. `cancel`:
    that write's caller is cancelled once every write is under way."""
    sync = redis.Redis.from_url(url)
    sync.delete(contract.queue(BURST_MODEL))

    async def run() -> list[int]:
        client = connect(url, 2.0)
        store = GatewayStore(client)
        try:
            commit = GroupCommit(store, "gw", 30_000, 0.0, lambda: 0, max_group)
            # The Link's connection open and the script loaded: from now on a group goes at once.
            await commit.write(contract.QueueWrite("w", WARM_MODEL, b"p", 1_000, b"w", 5, 0), 2**62, 1.0)
            evals.append(_evalshas(sync))
            seen: list[int] = []

            async def write(i: int) -> None:
                # A blocking read: the loop stands still, so what Redis holds was sent before this turn.
                if max_group and i and i % max_group == 0:
                    poll(lambda: sync.zcard(contract.queue(BURST_MODEL)) >= i, 5, "the groups before it in Redis")
                seen.append(sync.zcard(contract.queue(BURST_MODEL)))
                rid = f"r{i}"
                await commit.write(contract.QueueWrite(rid, BURST_MODEL, b"p", 60_000, rid.encode(), 5, 0), 2**62, 1.0)

            writes = [asyncio.ensure_future(write(i)) for i in range(n)]
            if cancel is not None:
                await asyncio.sleep(0)  # every write's first step, the groups sent (not a wait for time)
                writes.pop(cancel).cancel()
            await asyncio.wait_for(asyncio.gather(*writes), 10)
            return seen
        finally:
            await store.aclose()

    evals: list[int] = []  # the server's EVALSHA count once the warm-up's commit is in (the server is shared)
    seen = asyncio.run(run())
    commits = _evalshas(sync) - evals[0]
    held = sync.zcard(contract.queue(BURST_MODEL))
    sync.delete(contract.queue(BURST_MODEL), *(contract.payload(BURST_MODEL, f"r{i}") for i in range(n)),
                contract.queue(WARM_MODEL), contract.payload(WARM_MODEL, "w"))
    return seen, commits, held


def test_a_burst_goes_to_redis_in_groups_as_it_is_read(redis_server):
    # Groups of 4: the 5th and the 9th write are read with the groups before them in Redis already.
    seen, commits, held = _burst(redis_server.url, 4)
    assert (seen, commits, held) == ([0, 0, 0, 0, 4, 4, 4, 4, 8, 8], 3, 10)


def test_without_a_cap_a_burst_goes_whole_once_read(redis_server):
    seen, commits, held = _burst(redis_server.url, 0)
    assert (seen, commits, held) == ([0] * 10, 1, 10)


def test_a_group_sent_by_a_caller_that_is_cancelled_still_answers_the_others(redis_server):
    # The 4th write sends the group of 4; its caller is cancelled, the other three are answered.
    seen, commits, held = _burst(redis_server.url, 4, n=4, cancel=3)
    assert (commits, held) == (1, 4)


def test_a_group_sent_at_once_is_timed_from_when_it_went_out(redis_server):
    """Its round trip (batchline_redis_roundtrip_seconds) counts from the send in the writer's turn,
    not from when the task that awaits Redis's answer first runs: here the event loop is held 50 ms
    in between, which the round trip must include."""
    def rtt_sum() -> float:
        return prometheus_client.REGISTRY.get_sample_value(
            "batchline_redis_roundtrip_seconds_sum", {"service": "gateway", "op": "enqueue"}) or 0.0

    async def run() -> float:
        store = GatewayStore(connect(redis_server.url, 2.0))
        try:
            commit = GroupCommit(store, "gw", 30_000, 0.0, lambda: 0, 1)
            await commit.write(contract.QueueWrite("w", WARM_MODEL, b"p", 1_000, b"w", 5, 0), 2**62, 1.0)
            before = rtt_sum()

            async def hold_the_loop() -> None:
                time.sleep(0.05)  # blocks: the landing task runs only after this

            write = commit.write(contract.QueueWrite("r", BURST_MODEL, b"p", 1_000, b"r", 5, 0), 2**62, 1.0)
            await asyncio.gather(write, hold_the_loop())
            return rtt_sum() - before
        finally:
            await store.aclose()

    timed = asyncio.run(run())
    redis.Redis.from_url(redis_server.url).delete(
        contract.queue(BURST_MODEL), contract.payload(BURST_MODEL, "r"), contract.queue(WARM_MODEL),
        contract.payload(WARM_MODEL, "w"))
    assert timed >= 0.05
