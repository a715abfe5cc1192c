"""Decoupled models on ModelStreamInfer: zero, one or many responses per request, the last one
flagged `triton_final_response`, as Triton sends them (a stock tritonclient reads them)."""
from __future__ import annotations

import asyncio
import queue
import uuid
from functools import partial

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from batchline.contract.executor_store import ExecutorStore
from batchline.contract.gateway_store import GatewayStore
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import internal_pb2 as pb
from batchline.redis_client import connect, connect_blocking
from executor.sequence_config import split_graph
from gateway.replies import Replies
from batchline.testing.stateful_models import save_repeat_int32

FINAL = "triton_final_response"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from batchline.testing.in_process import InProcessMesh

    repo = tmp_path_factory.mktemp("repo")
    save_repeat_int32(repo)
    with InProcessMesh(None, str(repo)) as m:
        yield m


def repeat_inputs(values: list[int]) -> list[grpcclient.InferInput]:
    n = len(values)
    inputs = [grpcclient.InferInput("IN", [n], "INT32"), grpcclient.InferInput("DELAY", [n], "UINT32"),
              grpcclient.InferInput("WAIT", [1], "UINT32")]
    inputs[0].set_data_from_numpy(np.array(values, np.int32))
    inputs[1].set_data_from_numpy(np.zeros(n, np.uint32))
    inputs[2].set_data_from_numpy(np.zeros(1, np.uint32))
    return inputs


def stream(address: str, requests: list[tuple[str, list[int]]], empty_final: bool) -> list:
    """Send `requests` (id, IN) on one stream and close it: every result (or error) it carried,
    in arrival order (closing waits for the stream's end, which comes after every answer)."""
    got: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(address) as client:
        client.start_stream(callback=partial(lambda q, result, error: q.put(error or result), got))
        for request_id, values in requests:
            client.async_stream_infer("repeat_int32", repeat_inputs(values), request_id=request_id,
                                      enable_empty_final_response=empty_final)
        client.stop_stream()
    return [got.get_nowait() for _ in range(got.qsize())]


def final(result) -> bool:
    return result.get_response().parameters[FINAL].bool_param


def test_each_row_is_a_response_in_order_and_the_end_comes_empty_when_asked(served):
    results = stream(served.address, [("a", [5, 6, 7])], True)
    assert [r.as_numpy("OUT").tolist() for r in results[:3]] == [[5], [6], [7]]
    assert [r.as_numpy("IDX").tolist() for r in results[:3]] == [[0], [1], [2]]
    assert [final(r) for r in results] == [False, False, False, True]
    assert results[3].get_response().id == "a" and not results[3].get_response().outputs


def test_zero_responses_end_with_the_empty_final_response_only(served):
    results = stream(served.address, [("none", []), ("one", [9])], True)
    by_id: dict[str, list] = {}
    for r in results:
        by_id.setdefault(r.get_response().id, []).append(r)
    assert [final(r) for r in by_id["none"]] == [True] and not by_id["none"][0].get_response().outputs
    assert [(r.as_numpy("OUT") is not None, final(r)) for r in by_id["one"]] == [(True, False), (False, True)]


def test_without_asking_no_empty_final_response_is_sent(served):
    results = stream(served.address, [("x", [1, 2]), ("y", [3]), ("z", [])], False)
    assert all(not final(r) and r.get_response().outputs for r in results)
    assert sorted(r.get_response().id for r in results) == ["x", "x", "y"]
    assert [r.as_numpy("OUT").tolist() for r in results if r.get_response().id == "x"] == [[1], [2]]


def test_model_infer_refuses_a_decoupled_model_in_tritons_words(served):
    with grpcclient.InferenceServerClient(served.address) as client:
        with pytest.raises(InferenceServerException) as err:
            client.infer("repeat_int32", repeat_inputs([1]))
    assert "StatusCode.INVALID_ARGUMENT" in str(err.value.status())
    assert "ModelInfer RPC doesn't support models with decoupled transaction policy" in err.value.message()
    assert "ModelStreamInfer" in err.value.message()


def test_metadata_shows_one_responses_outputs(served):
    with grpcclient.InferenceServerClient(served.address) as client:
        meta = client.get_model_metadata("repeat_int32")
    assert {o.name: list(o.shape) for o in meta.outputs} == {"OUT": [1], "IDX": [1]}


def test_model_config_says_decoupled(served):
    with grpcclient.InferenceServerClient(served.address) as client:
        assert client.get_model_config("repeat_int32").config.model_transaction_policy.decoupled


def test_an_answer_read_before_its_write_was_acknowledged_leaves_nothing_behind():
    # A fast executor on a busy loop: the reply is read before the writer resumes after its commit.
    async def scenario() -> Replies:
        replies = Replies(store=None, gateway_id="g")
        fut = replies.expect("r")
        replies._answer(pb.Reply(request_id="r").SerializeToString())
        replies.queued("r", ("m", "1"))
        await fut
        return replies

    replies = asyncio.run(scenario())
    assert not replies.acknowledged and not replies.waiting


def test_a_response_sent_twice_is_forwarded_once_in_order():
    # A batch run again (its executor died after sending some responses) sends them again.
    async def scenario() -> tuple[list[int], pb.Reply]:
        replies = Replies(store=None, gateway_id="g")
        seen: list[int] = []
        fut = replies.expect("r", lambda response: seen.append(response.outputs[0].shape[0]))

        def send(index: int, partial: bool = True) -> None:
            response = ipb.ModelInferResponse(outputs=[ipb.ModelInferResponse.InferOutputTensor(shape=[index])])
            replies._answer(pb.Reply(request_id="r", partial=partial, index=index,
                                     response=response).SerializeToString())

        for i in (0, 1, 0, 1, 2):
            send(i)
        send(3, partial=False)
        return seen, await fut

    seen, last = asyncio.run(scenario())
    assert seen == [0, 1, 2]
    assert not last.partial and last.index == 3


def test_a_decoupled_model_must_run_each_request_alone():
    info = pb.ModelInfo(name="m", max_batch_size=4, outputs=[pb.TensorSpec(name="OUT", shape=[-1, 1])])
    with pytest.raises(ValueError, match="decoupled = true needs max_batch_size = 0"):
        split_graph("m/config.toml", info, None, decoupled=True)


def test_responses_reach_the_client_before_the_request_is_done(redis_server):
    # What a generation loop does: push each response as it has it, the end only later.
    async def scenario() -> None:
        url = redis_server.url
        gateway_id = f"gw-{uuid.uuid4().hex[:8]}"
        executor = ExecutorStore(connect(url, 2), connect_blocking(url, 2))
        replies = Replies(GatewayStore(connect(url, 2), connect_blocking(url, 2)), gateway_id)
        reader = asyncio.create_task(replies.read())
        got: asyncio.Queue = asyncio.Queue()
        try:
            fut = replies.expect("r", got.put_nowait)
            for i in range(3):
                response = ipb.ModelInferResponse(id=f"token-{i}")
                await executor.send_replies({gateway_id: [
                    pb.Reply(request_id="r", partial=True, index=i, response=response).SerializeToString()]})
                assert (await asyncio.wait_for(got.get(), 10)).id == f"token-{i}"
                assert not fut.done()  # the request goes on
            await executor.send_replies({gateway_id: [pb.Reply(request_id="r", index=3).SerializeToString()]})
            last = await asyncio.wait_for(fut, 10)
            assert not last.HasField("response") and "r" not in replies.partial
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            await executor.aclose()
            await replies.store.aclose()

    asyncio.run(scenario())


def test_rest_infer_refuses_a_decoupled_model_in_tritons_http_words(served):
    client = th.InferenceServerClient(served.http_address)
    try:
        arrays = {"IN": np.array([1], np.int32), "DELAY": np.zeros(1, np.uint32), "WAIT": np.zeros(1, np.uint32)}
        inputs = [th.InferInput(name, list(a.shape), "INT32" if name == "IN" else "UINT32")
                  for name, a in arrays.items()]
        for i, a in zip(inputs, arrays.values()):
            i.set_data_from_numpy(a)
        with pytest.raises(InferenceServerException) as err:
            client.infer("repeat_int32", inputs)
    finally:
        client.close()
    assert err.value.status() == "400"
    assert "HTTP end point doesn't support models with decoupled transaction policy" in err.value.message()
    assert "ModelStreamInfer" in err.value.message()


def test_a_scalar_output_fails_its_request_alone_with_what_is_wrong():
    """A decoupled model whose graph gives a scalar has no first dim to count responses by: that
    request is refused, named, and no exception fails the batch INTERNAL."""
    import types

    from executor import decoupled
    from executor.running import Member

    info = pb.ModelInfo(name="scalar", version="1", outputs=[pb.TensorSpec(name="OUT", datatype="INT32")])
    model = types.SimpleNamespace(name="scalar", version="1", info=info)  # replies() reads only these
    m = Member(pb.QueueEntry(request_id="r"))
    m.request, m.outputs = ipb.ModelInferRequest(model_name="scalar"), {"OUT": np.array(3, np.int32)}
    partial, final = decoupled.replies(model, m)  # type: ignore[arg-type]
    assert partial == [] and final.code != 0 and "scalar output(s) ['OUT']" in final.message


def test_a_stream_that_does_not_read_has_its_next_request_read_only_once_it_reads(served, monkeypatch):
    """A client that sends and does not read leaves its answers in the gateway: past the stream's
    backlog limit the gateway reads its next request only once the client has read enough."""
    import grpc
    from prometheus_client import REGISTRY

    from tritonclient.grpc import service_pb2, service_pb2_grpc

    from gateway import stream_backlog

    monkeypatch.setattr(stream_backlog, "LIMIT_BYTES", 4096)

    def answered() -> float:
        return REGISTRY.get_sample_value("batchline_request_success_total",
                                         {"model": "repeat_int32", "version": "1"}) or 0.0

    def request(request_id: str, values: list[int]):
        r = service_pb2.ModelInferRequest(model_name="repeat_int32", id=request_id)
        # Budgets out of the way: this is about a stream's backlog, not admission, whose line fitted
        # to the module's one-row runs on a busy host can predict 3,000 rows past the default budget.
        r.parameters["timeout"].int64_param = 600_000_000
        for i in repeat_inputs(values):
            r.inputs.append(i._get_tensor())
            r.raw_input_contents.append(i._get_content())
        return r

    async def scenario() -> None:
        sends: asyncio.Queue = asyncio.Queue()

        async def outgoing():
            while (r := await sends.get()) is not None:
                yield r

        # Without BDP probing the client's transport takes about 130 KB that it does not read, not MBs.
        async with grpc.aio.insecure_channel(served.address, options=[("grpc.http2.bdp_probe", 0)]) as channel, \
                grpc.aio.insecure_channel(served.address) as other:
            stub, other_stub = service_pb2_grpc.GRPCInferenceServiceStub(channel), \
                service_pb2_grpc.GRPCInferenceServiceStub(other)
            before = answered()
            call = stub.ModelStreamInfer(outgoing())
            await sends.put(request("many", list(range(3000))))  # about 300 KB of responses
            deadline = asyncio.get_running_loop().time() + 30
            while answered() < before + 1:  # the gateway has every one of them, unread
                if asyncio.get_running_loop().time() > deadline:
                    first = await asyncio.wait_for(call.read(), 5)
                    raise AssertionError(f"the first request was never answered: {first.error_message or first}")
                await asyncio.sleep(0.02)
            await sends.put(request("next", [1]))
            # Another stream's request sent after it goes all the way round; "next" is not read.
            side = other_stub.ModelStreamInfer(iter([request("side", [2])]))
            got = [r async for r in side]
            assert got[0].infer_response.id == "side" and not got[0].error_message
            assert answered() == before + 2, "the stream's next request ran while its client read nothing"
            seen = []
            while not seen or seen[-1] != "next":
                reply = await asyncio.wait_for(call.read(), 30)
                seen.append(reply.infer_response.id)
            await sends.put(None)
            # The stream ends once its last request has ended (counted), which may come after its response.
            while (reply := await asyncio.wait_for(call.read(), 30)) is not grpc.aio.EOF:
                seen.append(reply.infer_response.id)
            assert seen == ["many"] * 3000 + ["next"]
            assert answered() == before + 3

    asyncio.run(scenario())
