"""Sequence batching: a sequence's requests run in order from the state its last step left in
Redis, with Triton's control inputs and error words; a step run twice gives the same answer."""
from __future__ import annotations

import asyncio
import contextlib
import queue
import time
import uuid
from functools import partial

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from batchline import contract
from batchline.contract.executor_store import ExecutorStore
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import inference_pb2_grpc
from batchline.protocol import internal_pb2 as pb
from batchline.redis_client import connect, connect_blocking, connect_sync
from batchline.sequences import SequenceFlags
from batchline.testing.processes import poll
from executor import running, sequences
from executor.repository import load_model, read_config
from executor.sequence_config import SequenceBatchingConfig, split_graph
from gateway.sequences import SequenceOrder
from batchline.testing.stateful_models import INT32, save_accumulator, save_simple_sequence

SHORT_IDLE_US = 300_000


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    path = tmp_path_factory.mktemp("repo")
    save_simple_sequence(path)
    save_accumulator(path)
    save_accumulator(path, "short_idle", idle_us=SHORT_IDLE_US)
    save_accumulator(path, "accumulator32", corrid_type=INT32)
    return path


@pytest.fixture(scope="module")
def served(repo):
    from batchline.testing.in_process import InProcessMesh

    with InProcessMesh(None, str(repo)) as m:
        yield m


def value(v: int) -> list[grpcclient.InferInput]:
    tensor = grpcclient.InferInput("INPUT", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.array([[v]], np.int32))
    return [tensor]


def refused(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as err:
        call()
    return err.value


def test_interleaved_sequences_on_one_stream_each_add_up_in_order(served):
    ids = [101, 102, 103, 104]
    steps = [[(i + 1) * 10 + k for k in range(6)] for i in range(len(ids))]
    got: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(served.address) as client:
        client.start_stream(callback=partial(lambda q, result, error: q.put(error or result), got))
        for k in range(6):  # the sequences' steps interleaved, all sent before any answer
            for seq_id, values in zip(ids, steps):
                client.async_stream_infer("accumulator", value(values[k]), request_id=f"{seq_id}/{k}",
                                          sequence_id=seq_id, sequence_start=k == 0, sequence_end=k == 5)
        results = [got.get(timeout=30) for _ in range(6 * len(ids))]
    by_seq: dict[str, list] = {}
    for r in results:
        assert not isinstance(r, InferenceServerException), r.message()
        by_seq.setdefault(r.get_response().id.split("/")[0], []).append(r)
    for seq_id, values in zip(ids, steps):
        answers = by_seq[str(seq_id)]
        assert [r.get_response().id for r in answers] == [f"{seq_id}/{k}" for k in range(6)]  # in order
        assert [int(r.as_numpy("OUTPUT")[0, 0]) for r in answers] == list(np.cumsum(values))
        assert [int(r.as_numpy("ENDED")[0, 0]) for r in answers] == [0] * 5 + [1]
        assert {int(r.as_numpy("CORRID_OUT")[0, 0]) for r in answers} == {seq_id}


def test_the_state_is_in_redis_with_the_idle_timeout_as_its_expiry(served):
    with grpcclient.InferenceServerClient(served.address) as client:
        client.infer("accumulator", value(4), sequence_id=777, sequence_start=True)
    r = connect_sync(served.redis_url, 2)
    key = contract.sequence(("accumulator", "1"), "i:777")
    state = pb.SequenceState.FromString(r.hget(key, "state"))
    assert np.frombuffer(state.after[0], np.int32).tolist() == [4] and state.steps == 1
    assert 0 < r.pttl(key) <= 60_000


def test_a_sequence_must_start_with_the_start_flag(served):
    with grpcclient.InferenceServerClient(served.address) as client:
        err = refused(lambda: client.infer("accumulator", value(1), sequence_id=4242))
    assert "StatusCode.INVALID_ARGUMENT" in str(err.status())
    assert err.message().startswith("inference request for sequence 4242 to model 'accumulator' must specify the "
                                    "START flag on the first request of the sequence")


def test_an_ended_sequence_takes_no_more_steps(served):
    with grpcclient.InferenceServerClient(served.address) as client:
        client.infer("accumulator", value(1), sequence_id=31337, sequence_start=True, sequence_end=True)
        err = refused(lambda: client.infer("accumulator", value(1), sequence_id=31337))
        assert "must specify the START flag" in err.message() and "ended" in err.message()
        # Started again, it begins from zero.
        again = client.infer("accumulator", value(6), sequence_id=31337, sequence_start=True)
    assert int(again.as_numpy("OUTPUT")[0, 0]) == 6


def test_an_idle_sequence_is_forgotten(served):
    r = connect_sync(served.redis_url, 2)
    key = contract.sequence(("short_idle", "1"), "i:9")
    with grpcclient.InferenceServerClient(served.address) as client:
        client.infer("short_idle", value(1), sequence_id=9, sequence_start=True)
        assert r.exists(key)
        poll(lambda: not r.exists(key), 5, "the idle sequence's state to expire")
        err = refused(lambda: client.infer("short_idle", value(1), sequence_id=9))
    assert "must specify the START flag" in err.message() and "max_sequence_idle_microseconds" in err.message()


def test_a_sequence_request_needs_a_sequence_id(served):
    with grpcclient.InferenceServerClient(served.address) as client:
        err = refused(lambda: client.infer("simple_sequence", value(1)))
    assert "StatusCode.INVALID_ARGUMENT" in str(err.status())
    assert err.message().startswith("inference request to model 'simple_sequence' must specify a non-zero or "
                                    "non-empty correlation ID")


def test_a_string_id_is_refused_where_corrid_is_an_integer(served):
    with grpcclient.InferenceServerClient(served.address) as client:
        err = refused(lambda: client.infer("accumulator", value(1), sequence_id="abc", sequence_start=True))
    assert "StatusCode.INVALID_ARGUMENT" in str(err.status()) and "CORRID" in err.message()


def test_an_id_past_the_corrid_type_is_refused_at_the_door_and_alone_on_the_executor(served, repo, redis_server):
    request = ipb.ModelInferRequest(model_name="accumulator32")
    request.inputs.add(name="INPUT", datatype="INT32", shape=[1, 1])
    request.raw_input_contents.append(np.array([[1]], np.int32).tobytes())
    request.parameters["sequence_id"].uint64_param = 2**31  # past INT32, the CORRID's type
    request.parameters["sequence_start"].bool_param = True
    with grpc.insecure_channel(served.address) as channel:
        stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sequence id 2147483648 does not fit" in info.value.details()
    # One that reached an executor anyway (queued by an older gateway) fails alone: its batch runs.
    model = load_model(repo / "accumulator32", repo / "accumulator32" / "1", read_config(repo / "accumulator32"),
                       ["CPUExecutionProvider"], "", 1)
    seq_id = uuid.uuid4().int % 10**9
    entries = [_step("ok-1", seq_id, 5, start=True), _step("bad", 0, 1, start=True), _step("ok-2", seq_id + 1, 2,
                                                                                          start=True)]
    bad = ipb.ModelInferRequest.FromString(entries[1][1])
    bad.parameters["sequence_id"].uint64_param = 2**31
    entries[1] = (entries[1][0], bad.SerializeToString())

    async def begin() -> list:
        store = ExecutorStore(connect(redis_server.url, 2), connect_blocking(redis_server.url, 2))
        try:
            members = [running.decoded(*e, model, pb.Batch(model_name="accumulator32"), "e") for e in entries]
            steps = await sequences.begin(store, model, members)
            return [m.error for m in members], [s.member.entry.request_id for s in steps]
        finally:
            await store.aclose()

    errors, runnable = asyncio.run(begin())
    assert runnable == ["ok-1", "ok-2"] and errors[0] is None and errors[2] is None
    assert "do not fit model 'accumulator32'" in str(errors[1])


def test_an_int64_id_names_the_sequence_of_its_64_bits_unsigned_as_in_triton(served):
    """Triton's correlation id is unsigned: an INT64 sequence_id of -1 continues the UINT64 sequence
    2^64 - 1, and an INT64 CORRID input reads it as -1 either way."""
    def step(seq_param: str, seq_id: int, v: int, start: bool = False):
        request = ipb.ModelInferRequest(model_name="accumulator")
        request.inputs.add(name="INPUT", datatype="INT32", shape=[1, 1])
        request.raw_input_contents.append(np.array([[v]], np.int32).tobytes())
        setattr(request.parameters["sequence_id"], seq_param, seq_id)
        request.parameters["sequence_start"].bool_param = start
        return request

    with grpc.insecure_channel(served.address) as channel:
        stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
        outputs = []
        for request in (step("uint64_param", 2**64 - 1, 5, start=True), step("int64_param", -1, 7)):
            response = stub.ModelInfer(request, timeout=30)
            got = {o.name: raw for o, raw in zip(response.outputs, response.raw_output_contents)}
            outputs.append((np.frombuffer(got["OUTPUT"], np.int32)[0], np.frombuffer(got["CORRID_OUT"], np.int64)[0]))
    assert outputs == [(5, -1), (12, -1)]


def test_a_sequence_request_carries_one_row(served):
    tensor = grpcclient.InferInput("INPUT", [2, 1], "INT32")
    tensor.set_data_from_numpy(np.ones((2, 1), np.int32))
    with grpcclient.InferenceServerClient(served.address) as client:
        err = refused(lambda: client.infer("accumulator", [tensor], sequence_id=5, sequence_start=True))
    assert "one row" in err.message()


def test_clients_see_neither_control_nor_state_tensors(served):
    with grpcclient.InferenceServerClient(served.address) as client:
        meta = client.get_model_metadata("accumulator")
    assert [i.name for i in meta.inputs] == ["INPUT"]
    assert sorted(o.name for o in meta.outputs) == ["CORRID_OUT", "ENDED", "OUTPUT"]


def test_model_config_shows_tritons_sequence_batching(served):
    with grpcclient.InferenceServerClient(served.address) as client:
        config = client.get_model_config("accumulator").config
    seq = config.sequence_batching
    assert not config.HasField("dynamic_batching") and seq.HasField("oldest")
    assert seq.max_sequence_idle_microseconds == 60_000_000
    kinds = {c.name: (c.control[0].kind, list(c.control[0].int32_false_true)) for c in seq.control_input}
    assert kinds == {"END": (2, [0, 1]), "READY": (1, [0, 1]), "CORRID": (3, [])}
    assert [(s.input_name, s.output_name, list(s.dims)) for s in seq.state] == [("ACC_IN", "ACC_OUT", [1])]


# -- a step run again, on the executor's own parts and a real Redis -----------------------------------


def _step(request_id: str, seq_id: int, v: int, start: bool = False) -> tuple[pb.QueueEntry, bytes]:
    request = ipb.ModelInferRequest(model_name="accumulator", id=request_id)
    request.inputs.add(name="INPUT", datatype="INT32", shape=[1, 1])
    request.raw_input_contents.append(np.array([[v]], np.int32).tobytes())
    request.parameters["sequence_id"].int64_param = seq_id
    request.parameters["sequence_start"].bool_param = start
    return pb.QueueEntry(request_id=request_id, rows=1, gateway_id="g"), request.SerializeToString()


def test_a_step_run_again_gives_the_same_answer_and_a_stale_run_is_refused(repo, redis_server):
    model = load_model(repo / "accumulator", repo / "accumulator" / "1", read_config(repo / "accumulator"),
                       ["CPUExecutionProvider"], "", 1)
    seq_id = uuid.uuid4().int % 10**9
    r = connect_sync(redis_server.url, 2)

    async def run(entry_blob, awaited: bool = True) -> tuple[int | None, str]:
        store = ExecutorStore(connect(redis_server.url, 2), connect_blocking(redis_server.url, 2))
        payload = contract.payload(("accumulator", "1"), entry_blob[0].request_id)
        if awaited:  # its payload there, as its gateway queued it; else answered or given up meanwhile
            r.set(payload, entry_blob[1], px=60_000)
        else:
            r.delete(payload)
        try:
            member = running.decoded(*entry_blob, model, pb.Batch(model_name="accumulator"), "e")
            steps = await sequences.begin(store, model, [member])
            if member.error is None:
                await running.run(model, [member])
                await sequences.finish(store, model, steps)
            if member.error is not None:
                return None, str(member.error)
            return int(member.outputs["OUTPUT"][0, 0]), ""
        finally:
            await store.aclose()

    first, second, third = (_step(f"a{seq_id}", seq_id, 5, start=True), _step(f"b{seq_id}", seq_id, 3),
                            _step(f"c{seq_id}", seq_id, 1))
    assert asyncio.run(run(first)) == (5, "")
    assert asyncio.run(run(second)) == (8, "")
    assert asyncio.run(run(second)) == (8, "")  # its executor died before answering: run again, same answer
    assert asyncio.run(run(third)) == (9, "")   # and the sequence goes on from the state it left
    answer, error = asyncio.run(run(second))    # a slow executor's run, after the sequence moved on
    assert answer is None and "ran already" in error
    # A run whose request is over (its gateway gave up, or another run answered it): not applied.
    answer, error = asyncio.run(run(_step(f"e{seq_id}", seq_id, 100), awaited=False))
    assert answer is None and "its step is not applied" in error
    assert asyncio.run(run(_step(f"d{seq_id}", seq_id, 10))) == (19, "")

    # Two runs of one request (its batch handed to another executor while the first was only slow),
    # the slow one reading the state before the other saved: the other's answer stands, and the
    # slow one sends none (its refusal could reach the gateway first).
    async def interleaved(entry_blob) -> tuple[bool, int | None]:
        store = ExecutorStore(connect(redis_server.url, 2), connect_blocking(redis_server.url, 2))
        r.set(contract.payload(("accumulator", "1"), entry_blob[0].request_id), entry_blob[1], px=60_000)
        try:
            slow = running.decoded(*entry_blob, model, pb.Batch(model_name="accumulator"), "slow")
            slow_steps = await sequences.begin(store, model, [slow])
            fast = running.decoded(*entry_blob, model, pb.Batch(model_name="accumulator"), "fast")
            fast_steps = await sequences.begin(store, model, [fast])
            await running.run(model, [fast])
            await sequences.finish(store, model, fast_steps)
            await running.run(model, [slow])
            await sequences.finish(store, model, slow_steps)
            return slow.answered_elsewhere, int(fast.outputs["OUTPUT"][0, 0])
        finally:
            await store.aclose()

    assert asyncio.run(interleaved(_step(f"f{seq_id}", seq_id, 1))) == (True, 20)
    r.close()


def _seq_request(seq_id: int, v: int, start: bool) -> ipb.ModelInferRequest:
    request = ipb.ModelInferRequest(model_name="accumulator", id=f"{seq_id}/{v}")
    request.parameters["sequence_id"].int64_param = seq_id
    request.parameters["sequence_start"].bool_param = start
    request.parameters["timeout"].int64_param = 30_000_000  # a bound far past what the test waits
    tensor = request.inputs.add(name="INPUT", datatype="INT32", shape=[1, 1])
    tensor.contents.int_contents.append(v)
    return request


def _queued_ids(r, key: str) -> list[str]:
    return [pb.QueueEntry.FromString(m).request_id for m in r.zrange(key, 0, -1)]


def _client_ids(r, key: str) -> list[str]:
    """The client's ids of the requests queued (their payloads'; the gateway names entries its own way)."""
    return [ipb.ModelInferRequest.FromString(r.get(contract.payload(("accumulator", "1"), rid)) or b"").id
            for rid in _queued_ids(r, key)]


@contextlib.contextmanager
def _undispatched(repo, redis_timeout: float = 2):
    """A mesh whose scheduler gives no executor any batch (the test plays the dispatch by hand), a
    Redis client, the accumulator's queue key and a gRPC stub."""
    from batchline.testing.in_process import InProcessMesh

    with InProcessMesh(None, str(repo), max_batches_per_executor=0) as m:
        r = connect_sync(m.redis_url, redis_timeout)
        channel = grpc.insecure_channel(m.address)
        try:
            yield m, r, contract.queue(("accumulator", "1")), inference_pb2_grpc.GRPCInferenceServiceStub(channel)
        finally:
            channel.close()
            r.close()


def test_a_sequence_request_given_up_after_its_dispatch_holds_the_next_until_it_has_run(repo):
    """A client gives up on a sequence request an executor has taken: the sequence's next request
    waits until that one's reply says it ran (else it could run beside it, on a state not saved
    yet); one given up while still queued is taken out at once and holds nothing."""
    with _undispatched(repo) as (m, r, key, stub):
        # Given up while queued: withdrawn, and the next is queued without waiting for its bound.
        # (Each step reads the queue once, by the clients' ids: a client's cancel reaches the
        # gateway when it does, and a request may still be on its way in when the next is sent.)
        first = stub.ModelInfer.future(_seq_request(41, 1, True), timeout=60)
        poll(lambda: _client_ids(r, key) == ["41/1"], 10, "the first request was never queued")
        first.cancel()
        second = stub.ModelInfer.future(_seq_request(41, 2, False), timeout=60)
        poll(lambda: _client_ids(r, key) == ["41/2"], 10, "the next request waited for a request that was only queued")
        second.cancel()
        poll(lambda: r.zcard(key) == 0, 10, "the second request was never withdrawn")

        # Given up after an executor took it (its entry left the queue, as a dispatch takes it).
        third = stub.ModelInfer.future(_seq_request(42, 1, True), timeout=60)
        poll(lambda: _client_ids(r, key) == ["42/1"], 10, "the third request was never queued")
        member = r.zrange(key, 0, -1)[0]
        taken = pb.QueueEntry.FromString(member)
        replies = m.gateway.gateway.replies
        # Given up only once the gateway has Redis's word that the write landed: before that it
        # takes the request out with its next write, as for one given up while its write goes out.
        poll(lambda: taken.request_id in replies.acknowledged, 10, "the gateway never saw the third's write land")
        r.zrem(key, member)
        third.cancel()
        poll(lambda: taken.request_id in replies.watched, 10, "the gateway never watched for the third's reply")
        assert taken.request_id not in replies.waiting  # nobody waits: a drain does not wait for it
        # Its payload stays, so that the executor that took it runs it (or refuses it past its
        # deadline) and answers: that answer is what lets the next request go.
        assert r.exists(contract.payload(("accumulator", "1"), taken.request_id))
        order, turn_key = m.gateway.gateway.sequences, ("accumulator", "1", "i:42")
        third_turn = order._last[turn_key]
        fourth = stub.ModelInfer.future(_seq_request(42, 2, False), timeout=60)
        # The fourth has taken its place behind the third, whose turn is held while it may run:
        # it is not queued.
        poll(lambda: order._last.get(turn_key) is not third_turn, 10, "the fourth request to wait for its turn")
        assert not third_turn.done() and r.zcard(key) == 0, "the next request went while the one before could run"
        # The executor's reply to the third (it ran): the fourth goes.
        reply = pb.Reply(request_id=taken.request_id, code=0)
        contract.push_with_ttl(r, contract.reply(taken.gateway_id), contract.REPLY_TTL, [reply.SerializeToString()])
        poll(lambda: r.zcard(key) == 1, 10, "the next request never went after the one before ran")
        assert taken.request_id not in replies.watched
        fourth.cancel()


def test_a_sequence_request_given_up_while_its_write_goes_out_holds_the_next_only_until_it_is_removed(repo):
    """A client gives up while the gateway's write of its request is still going out (Redis paused
    here): the request is removed right after its write, and the sequence's next request goes then,
    not at the given-up one's deadline plus its budget (a run of it, had one begun, could no longer
    save a state: its payload is gone)."""
    with _undispatched(repo, redis_timeout=5) as (m, r, key, stub):
        r.execute_command("CLIENT", "PAUSE", 1500, "WRITE")
        first = stub.ModelInfer.future(_seq_request(44, 1, True), timeout=120)
        poll(lambda: len(m.gateway.gateway.replies.waiting) == 1, 10, "the first request to reach its write")
        first.cancel()
        second = stub.ModelInfer.future(_seq_request(44, 2, False), timeout=120)
        began = time.monotonic()

        poll(lambda: _client_ids(r, key) == ["44/2"], 20, "the next request waited for the given-up one's bound")
        assert time.monotonic() - began < 15  # not the first's deadline plus its budget (60 s)
        second.cancel()


def test_a_sequence_is_its_tenants_another_tenant_with_the_same_id_has_its_own(repo, tmp_path):
    from batchline.testing.auth_files import token_entry, write_auth_file
    from batchline.testing.in_process import InProcessMesh

    auth = tmp_path / "auth.toml"
    write_auth_file(auth, token_entry("token-a", "a", ["accumulator"]), token_entry("token-b", "b", ["accumulator"]))
    with InProcessMesh(None, str(repo), gateway_overrides={"auth_file": str(auth)}) as m, \
            grpcclient.InferenceServerClient(m.address) as client:
        def step(token: str, v: int, start: bool = False) -> int:
            result = client.infer("accumulator", value(v), sequence_id=7, sequence_start=start,
                                  headers={"authorization": f"Bearer {token}"})
            return int(result.as_numpy("OUTPUT")[0, 0])

        assert step("token-a", 5, start=True) == 5
        # Tenant b cannot continue tenant a's sequence 7: for b, none is running.
        refused_continue = refused(lambda: step("token-b", 100))
        assert "START" in refused_continue.message()
        assert step("token-b", 100, start=True) == 100  # b's own sequence 7
        assert step("token-a", 1) == 6                  # a's goes on, untouched
        assert step("token-b", 1) == 101


def test_a_rate_capped_tenants_sequence_on_a_stream_runs_in_the_order_sent(repo, tmp_path):
    """On a stream, a sequence's requests pass the tenant's rate check one after another: were they
    concurrent, a later one whose check came back first could take the sequence's turn first (here
    the first check is slowed down to make it so) and run without the START the first carries."""
    from batchline.testing.auth_files import token_entry, write_auth_file
    from batchline.testing.in_process import InProcessMesh

    auth = tmp_path / "auth.toml"
    write_auth_file(auth, token_entry("token-a", "a", ["accumulator"]).replace("max_rate = 0", "max_rate = 1000"))
    with InProcessMesh(None, str(repo), gateway_overrides={"auth_file": str(auth)}) as m, \
            grpcclient.InferenceServerClient(m.address) as client:
        gateway, checks = m.gateway.gateway, []
        take_rate = gateway.take_rate

        async def first_slow(*args):
            checks.append(args)
            if len(checks) == 1:
                await asyncio.sleep(0.5)
            await take_rate(*args)

        gateway.take_rate = first_slow
        answers: queue.Queue = queue.Queue()
        client.start_stream(lambda result, error: answers.put((result, error)),
                            headers={"authorization": "Bearer token-a"})
        try:
            client.async_stream_infer("accumulator", value(5), sequence_id=9, sequence_start=True)
            client.async_stream_infer("accumulator", value(1), sequence_id=9)
            got = [answers.get(timeout=30) for _ in range(2)]
        finally:
            client.stop_stream()
        assert [e for _, e in got] == [None, None], [str(e) for _, e in got]
        assert [int(r.as_numpy("OUTPUT")[0, 0]) for r, _ in got] == [5, 6]


# -- the gateway's order and the config's checks, as pure units ------------------------------------


def test_a_request_that_gives_up_while_waiting_still_keeps_the_next_behind_the_one_before():
    async def scenario() -> list[str]:
        order, log = SequenceOrder(), []
        flags = SequenceFlags(7)
        first_may_end = asyncio.Event()

        async def request(name: str, hold: asyncio.Event | None = None) -> None:
            async with order.turn("m", "1", flags.key):
                log.append(f"{name} runs")
                if hold is not None:
                    await hold.wait()
            log.append(f"{name} over")

        first = asyncio.create_task(request("first", first_may_end))
        await asyncio.sleep(0)
        second = asyncio.create_task(request("second"))
        third = asyncio.create_task(request("third"))
        await asyncio.sleep(0)
        second.cancel()  # its client went away while it waited for the first
        await asyncio.gather(second, return_exceptions=True)
        await asyncio.sleep(0)
        log.append("first ends")
        first_may_end.set()
        await asyncio.gather(first, third)
        assert len(order) == 0  # nothing kept once the sequence's requests are over
        return log

    assert asyncio.run(scenario()) == ["first runs", "first ends", "first over", "third runs", "third over"]


def test_a_sequence_with_too_many_requests_waiting_refuses_more_and_keeps_the_rest_in_order():
    from batchline.errors import ResourceExhausted
    from gateway.sequences import MAX_WAITING

    async def scenario() -> tuple[list[int], str, int]:
        order, ran = SequenceOrder(), []
        flags = SequenceFlags(7)
        first_may_end = asyncio.Event()

        async def request(n: int) -> None:
            async with order.turn("m", "1", flags.key):
                ran.append(n)
                if n == 0:
                    await first_may_end.wait()

        tasks = [asyncio.create_task(request(0))]
        await asyncio.sleep(0)
        tasks += [asyncio.create_task(request(n)) for n in range(1, MAX_WAITING + 1)]
        await asyncio.sleep(0)
        with pytest.raises(ResourceExhausted) as refused:
            async with order.turn("m", "1", flags.key):
                pass
        async with order.turn("m", "1", SequenceFlags(8).key):  # another sequence is not held back
            pass
        first_may_end.set()
        await asyncio.gather(*tasks)
        return ran, str(refused.value), refused.value.retry_after_s

    ran, message, retry = asyncio.run(scenario())
    assert ran == list(range(MAX_WAITING + 1))
    assert f"{MAX_WAITING} requests of this sequence wait for their turn" in message and retry > 0


@pytest.mark.parametrize("config, problem", [
    (SequenceBatchingConfig(control={"GO": "start"}), "control input 'GO' is not an input of the graph"),
    (SequenceBatchingConfig(state={"ACC_IN": "NOPE"}), "state output 'NOPE' is not an output of the graph"),
    (SequenceBatchingConfig(state={"INPUT": "OUTPUT"}), "must have one fixed shape"),
])
def test_a_sequence_config_that_does_not_fit_the_graph_names_what_is_wrong(config, problem):
    info = pb.ModelInfo(name="m", max_batch_size=8, inputs=[
        pb.TensorSpec(name="INPUT", datatype="INT32", shape=[-1, -1]),
        pb.TensorSpec(name="ACC_IN", datatype="INT32", shape=[-1, 1])],
        outputs=[pb.TensorSpec(name="OUTPUT", datatype="INT32", shape=[-1, -1])])
    with pytest.raises(ValueError, match=problem):
        split_graph("m/config.toml", info, config, decoupled=False)


def test_a_state_read_for_a_step_does_not_expire_while_the_step_runs(redis_server):
    store = ExecutorStore(connect(redis_server.url, 2), connect_blocking(redis_server.url, 2))
    r = connect_sync(redis_server.url, 2)
    key = contract.sequence(("accumulator", "1"), "i:77")
    r.hset(key, mapping={"steps": 1, "state": b"saved"})
    r.pexpire(key, 50)  # about to expire, idle nearly as long as the model allows

    async def read() -> list:
        try:
            return await store.sequence_states(("accumulator", "1"), ["i:77", "i:78"], 5_000)
        finally:
            await store.aclose()

    assert asyncio.run(read()) == [b"saved", None]
    assert r.pttl(key) > 1_000  # the idle time counts again from the read
    r.delete(key)
    r.close()
