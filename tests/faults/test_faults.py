"""Fault tolerance of the real services, each its own process, under continuous load.

Every test starts a mesh of subprocesses (batchline/testing/processes.py) on a private
Redis, keeps 8 mlp requests in flight with a 10 s budget each, injects one
kind of fault, and then judges every request that was sent:

- no call outlives its budget + 2 s (nothing hangs; the client's own deadline
  is budget + 5 s, so a hang is seen rather than cut off);
- every successful answer is right: same id, same output as a local ONNX
  Runtime run of the same input (a crossed or duplicated answer fails);
- nothing is lost: no DEADLINE_EXCEEDED for a request that had an executor
  and a scheduler available (a 10 s budget is plenty for any recovery here).

Run with `-s` to see a per-phase summary (sent / ok / by status / latency).
The poisoned-request case is covered by tests/e2e/test_errors_e2e.py
(test_request_that_fails_in_the_model_fails_alone), so it is not repeated here.
"""
from __future__ import annotations

import concurrent.futures
import signal
import statistics
import time

import grpc
import numpy as np

from batchline import contract
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import inference_pb2_grpc
from batchline.testing.load import LoadClient
from batchline.testing.polling import poll
from batchline.testing.verdicts import (BUDGET_S, assert_all_ok, assert_answers_correct, assert_none_lost,
                                        assert_nothing_hung, between, load_for, report, soft_poll, watch_health)

UNAVAILABLE_LIKE = {"UNAVAILABLE", "DEADLINE_EXCEEDED"}


# -- executors -------------------------------------------------------------------------


def test_executor_deaths_under_load(process_mesh, mlp_model):
    """Three executors; one at a time is SIGKILLed (idle or holding batches), or frozen
    (SIGSTOP) until declared dead and then woken (its late answers must be dropped), and
    restarted under the same id. Every request sent had live executors, so none may be lost."""
    mesh = process_mesh().start(executors=3)
    events: list[str] = []
    with load_for(mesh, mlp_model) as load:
        load.wait_ok(30, since=0, timeout=30, check=mesh.check_alive)

        def kill_and_restart(victim: str, freeze_first: bool) -> None:
            t = time.monotonic()
            if freeze_first:
                # Frozen, it keeps the batches it was given until its heartbeat expires.
                mesh.kill(victim, signal.SIGSTOP)
                poll(lambda: mesh.probe.held_batches(victim) > 0, 10, f"{victim} to hold a batch while frozen")
            else:
                soft_poll(lambda: mesh.probe.held_batches(victim) > 0, 5)
            held = mesh.probe.held_batches(victim)
            mesh.kill(victim, signal.SIGKILL)
            mesh.wait_exit(victim, 10)
            mesh.probe.wait_executor_gone(victim)
            # Restarting under the same id before the scheduler took the dead one's batches
            # back would test something else (an executor resuming its own work).
            reclaimed = soft_poll(lambda: mesh.probe.held_batches(victim) == 0
                                  and mesh.probe.queued_work(victim) == 0, 5, 0.05)
            mesh.restart(victim)
            mesh.probe.wait_for_executors(3, 60)
            events.append(f"{'frozen+' if freeze_first else ''}killed {victim} holding {held} batch(es) at "
                          f"t+{time.monotonic() - t:.1f}s; reclaimed before restart: {reclaimed}")

        def freeze_and_wake(victim: str) -> None:
            t = time.monotonic()
            mesh.kill(victim, signal.SIGSTOP)
            poll(lambda: mesh.probe.held_batches(victim) > 0, 10, f"{victim} to hold a batch while frozen")
            held = mesh.probe.held_batches(victim)
            mesh.probe.wait_executor_gone(victim)
            # The others serve while it is frozen (its batches go elsewhere).
            load.wait_ok(20, since=time.monotonic(), timeout=20, check=mesh.check_alive)
            mesh.kill(victim, signal.SIGCONT)
            mesh.probe.wait_for_executors(3, 30)
            events.append(f"froze {victim} holding {held} batch(es), woke it after t+{time.monotonic() - t:.1f}s")

        kill_and_restart("exec-0", freeze_first=False)
        load.wait_ok(20, since=time.monotonic(), timeout=20, check=mesh.check_alive)
        kill_and_restart("exec-1", freeze_first=True)
        load.wait_ok(20, since=time.monotonic(), timeout=20, check=mesh.check_alive)
        freeze_and_wake("exec-2")
        load.wait_ok(20, since=time.monotonic(), timeout=20, check=mesh.check_alive)
        kill_and_restart("exec-0", freeze_first=True)
        load.wait_ok(30, since=time.monotonic(), timeout=20, check=mesh.check_alive)
        records = load.stop()

    ok = sum(r.code == "OK" for r in records)
    report("executor deaths", [("all requests", records)], "; ".join(events))
    assert_nothing_hung(records)
    assert_answers_correct(records)
    assert_none_lost(records)
    # Some executor was alive for every request sent.
    assert ok >= 0.99 * len(records), f"only {ok} of {len(records)} requests succeeded"


def test_sigterm_drains_an_executor(process_mesh, mlp_model):
    """SIGTERM one of two executors under load: it finishes what it runs, hands back what it
    had not started, and exits 0; no request fails."""
    mesh = process_mesh().start(executors=2)
    with load_for(mesh, mlp_model) as load:
        load.wait_ok(30, since=0, timeout=30, check=mesh.check_alive)
        busy = soft_poll(lambda: mesh.probe.held_batches("exec-1") > 0, 5)
        t_term = time.monotonic()
        mesh.kill("exec-1", signal.SIGTERM)
        code = mesh.wait_exit("exec-1", 30)
        t_exit = time.monotonic()
        # Nothing may stay assigned to it: what it did not run was handed back (or recovered).
        cleared = soft_poll(lambda: mesh.probe.queued_work("exec-1") == 0
                            and mesh.probe.held_batches("exec-1") == 0, 5, 0.05)
        left_detail = f"work list {mesh.probe.queued_work('exec-1')}, inflight set {mesh.probe.held_batches('exec-1')}"
        load.wait_ok(30, since=time.monotonic(), timeout=20, check=mesh.check_alive)
        records = load.stop()

    report("executor SIGTERM", [
        ("before SIGTERM", between(records, 0, t_term)),
        ("while draining", between(records, t_term, t_exit)),
        ("after exit", between(records, t_exit)),
    ], f"exit code {code} after {t_exit - t_term:.2f}s; held batches at SIGTERM: {busy}; "
       f"left after exit: {left_detail}")
    assert code == 0, f"the executor exited with {code} on SIGTERM"
    assert cleared, f"batches still assigned to the executor 5 s after it exited: {left_detail}"
    assert_nothing_hung(records)
    assert_answers_correct(records)
    assert_all_ok(records)


# -- schedulers ------------------------------------------------------------------------


def test_scheduler_killed_and_restarted(process_mesh, mlp_model):
    """SIGKILL the only scheduler under load, restart it: what queued meanwhile is served."""
    mesh = process_mesh().start(executors=2)
    with load_for(mesh, mlp_model) as load:
        load.wait_ok(30, since=0, timeout=30, check=mesh.check_alive)
        t_kill = time.monotonic()
        mesh.kill("sched-0", signal.SIGKILL)
        mesh.wait_exit("sched-0", 10)
        # Without a scheduler every request ends up waiting in the queue.
        poll(lambda: mesh.probe.queue_depth() >= 4, 10, "requests to queue up while no scheduler runs")
        t_restart = time.monotonic()
        mesh.restart("sched-0")
        load.wait_ok(30, since=time.monotonic(), timeout=30, check=mesh.check_alive)
        records = load.stop()

    report("scheduler SIGKILL + restart", [
        ("before kill", between(records, 0, t_kill)),
        ("scheduler down", between(records, t_kill, t_restart)),
        ("after restart", between(records, t_restart)),
    ])
    assert_nothing_hung(records)
    assert_answers_correct(records)
    assert_all_ok(records)


def test_standby_scheduler_never_dispatches_and_takes_over(process_mesh, mlp_model):
    """Two schedulers: one holds the lease (bl:leader) and dispatches, the other does nothing
    until the leader is SIGKILLed, then takes over. No batch is ever dispatched twice: the
    rows the executors ran (ModelStatistics inference_count) are exactly the rows answered."""
    mesh = process_mesh().start(executors=2, schedulers=2)
    with load_for(mesh, mlp_model) as load:
        load.wait_ok(100, since=0, timeout=30, check=mesh.check_alive)
        dispatched = {n: mesh.probe.scheduler_status(n).dispatched_batches for n in mesh.schedulers}
        lease_ttl_ms = mesh.probe.redis.pttl(contract.LEADER)
        active = [n for n, d in dispatched.items() if d > 0]
        assert len(active) == 1, f"batches dispatched per scheduler: {dispatched} (exactly one should be the leader)"
        (leader,) = active
        (standby,) = [n for n in mesh.schedulers if n != leader]
        assert lease_ttl_ms > 0, f"no leader lease with an expiry under bl:leader (PTTL {lease_ttl_ms})"

        t_kill = time.monotonic()
        mesh.kill(leader, signal.SIGKILL)
        mesh.wait_exit(leader, 10)
        poll(lambda: mesh.probe.scheduler_status(standby).dispatched_batches > 0, 30,
             f"the standby {standby} to take over", check=mesh.check_alive)
        t_takeover = time.monotonic()
        load.wait_ok(50, since=t_takeover, timeout=30, check=mesh.check_alive)
        records = load.stop()

    ok_rows = sum(r.rows for r in records if r.code == "OK")
    sent_rows = sum(r.rows for r in records)
    report("two schedulers, leader SIGKILLed", [
        ("leader alive", between(records, 0, t_kill)),
        ("leader dead, no takeover", between(records, t_kill, t_takeover)),
        ("after takeover", between(records, t_takeover)),
    ], f"dispatched before the kill: {dispatched}; takeover after {t_takeover - t_kill:.2f}s")
    assert_nothing_hung(records)
    assert_answers_correct(records)
    assert_all_ok(records)

    # Statistics are written just after the replies: wait for them to catch up, but a
    # count past the rows answered means some request ran twice.
    def executed_rows() -> int:
        n = mesh.probe.model_statistics("mlp").inference_count
        assert n <= ok_rows, f"executors ran {n} rows for {ok_rows} rows answered ({sent_rows} sent): double dispatch"
        return n

    poll(lambda: executed_rows() == ok_rows, 10, f"inference_count to reach the {ok_rows} rows answered")


# -- Redis -------------------------------------------------------------------------------


def test_redis_restart_under_load(process_mesh, mlp_model):
    """Redis SIGKILLed under load and started again (empty) on the same port: the gateway
    answers UNAVAILABLE at once meanwhile, every service reports NOT_SERVING on its health
    service while Redis is gone and SERVING after, and the mesh serves again by itself."""
    mesh = process_mesh().start(executors=2)
    services = list(mesh.services)
    for name in services:
        mesh.probe.channel(name)  # resolve every address while Redis still holds the gateway's
    with load_for(mesh, mlp_model) as load:
        load.wait_ok(30, since=0, timeout=30, check=mesh.check_alive)
        t_down = time.monotonic()
        mesh.kill_redis()
        t_killed = time.monotonic()
        not_serving = watch_health(mesh, services, "NOT_SERVING", 10)
        poll(lambda: len([r for r in load.snapshot() if r.sent >= t_killed]) >= 16, BUDGET_S + 10,
             "16 requests sent during the outage to end", check=mesh.check_alive)
        t_up = time.monotonic()
        mesh.start_redis()
        load.wait_ok(1, since=t_up, timeout=30, check=mesh.check_alive)
        t_served = time.monotonic()
        serving = watch_health(mesh, services, "SERVING", 15)
        mesh.probe.wait_for_executors(2, 30)
        load.wait_ok(30, since=time.monotonic(), timeout=30, check=mesh.check_alive)
        records = load.stop()

    outage = between(records, t_killed, t_up)
    median = statistics.median(r.latency for r in outage) if outage else float("nan")
    report("Redis SIGKILL + restart", [
        ("before", between(records, 0, t_down)),
        ("Redis down", outage),
        ("back, until first OK", between(records, t_up, t_served)),
        ("served again", between(records, t_served)),
    ], f"outage {t_up - t_down:.1f}s, latency while down: median {median * 1e3:.0f} ms; "
       f"NOT_SERVING seen: {not_serving}; SERVING again: {serving}")

    assert_nothing_hung(records)
    assert_answers_correct(records)
    # Requests in flight when Redis died: answered somehow (checked above: nothing hung).
    # Requests sent while it was down and answered before it came back: refused, and fast.
    refused = [r for r in outage if r.end < t_up]
    assert refused, "no request was answered while Redis was down"
    wrong = [r for r in refused if r.code not in UNAVAILABLE_LIKE]
    assert not wrong, \
        f"requests sent while Redis was down ended with {sorted({r.code for r in wrong})}, e.g. {wrong[:3]}"
    # "About a second" (the Redis timeout): the median rather than the maximum, so that one
    # request stalled by this 2-core machine does not decide; none may wait for its budget.
    assert median < 1.5, f"requests sent while Redis was down took {median:.2f} s (median) to be refused"
    slow = [r for r in outage if r.latency > BUDGET_S / 2]
    assert not slow, f"{len(slow)} request(s) sent while Redis was down waited for their deadline: {slow[:3]}"
    missing = [n for n, seen in not_serving.items() if not seen]
    assert not missing, f"health Check never reported NOT_SERVING while Redis was down for: {missing}"
    missing = [n for n, seen in serving.items() if not seen]
    assert not missing, f"health Check did not report SERVING again after Redis returned for: {missing}"
    # Once Redis is back, a request may still be refused while the services reconnect and
    # re-register, but one it accepted must not be lost.
    assert_none_lost(between(records, t_up))
    # Once served again, served for good.
    assert_all_ok([r for r in records if r.sent >= t_served + 1.0])


# -- gateway -----------------------------------------------------------------------------


def test_sigterm_drains_the_gateway(process_mesh, mlp_model):
    """SIGTERM the gateway while requests wait in the queue (the scheduler is frozen): it stops
    admitting new requests at once, still answers those it had admitted once they are
    served, and exits 0."""
    mesh = process_mesh().start(executors=1)
    address = mesh.probe.gateway_address()
    client = LoadClient(address, mlp_model, budget_s=BUDGET_S)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=6)
    try:
        rng = np.random.default_rng(7)
        assert client.one(rng).code == "OK"
        mesh.kill("sched-0", signal.SIGSTOP)
        admitted = [pool.submit(client.one, np.random.default_rng(100 + i)) for i in range(6)]
        poll(lambda: mesh.probe.queue_depth() == 6, 10, "6 requests to wait in the queue")

        t_term = time.monotonic()
        mesh.kill("gateway", signal.SIGTERM)

        def refused() -> str | None:
            # A fresh connection each time: a new client, not one with a call in flight.
            with grpc.insecure_channel(address) as channel:
                request = ipb.ModelInferRequest(model_name="mlp")
                request.inputs.add(name="features", datatype="FP32", shape=[1, 32])
                request.raw_input_contents.append(np.zeros((1, 32), np.float32).tobytes())
                try:
                    inference_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=5)
                except grpc.RpcError as exc:
                    return exc.code().name
                return None

        # Probed once it says it drains (its health turns NOT_SERVING): a request that reached it before
        # it handled the signal was admitted, and waits for the frozen scheduler like the others.
        poll(lambda: mesh.probe.health("gateway") == "NOT_SERVING", 5, "the gateway to report that it drains")
        new_code = poll(refused, 5, "the draining gateway to refuse a new request")
        # The queued requests stay unserved a while longer than a token grace period:
        # the gateway must wait for them, not for a fixed few seconds.
        hold_until = t_term + 3.0
        while time.monotonic() < hold_until:
            assert all(not f.done() for f in admitted), "an admitted request ended while nothing could serve it"
            time.sleep(0.05)
        mesh.kill("sched-0", signal.SIGCONT)
        records = [f.result(timeout=BUDGET_S + 10) for f in admitted]
        code = mesh.wait_exit("gateway", 30)
    finally:
        mesh.kill("sched-0", signal.SIGCONT)
        pool.shutdown(wait=False, cancel_futures=True)
        client.channel.close()

    report("gateway SIGTERM", [("admitted before SIGTERM", records)],
           f"new request after SIGTERM: {new_code}; gateway exit code {code}")
    assert new_code == "UNAVAILABLE", f"a new request to the draining gateway got {new_code}"
    assert_answers_correct(records)
    assert_all_ok(records)
    assert code == 0, f"the gateway exited with {code} on SIGTERM"
