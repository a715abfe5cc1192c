"""Redis Cluster: three primaries, real redis-server processes on loopback joined by `redis-cli
--cluster create`. Every script and blocking wait of the mesh names keys of one hash slot
(batchline/contract/keys.py); the models' keys spread over the shards, and the core fault cases
(an executor killed, the scheduler's leader killed) hold on a cluster as on one Redis."""
from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tritonclient.grpc as tc

from batchline import cluster, contract
from batchline.redis_client import mask
from batchline.testing.cluster import ClusterRedis, redis_cli_binary
from batchline.testing.polling import poll
from batchline.testing.verdicts import (assert_all_ok, assert_answers_correct, assert_none_lost, assert_nothing_hung,
                                        between, load_for, report, served_again, soft_poll)

pytestmark = pytest.mark.skipif(redis_cli_binary() is None,
                                reason="redis-cli (Debian: redis-tools) creates the cluster")


@pytest.fixture
def redis_cluster():
    with ClusterRedis() as c:
        yield c


def test_cluster_urls_name_their_nodes_and_options():
    target = cluster.parse("rediss+cluster://u:secret@10.0.0.1:7000,10.0.0.2?ssl_ca_certs=/ca.pem")
    assert target.nodes == [("10.0.0.1", 7000), ("10.0.0.2", 6379)]
    assert target.kwargs["username"] == "u" and target.kwargs["password"] == "secret"
    assert target.kwargs["ssl"] is True and target.kwargs["ssl_ca_certs"] == "/ca.pem"
    assert "secret" not in mask("redis+cluster://u:secret@10.0.0.1:7000,10.0.0.2:7001")
    for bad, why in [("redis+cluster://h:port", "not a number"), ("redis+cluster://h:7000/3", "only database 0"),
                     ("redis+cluster://,h:1", "empty host")]:
        with pytest.raises(ValueError, match=why):
            cluster.parse(bad)
    # A URL's own socket options win over the service's timeout, as on a plain URL (not: "got
    # multiple values for keyword argument"); a blocking reader's read still outlasts its waits.
    client = cluster.connect("redis+cluster://127.0.0.1:7000?socket_timeout=5", 2)
    assert client.connection_kwargs["socket_timeout"] == 5
    blocking = cluster.connect("redis+cluster://127.0.0.1:7000?socket_timeout=0.5", 2, blocking_reads=True)
    assert blocking.connection_kwargs["socket_timeout"] > 2


def test_a_group_commit_over_two_shards_keeps_each_write_s_answer_and_announces_after(redis_cluster):
    """The gateway's group commit split per model (each model's script on its shard, then the
    announcement in the shared slot): every write gets its own answer in its own place, a full
    queue refuses only its write, and each queue written to has one wake-up token."""
    from batchline.redis_client import connect

    bounded, other = ("mlp", "1"), ("minilm", "1")
    assert redis_cluster.shard_of(contract.queue(bounded)) != redis_cluster.shard_of(contract.queue(other))

    async def commit():
        client = connect(redis_cluster.url, 2)
        try:
            writes = [contract.QueueWrite(rid, model, b"p-" + rid.encode(), 60_000, rid.encode(), 5, cap)
                      for rid, model, cap in [("a", bounded, 1), ("b", other, 0), ("c", bounded, 1), ("d", other, 0)]]
            return await contract.enqueue(client, "gw", "127.0.0.1:1", 30_000, writes)
        finally:
            await client.aclose()

    assert asyncio.run(commit()) == [1, 1, 0, 1]  # "c" found its queue full (max_queue_size 1)
    r = redis_cluster.node(redis_cluster.shard_of(contract.queue(other)))
    assert sorted(r.zrange(contract.queue(other), 0, -1)) == [b"b", b"d"]
    assert r.get(contract.payload(other, "d")) == b"p-d"
    shared = redis_cluster.node(redis_cluster.shard_of(contract.REPORTS))
    assert [shared.llen(contract.notify(m)) for m in (bounded, other)] == [1, 1]
    assert shared.get(contract.gateway("gw")) == b"127.0.0.1:1"


def test_a_shard_that_refuses_a_group_commit_fails_only_the_writes_in_its_slots(redis_cluster):
    """One shard refusing its part of a group commit (here a key of another type where the queue
    should be; out of its own memory alike) fails the writes of that model alone: the other
    model's land, are announced, and get their answers."""
    from batchline.redis_client import connect
    from redis.exceptions import ResponseError

    broken, other = ("mlp", "1"), ("minilm", "1")
    assert redis_cluster.shard_of(contract.queue(broken)) != redis_cluster.shard_of(contract.queue(other))
    redis_cluster.node(redis_cluster.shard_of(contract.queue(broken))).set(contract.queue(broken), b"not a queue")

    async def commit():
        client = connect(redis_cluster.url, 2)
        try:
            writes = [contract.QueueWrite(rid, model, b"p-" + rid.encode(), 60_000, rid.encode(), 5, 0)
                      for rid, model in [("a", broken), ("b", other), ("c", broken), ("d", other)]]
            return await contract.enqueue(client, "gw", "127.0.0.1:1", 30_000, writes)
        finally:
            await client.aclose()

    queued = asyncio.run(commit())
    assert isinstance(queued[0], ResponseError) and isinstance(queued[2], ResponseError)
    assert queued[1::2] == [1, 1]
    r = redis_cluster.node(redis_cluster.shard_of(contract.queue(other)))
    assert sorted(r.zrange(contract.queue(other), 0, -1)) == [b"b", b"d"]
    shared = redis_cluster.node(redis_cluster.shard_of(contract.REPORTS))
    assert [shared.llen(contract.notify(m)) for m in (broken, other)] == [0, 1]

    # Through the gateway's group commit: the refused write's caller hears why, its neighbour is queued.
    from batchline.contract.gateway_store import GatewayStore
    from batchline.errors import Internal
    from gateway.commit import GroupCommit

    async def through_the_gateway():
        client = connect(redis_cluster.url, 2)
        try:
            commit = GroupCommit(GatewayStore(client), "gw", 30_000, 0.0, lambda: 0)
            return await asyncio.gather(*(
                commit.write(contract.QueueWrite(rid, model, b"p", 60_000, rid.encode(), 5, 0), 2**62, 1.0)
                for rid, model in [("e", broken), ("f", other)]), return_exceptions=True)
        finally:
            await client.aclose()

    refused, queued_f = asyncio.run(through_the_gateway())
    assert isinstance(refused, Internal) and "WRONGTYPE" in str(refused) and queued_f is None
    assert b"f" in r.zrange(contract.queue(other), 0, -1)


def test_a_shard_that_cannot_be_reached_fails_only_the_writes_in_its_slots():
    """A shard gone (its process killed, before the cluster notices: a long node timeout) fails the
    group commit's writes in its slots only, after the client's retries; the other model's land."""
    from batchline.redis_client import connect

    gone, other = ("minilm", "1"), ("mlp", "1")
    with ClusterRedis(node_timeout_ms=60_000) as c:
        dead = c.shard_of(contract.queue(gone))
        assert dead != c.shard_of(contract.queue(other)) and dead != c.shard_of(contract.REPORTS)
        live = c.node(c.shard_of(contract.queue(other)))

        async def commit():
            client = connect(c.url, 2)
            try:
                await client.ping()  # the cluster's map, read while every node answers
                c.servers[dead].stop(kill=True)
                writes = [contract.QueueWrite(rid, model, b"p", 60_000, rid.encode(), 5, 0)
                          for rid, model in [("a", gone), ("b", other)]]
                return await contract.enqueue(client, "gw", "127.0.0.1:1", 30_000, writes)
            finally:
                await client.aclose()

        lost, queued = asyncio.run(commit())
        assert isinstance(lost, Exception) and queued == 1
        assert live.zrange(contract.queue(other), 0, -1) == [b"b"]


def test_answers_a_failed_over_shard_lost_are_sent_again_from_what_the_executor_kept(redis_cluster):
    """On a cluster a batch's key and its answers live on different shards: the shard of the
    gateway's reply list can fail over and lose the answers while the key is gone for good on its
    own. After a failover on a cluster the executor sends the answers it kept again."""
    from batchline.contract import FinishedBatch
    from batchline.contract.executor_store import ExecutorStore
    from batchline.protocol import internal_pb2 as pb
    from batchline.redis_client import connect
    from executor.outcome import Written

    model = ("mlp", "1")
    assert redis_cluster.shard_of(contract.batch(model, "b1")) != redis_cluster.shard_of(contract.reply("gw"))
    batch = pb.Batch(batch_id="b1", model_name="mlp", model_version="1", members=[pb.QueueEntry(request_id="r1")])
    done = FinishedBatch(batch, pb.ExecutionReport(executor_id="e1", batch_id="b1"), {"gw": [b"answer"]}, [], 0)

    async def run():
        client = connect(redis_cluster.url, 2)
        try:
            store, written = ExecutorStore(client), Written()
            await store.batch_done(done)
            written.add(done)
            await client.delete(contract.reply("gw"))  # the reply list's shard failed over without it
            told = [await written.rewrite_lost(store),  # one Redis: answers and key are lost together
                    await written.rewrite_lost(store, resend_answers=True)]
            return told, await client.lrange(contract.reply("gw"), 0, -1)
        finally:
            await client.aclose()

    assert asyncio.run(run()) == ([0, 1], [b"answer"])


def test_a_shed_on_a_cluster_takes_only_what_is_still_queued_and_answers_only_that(redis_cluster):
    """A scheduler paused past its lease sheds a request the new leader dispatched meanwhile: on a
    cluster too, that one keeps its payload and gets no answer from the shed, and the step counts
    one request shed, not two."""
    from batchline.contract.scheduler_store import SchedulerStore
    from batchline.protocol import internal_pb2 as pb
    from batchline.redis_client import connect

    model = ("mlp", "1")
    queued = pb.QueueEntry(request_id="q", gateway_id="g1", model_version="1", rows=1, deadline_us=1, priority=1)
    taken = pb.QueueEntry(request_id="t", gateway_id="g2", model_version="1", rows=1, deadline_us=1, priority=1)
    r = redis_cluster.node(redis_cluster.shard_of(contract.queue(model)))
    r.zadd(contract.queue(model), {queued.SerializeToString(): 1})  # `taken` left it: dispatched
    for e in (queued, taken):
        r.set(contract.payload(model, e.request_id), b"tensors", px=60_000)
    replies = {g: [pb.Reply(request_id=rid, code=4, message="shed")] for g, rid in (("g1", "q"), ("g2", "t"))}

    async def step() -> list:
        client = connect(redis_cluster.url, 2)
        try:
            store = SchedulerStore(client, client)
            async with store.step_writes() as writes:
                writes.shed(model, [queued.SerializeToString(), taken.SerializeToString()], ["q", "t"], replies)
                return await writes.execute()
        finally:
            await client.aclose()

    assert asyncio.run(step()) == [1]
    assert r.zcard(contract.queue(model)) == 0 and not r.exists(contract.payload(model, "q"))
    assert r.exists(contract.payload(model, "t"))  # the run elsewhere still reads it
    g1 = redis_cluster.node(redis_cluster.shard_of(contract.reply("g1")))
    g2 = redis_cluster.node(redis_cluster.shard_of(contract.reply("g2")))
    assert [pb.Reply.FromString(b).request_id for b in g1.lrange(contract.reply("g1"), 0, -1)] == ["q"]
    assert g2.llen(contract.reply("g2")) == 0 and g1.ttl(contract.reply("g1")) > 0
    assert r.hget(contract.stats(model), "fail_count") == b"1"


def test_reports_a_scan_took_are_kept_when_its_read_of_the_queues_fails(redis_cluster):
    """On a cluster a scan takes the reports in one round and reads the queues in the next: when the
    read fails, the reports it took come with the next scan, not lost with the failed one."""
    import redis

    from batchline.contract.scheduler_store import SchedulerStore
    from batchline.redis_client import connect

    model = ("mlp", "1")
    redis_cluster.node(redis_cluster.shard_of(contract.REPORTS)).rpush(contract.REPORTS, b"r1", b"r2")
    queue = redis_cluster.node(redis_cluster.shard_of(contract.queue(model)))
    queue.set(contract.queue(model), b"not a queue")  # the read fails: WRONGTYPE

    async def scans() -> list[bytes]:
        client = connect(redis_cluster.url, 2)
        try:
            store = SchedulerStore(client, client)
            with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
                await store.scan([], [model], [], 16, 64)
            queue.delete(contract.queue(model))
            return (await store.scan([], [model], [], 16, 64)).reports
        finally:
            await client.aclose()

    assert asyncio.run(scans()) == [b"r1", b"r2"]


def test_a_cluster_that_went_away_whole_is_an_outage_and_served_again_once_back(redis_cluster):
    """Every node away: the command after a connection error maps the cluster again and fails with
    RedisClusterException, which must read as an outage (what the waiting loops retry through),
    and the same client serves once the nodes are back."""
    from batchline.redis_client import REDIS_ERRORS, connect

    async def scenario() -> None:
        client = connect(redis_cluster.url, 1)
        try:
            await client.set("k", "v")
            redis_cluster.stop(kill=True)
            kinds = []
            for _ in range(3):
                try:
                    await client.get("k")
                except REDIS_ERRORS as exc:
                    kinds.append(type(exc).__name__)
            assert len(kinds) == 3, kinds
            for server in redis_cluster.servers:  # the same nodes again: each keeps its nodes.conf
                server.start()
            deadline = time.monotonic() + 30
            while True:
                try:
                    await client.set("k", "again")
                    break
                except REDIS_ERRORS:
                    assert time.monotonic() < deadline, "the client did not serve again"
                    await asyncio.sleep(0.2)
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_a_burst_past_a_nodes_connections_waits_instead_of_failing(redis_cluster):
    """redis-py's cluster client fails a command once a node has 100 connections: a burst of 300
    commands and 150 pipelines on one node (a tenant's rate checks, group commits) must each be
    answered, as on a plain Redis."""
    from batchline.redis_client import connect

    async def piped():
        async with client.pipeline(transaction=False) as pipe:
            pipe.get("{t:one}k")
            return (await pipe.execute())[0]

    async def burst() -> list:
        nonlocal client
        client = connect(redis_cluster.url, 5)
        try:
            await client.set("{t:one}k", "v")
            return await asyncio.gather(*(client.get("{t:one}k") for _ in range(300)),
                                        *(piped() for _ in range(150)), return_exceptions=True)
        finally:
            await client.aclose()

    client = None
    answers = asyncio.run(burst())
    assert answers == [b"v"] * 450, {type(a).__name__ for a in answers if isinstance(a, Exception)}


def _start_gateway(url: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway", "--redis-url", url, "--port", "0", "--metrics-port", "-1",
                           "--http-port", "-1"],
                          capture_output=True, text=True, timeout=60)


def _one_line(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    return lines[0]


def test_a_cluster_without_every_slot_or_named_as_one_redis_stops_a_service_in_one_line(redis_cluster):
    line = _one_line(_start_gateway(redis_cluster.servers[0].url))
    assert "is a Redis Cluster node: name the cluster as redis+cluster://" in line
    # A slot uncovered: the model whose keys hash there could never be served.
    owner = redis_cluster.shard_of(contract.queue(("mlp", "1")))
    slot = redis_cluster.node(owner).cluster("keyslot", contract.queue(("mlp", "1")))
    redis_cluster.node(owner).execute_command("CLUSTER DELSLOTS", slot)
    line = _one_line(_start_gateway(redis_cluster.url))
    assert "only 16383 of its 16384 hash slots are assigned" in line and "redis-cli --cluster fix" in line


def test_both_demo_models_are_served_with_their_keys_on_different_shards(redis_cluster, process_mesh, model_repository):
    mesh = process_mesh(redis_server=redis_cluster, models=("mlp", "minilm")).start(executors=1)
    client = tc.InferenceServerClient(mesh.probe.gateway_address())
    features = tc.InferInput("features", [2, 32], "FP32")
    features.set_data_from_numpy(np.ones((2, 32), dtype=np.float32))
    assert client.infer("mlp", [features], client_timeout=30).as_numpy("probability").shape == (2, 1)
    text = tc.InferInput("text", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"a sentence on a cluster"]], dtype=object))
    assert client.infer("minilm", [text], client_timeout=60).as_numpy("sentence_embedding").shape == (1, 384)
    rows = []
    for model in ("mlp", "minilm"):
        queue = contract.queue((model, "1"))
        shard = redis_cluster.shard_of(queue)
        slot = redis_cluster.node(0).cluster("keyslot", queue)
        # Every key of the model is in its slot: its statistics, written by the executor's clean-up, are there.
        assert redis_cluster.node(shard).exists(contract.stats((model, "1"))), \
            f"{model}'s statistics not on shard {shard}"
        rows.append((model, slot, shard))
    print("\nmodel   slot   shard (node port)")
    for model, slot, shard in rows:
        print(f"{model:7} {slot:5}  {shard} ({redis_cluster.servers[shard].port})")
    assert rows[0][2] != rows[1][2], f"both models' keys on one shard: {rows}"
    assert contract.model_tag(("mlp", "1")) in contract.queue(("mlp", "1"))


def test_an_executor_killed_under_load_on_a_cluster(redis_cluster, process_mesh, mlp_model):
    """One of two executors SIGKILLed while it holds batches, then restarted: its batches are found
    in the models' in-flight sets (on their shards) and served by the other; nothing is lost."""
    mesh = process_mesh(redis_server=redis_cluster).start(executors=2)
    with load_for(mesh, mlp_model) as load:
        load.wait_ok(100, since=0, timeout=60, check=mesh.check_alive)
        soft_poll(lambda: mesh.probe.held_batches("exec-0") > 0, 5)
        held = mesh.probe.held_batches("exec-0")
        t_kill = time.monotonic()
        mesh.kill("exec-0", signal.SIGKILL)
        mesh.wait_exit("exec-0", 10)
        mesh.probe.wait_executor_gone("exec-0")
        poll(lambda: mesh.probe.held_batches("exec-0") == 0 and mesh.probe.queued_work("exec-0") == 0, 10,
             "the dead executor's batches to be handed back")
        t_back = time.monotonic()
        mesh.restart("exec-0")
        mesh.probe.wait_for_executors(2, 60)
        load.wait_ok(100, since=time.monotonic(), timeout=60, check=mesh.check_alive)
        records = load.stop()
    report("executor SIGKILL on a Redis Cluster", [
        ("before the kill", between(records, 0, t_kill)),
        ("until handed back", between(records, t_kill, t_back)),
        ("after", between(records, t_back)),
    ], f"held {held} batch(es) at the kill")
    assert_nothing_hung(records)
    assert_answers_correct(records)
    assert_none_lost(records)
    ok = sum(r.code == "OK" for r in records)
    assert ok >= 0.99 * len(records), f"only {ok} of {len(records)} requests succeeded"


def test_the_standby_scheduler_takes_over_on_a_cluster(redis_cluster, process_mesh, mlp_model):
    """Two schedulers; the leader SIGKILLed under load: the standby takes the lease (in the shared
    slot) and serves on; no batch is run twice (rows run == rows answered)."""
    mesh = process_mesh(redis_server=redis_cluster).start(executors=1, schedulers=2)
    with load_for(mesh, mlp_model) as load:
        load.wait_ok(100, since=0, timeout=60, check=mesh.check_alive)
        dispatched = {n: mesh.probe.scheduler_status(n).dispatched_batches for n in mesh.schedulers}
        (leader,) = [n for n, d in dispatched.items() if d > 0]
        (standby,) = [n for n in mesh.schedulers if n != leader]
        t_kill = time.monotonic()
        mesh.kill(leader, signal.SIGKILL)
        mesh.wait_exit(leader, 10)
        poll(lambda: mesh.probe.scheduler_status(standby).dispatched_batches > 0, 30,
             f"the standby {standby} to take over", check=mesh.check_alive)
        t_takeover = time.monotonic()
        load.wait_ok(100, since=t_takeover, timeout=60, check=mesh.check_alive)
        records = load.stop()
    report("scheduler leader SIGKILL on a Redis Cluster", [
        ("leader alive", between(records, 0, t_kill)),
        ("no leader", between(records, t_kill, t_takeover)),
        ("after takeover", between(records, t_takeover)),
    ], f"takeover after {t_takeover - t_kill:.2f} s")
    assert_nothing_hung(records)
    assert_answers_correct(records)
    assert_all_ok(records)
    ok_rows = sum(r.rows for r in records if r.code == "OK")
    poll(lambda: mesh.probe.model_statistics("mlp").inference_count == ok_rows, 10,
         f"inference_count to reach the {ok_rows} rows answered")
    assert mesh.probe.model_statistics("mlp").inference_count == ok_rows


def test_a_shard_s_primary_killed_under_load_fails_over_to_its_replica(process_mesh, mlp_model):
    """Three primaries each with a replica; the primary serving mlp's slot (and the shared one's)
    SIGKILLed under load: the cluster promotes its replica, the mesh serves again, every call is
    answered before its deadline, and the calls outside the window succeed (how soon:
    benchmarks/failover.py)."""
    with ClusterRedis(replicas=1) as redis_cluster:
        mesh = process_mesh(redis_server=redis_cluster).start(executors=1)
        key = contract.queue(("mlp", "1"))
        with load_for(mesh, mlp_model) as load:
            load.wait_ok(200, since=0, timeout=60, check=mesh.check_alive)
            old = redis_cluster.shard_of(key)
            killed = time.monotonic()
            redis_cluster.servers[old].stop(kill=True)
            promoted = redis_cluster.wait_failover(key, old)
            served = served_again(load, promoted)
            load.wait_ok(200, since=promoted + 1.0, timeout=60, check=mesh.check_alive)
            records = load.stop()
    window = [r for r in records if r.end >= killed and r.sent < promoted + 1.0]
    outside = [r for r in records if r not in window]
    report("a Redis Cluster shard's primary SIGKILLed", [
        ("answered before the kill", [r for r in records if r.end < killed]),
        ("in the window", window),
        ("after", between(records, promoted + 1.0)),
    ], f"replica promoted {promoted - killed:.2f} s after the kill; served again {served - promoted:.2f} s after it")
    assert_nothing_hung(records)
    assert_none_lost(records)
    assert_answers_correct(records)
    ok = [r for r in outside if r.code == "OK"]
    assert len(ok) >= 0.99 * len(outside), f"{len(outside) - len(ok)} of {len(outside)} calls outside the window failed"
