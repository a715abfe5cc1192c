"""Redis behind Sentinel: real redis-server processes on loopback (a primary, a replica, three
sentinels). The services follow a failover by themselves; the queued requests the new primary
lacks are answered UNAVAILABLE at once, and every other request is served."""
from __future__ import annotations

import concurrent.futures
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import redis
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

from batchline import contract, metrics, sentinel
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import internal_pb2 as pb
from batchline.redis_client import connect_sync, mask
from batchline.testing.polling import poll
from batchline.testing.sentinel import SentinelRedis
from batchline.testing.verdicts import (assert_answers_correct, assert_none_lost, assert_nothing_hung, between,
                                        load_for, report, served_again)


@pytest.fixture
def sentinels():
    with SentinelRedis() as group:
        yield group


def test_sentinel_urls_name_their_sentinels_master_and_options():
    t = sentinel.parse("redis+sentinel://mesh:s3cret@10.0.0.1:26379,10.0.0.2/orders/2?sentinel_password=x")
    assert t.sentinels == [("10.0.0.1", 26379), ("10.0.0.2", 26379)] and t.master == "orders"
    assert t.master_kwargs == {"username": "mesh", "password": "s3cret", "db": 2}
    assert t.sentinel_kwargs == {"password": "x"}
    t = sentinel.parse("rediss+sentinel://h:5000/m?ssl_ca_certs=/ca.pem")
    assert t.master_kwargs["ssl"] and t.master_kwargs["ssl_ca_certs"] == "/ca.pem" and t.master_kwargs["db"] == 0
    assert t.sentinel_kwargs == {"ssl": True, "ssl_ca_certs": "/ca.pem"}
    for bad, says in [("redis+sentinel://h:1", "names no master"), ("redis+sentinel://h:x/m", "not a number"),
                      ("redis+sentinel://h:1/m/zero", "/MASTER or /MASTER/DB")]:
        with pytest.raises(ValueError, match=says):
            sentinel.parse(bad)
    assert mask("redis+sentinel://:s3cret@h:1,h:2/m/0?sentinel_password=t0p") == \
        "redis+sentinel://:***@h:1,h:2/m/0?sentinel_password=***"


def test_a_master_name_no_sentinel_knows_stops_a_service_in_one_line(sentinels):
    url = sentinels.url.replace(f"/{sentinels.master}/", "/no-such-master/")
    out = subprocess.run([sys.executable, "-m", "gateway", "--redis-url", url, "--port", "0", "--metrics-port", "-1",
                          "--http-port", "-1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "monitors a master named 'no-such-master'" in lines[0], out.stderr


def test_the_primary_s_password_goes_in_the_sentinel_url():
    """Servers with requirepass behind sentinels: a wrong password stops a service in one line that
    does not show it; the right one serves."""
    with SentinelRedis(password="the-right-secret") as group:
        wrong = group.url.replace("the-right-secret", "a-wrong-secret")
        out = subprocess.run([sys.executable, "-m", "scheduler", "--redis-url", wrong, "--port", "0",
                              "--metrics-port", "-1"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, out.stderr
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "refuses the credentials" in lines[0] and ":***@" in lines[0], out.stderr
        assert "a-wrong-secret" not in out.stderr + out.stdout
        client = connect_sync(group.url, 2)
        client.set("k", "v")
        assert client.get("k") == b"v"


def _features(value: float) -> tc.InferInput:
    inp = tc.InferInput("features", [1, 32], "FP32")
    inp.set_data_from_numpy(np.full((1, 32), value, np.float32))
    return inp


def _payload_of(r: redis.Redis, client_id: str) -> str:
    """The payload key of the queued request the client sent with `client_id`."""
    for member in r.zrange(contract.queue(("mlp", "1")), 0, -1):
        key = contract.payload(("mlp", "1"), pb.QueueEntry.FromString(member).request_id)
        blob = r.get(key)
        if blob and ipb.ModelInferRequest.FromString(blob).id == client_id:
            return key
    return ""


def test_a_failover_fails_at_once_only_what_the_new_primary_lacks(sentinels, model_repository):
    """A real failover (SENTINEL FAILOVER) to a replica that lacks one queued request's payload and
    still holds the batch key of a batch already answered (what asynchronous replication leaves
    when a primary dies): the lacking request is answered UNAVAILABLE at once, its neighbour is
    served, and the executor writes the lost batch's answers again."""
    from batchline.testing.in_process import InProcessMesh

    failovers, lost, rewritten = (metrics.REDIS_FAILOVERS._value.get(), metrics.FAILOVER_LOST._value.get(),
                                  metrics.BATCHES_REWRITTEN._value.get())
    with InProcessMesh(sentinels.url, str(model_repository), models=["mlp"]) as m:
        client = tc.InferenceServerClient(m.address)
        client.infer("mlp", [_features(0.0)])
        # The executor keeps a batch once Redis acknowledged its write, which may come after the
        # gateway, reading the same write, has answered the client.
        answered = poll(lambda: m.executors[0].executor.written.batches()[-1:], 10,
                        "the executor to keep its answered batch")[0]
        primary = connect_sync(sentinels.url, 2)
        taken = time.monotonic()
        primary.set(contract.LEADER, "someone-else", px=120_000)  # keep the next requests queued
        poll(lambda: not m.scheduler.scheduler.leader and m.scheduler.scheduler.lease.attempted_at > taken,
             10, "the scheduler to see the lease taken")
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            calls = {name: pool.submit(client.infer, "mlp", [_features(v)], request_id=name, client_timeout=60)
                     for name, v in (("kept", 1.0), ("lacking", 2.0))}
            poll(lambda: _payload_of(primary, "kept") and _payload_of(primary, "lacking"), 10, "both to be queued")
            replica_server = next(s for s in sentinels.servers if s is not sentinels.primary())
            replica = redis.Redis(port=replica_server.port)
            poll(lambda: _payload_of(replica, "lacking"), 10, "the replica to hold both")
            replica.config_set("replica-read-only", "no")
            replica.delete(_payload_of(replica, "lacking"))
            replica.set(contract.batch(("mlp", "1"), answered.batch_id), answered.SerializeToString(), px=60_000)
            old = sentinels.master_address()
            redis.Redis(port=sentinels.sentinel_ports[0]).execute_command("SENTINEL", "FAILOVER", sentinels.master)
            promoted = sentinels.wait_failover(old)
            # Answered, not hung: well before the client's own 60 s. The gateway sees the new primary
            # when its connections reach it, which on a loaded host has taken over 10 s.
            with pytest.raises(InferenceServerException) as info:
                calls["lacking"].result(timeout=30)
            answered_at = time.monotonic()
            assert info.value.status() == "StatusCode.UNAVAILABLE"
            assert "new one lacks this queued request" in info.value.message()
            # How soon is benchmarks/failover.py's to measure; here, that it is answered, not hung.
            print(f"\nthe lacked request was answered {answered_at - promoted:.2f} s after the promotion")
            assert not calls["kept"].done(), "the request the new primary holds was failed too"
            primary = connect_sync(sentinels.url, 2)
            poll(lambda: not primary.exists(contract.batch(("mlp", "1"), answered.batch_id)), 10,
                 "the executor to write the lost batch again")
            primary.delete(contract.LEADER)
            result = calls["kept"].result(timeout=30)
    assert result.as_numpy("probability").shape == (1, 1)
    assert metrics.REDIS_FAILOVERS._value.get() >= failovers + 2  # at least the gateway and the executor
    assert metrics.FAILOVER_LOST._value.get() == lost + 1
    assert metrics.BATCHES_REWRITTEN._value.get() >= rewritten + 1


def test_primary_killed_under_load(sentinels, process_mesh, mlp_model):
    """The primary SIGKILLed under continuous load (8 in flight): the mesh serves again, every call is
    answered before its deadline (none is lost), and at least 99% of the calls outside the failover
    window succeed. How soon it serves again is benchmarks/failover.py's to measure: a loaded CI
    host would make a bound on it fail for no fault of the mesh's."""
    mesh = process_mesh(redis_server=sentinels).start(executors=1)
    with load_for(mesh, mlp_model) as load:
        load.wait_ok(200, since=0, timeout=60, check=mesh.check_alive)
        old = sentinels.master_address()
        killed = time.monotonic()  # before the kill: calls fail while it is under way
        sentinels.kill_primary()
        promoted = sentinels.wait_failover(old)
        served = served_again(load, promoted)
        load.wait_ok(200, since=promoted + 1.0, timeout=60, check=mesh.check_alive)
        records = load.stop()

    # The failover window: from the kill to a second after the promotion. A call in it was sent in
    # it or still in flight when the primary died (its write may have gone to the dead one).
    window = [r for r in records if r.end >= killed and r.sent < promoted + 1.0]
    outside = [r for r in records if r not in window]
    unavailable = [r for r in records if r.code == "UNAVAILABLE"]
    report("Redis primary SIGKILLed behind Sentinel", [
        ("answered before the kill", [r for r in records if r.end < killed]),
        ("in flight at the kill", [r for r in window if r.sent < killed]),
        ("sent in the window", between(records, killed, promoted + 1.0)),
        ("after", between(records, promoted + 1.0)),
    ], f"failover {promoted - killed:.2f} s (kill to promotion); served again {served - promoted:.2f} s after it; "
       f"UNAVAILABLE {len(unavailable)} "
       f"({len([r for r in unavailable if 'lacks' in r.message])} lacked by the new primary)")
    assert_nothing_hung(records)
    assert_none_lost(records)
    assert_answers_correct(records)
    ok = [r for r in outside if r.code == "OK"]
    assert len(ok) >= 0.99 * len(outside), \
        f"{len(outside) - len(ok)} of {len(outside)} calls sent outside the failover window failed, " \
        f"e.g. {[r for r in outside if r.code != 'OK'][:3]}"


@pytest.fixture
def tls_sentinels(tmp_path):
    """A primary, a replica and three sentinels serving TLS only (replication and the sentinels'
    own links too); yields (the rediss+sentinel:// URL, the CA file)."""
    from batchline.testing.certs import Authority

    from batchline.embedded_redis import free_port, redis_server_binary

    ca = Authority(tmp_path, "redis")
    cert, key = ca.issue("redis")
    tls = ["--tls-cert-file", cert, "--tls-key-file", key, "--tls-ca-cert-file", ca.file, "--tls-auth-clients", "no",
           "--tls-replication", "yes"]
    ports = [free_port() for _ in range(5)]
    procs = []
    for i, port in enumerate(ports[:2]):
        (tmp_path / f"data-{i}").mkdir()
        replica = ["--replicaof", "127.0.0.1", str(ports[0])] if i else []
        procs.append(subprocess.Popen([redis_server_binary(), "--port", "0", "--tls-port", str(port),
                                       "--bind", "127.0.0.1", *tls, "--save", "", "--appendonly", "no",
                                       "--dir", str(tmp_path / f"data-{i}"), *replica],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    for port in ports[2:]:
        conf = tmp_path / f"sentinel-{port}.conf"
        conf.write_text(f"port 0\ntls-port {port}\nbind 127.0.0.1\ndir {tmp_path}\n"
                        + "".join(f"{tls[i][2:]} {tls[i + 1]}\n" for i in range(0, len(tls), 2))
                        + f"sentinel monitor mymaster 127.0.0.1 {ports[0]} 2\n"
                        "sentinel down-after-milliseconds mymaster 1000\n")
        procs.append(subprocess.Popen([redis_server_binary(), str(conf), "--sentinel"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        def ready() -> bool:
            try:
                state = redis.Redis(port=ports[2], ssl=True, ssl_ca_certs=ca.file,
                                    socket_timeout=1).sentinel_master("mymaster")
            except redis.exceptions.RedisError:
                return False
            return int(state["num-slaves"]) == 1 and int(state["num-other-sentinels"]) == 2

        poll(ready, 30, "the TLS sentinels to see the primary, its replica and each other")
        yield f"rediss+sentinel://{','.join(f'127.0.0.1:{p}' for p in ports[2:])}/mymaster/0?ssl_ca_certs={ca.file}", ca
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)


def test_the_mesh_serves_through_sentinels_over_tls(tls_sentinels, model_repository, tmp_path):
    from batchline.testing.certs import Authority
    from batchline.testing.in_process import InProcessMesh

    url, ca = tls_sentinels
    repo = tmp_path / "repository"
    shutil.copytree(model_repository / "mlp", repo / "mlp")
    with InProcessMesh(url, str(repo), models=["mlp"]) as m, tc.InferenceServerClient(m.address) as client:
        assert client.infer("mlp", [_features(1.0)]).as_numpy("probability").shape == (1, 1)
    stranger = Authority(tmp_path, "stranger")
    out = subprocess.run([sys.executable, "-m", "scheduler", "--redis-url", url.replace(ca.file, stranger.file),
                          "--port", "0", "--metrics-port", "-1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and len([line for line in out.stderr.splitlines() if line.strip()]) == 1, out.stderr
    assert "cannot verify the TLS certificate" in out.stderr, out.stderr
