"""Generation through the mesh: a stock tritonclient sends a prompt to the gateway, an executor's
generation engine makes the tokens, and they come back streamed (ModelStreamInfer, the first token
alone, then a few a response, the last flagged final) or whole (ModelInfer); greedy outputs equal
transformers' generate."""
from __future__ import annotations

import asyncio
import http.client
import json
import queue
import socket
from functools import partial

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from tritonclient.utils import InferenceServerException

from batchline import demo_decoder
from batchline.testing.decoder import Reference, build_gpt
from batchline.testing.polling import poll

FINAL = "triton_final_response"
PROMPTS = ["def main(", "The tuple", "import", "x = [1, 2, 3]\nfor i in x:", "é"]


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("repo")
    build_gpt(root)
    return root


@pytest.fixture(scope="module")
def served(repo):
    from batchline.testing.in_process import InProcessMesh

    with InProcessMesh(None, str(repo)) as m:
        yield m


@pytest.fixture(scope="module")
def reference():
    return Reference()


@pytest.fixture(scope="module")
def tokenizer(repo):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(repo / "gpt" / "tokenizer" / "tokenizer.json"))


def text_input(prompt: str, input_class=grpcclient.InferInput):
    tensor = input_class("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    return [tensor]


def greedy(max_tokens: int, **more) -> dict:
    return {"max_tokens": max_tokens, "temperature": 0, **more}


def expected(reference, tokenizer, prompt: str, max_tokens: int) -> list[int]:
    return reference.greedy(tokenizer.encode(prompt, add_special_tokens=False).ids, max_tokens)


def stream(address: str, prompts: list[str], parameters: dict) -> dict[str, list]:
    """Each prompt on one stream (request id = its index): its results in arrival order."""
    got: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(address) as client:
        client.start_stream(callback=partial(lambda q, result, error: q.put(error or result), got))
        for i, prompt in enumerate(prompts):
            client.async_stream_infer("gpt", text_input(prompt), request_id=str(i), parameters=parameters)
        client.stop_stream()
    by_id: dict[str, list] = {str(i): [] for i in range(len(prompts))}
    while not got.empty():
        result = got.get_nowait()
        if isinstance(result, InferenceServerException):
            raise result
        by_id[result.get_response().id].append(result)
    return by_id


def test_a_unary_infer_returns_the_whole_greedy_text(served, reference, tokenizer):
    with grpcclient.InferenceServerClient(served.address) as client:
        assert client.is_model_ready("gpt")
        assert [(m.name, m.state) for m in client.get_model_repository_index().models] == [("gpt", "READY")]
        config = client.get_model_config("gpt").config
        assert config.model_transaction_policy.decoupled
        assert [i.name for i in config.input] == ["text_input", "input_ids"]
        for prompt in PROMPTS[:3]:
            result = client.infer("gpt", text_input(prompt), parameters=greedy(12))
            want = expected(reference, tokenizer, prompt, 12)
            assert result.as_numpy("token_ids").tolist() == want
            assert result.as_numpy("text_output")[0].decode() == tokenizer.decode(want, skip_special_tokens=True)


def test_a_stream_sends_the_first_token_alone_then_several_a_response_the_last_flagged_final(
        served, reference, tokenizer):
    results = stream(served.address, PROMPTS, greedy(10))
    for i, prompt in enumerate(PROMPTS):
        want = expected(reference, tokenizer, prompt, 10)
        got = results[str(i)]
        tokens = [r.as_numpy("token_ids").tolist() for r in got]
        assert sum(tokens, []) == want
        assert len(tokens[0]) == 1, "the first token goes out at once, alone"
        assert len(tokens) < len(want), "the tokens after the first go a few a response"
        assert [r.get_response().parameters[FINAL].bool_param for r in got] == [False] * (len(got) - 1) + [True]
        text = "".join(r.as_numpy("text_output")[0].decode() for r in got)
        assert text == tokenizer.decode(want, skip_special_tokens=True)


def test_64_concurrent_asyncio_requests_each_get_their_greedy_tokens(served, reference, tokenizer):
    from batchline.testing.decoder import mixed_prompts

    prompts, want = [], []
    for candidate in mixed_prompts(96, seed=3):
        text = tokenizer.decode(candidate[:60])
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        tokens = reference.greedy(ids, 16)
        if reference.clear(ids, tokens) and len(prompts) < 64:  # near ties are decided by rounding
            prompts.append(text)
            want.append(tokens)
    assert len(prompts) == 64

    async def run() -> list[list[int]]:
        async with aioclient.InferenceServerClient(served.address) as client:
            inputs = [text_input(p, aioclient.InferInput) for p in prompts]
            results = await asyncio.gather(*(client.infer("gpt", x, parameters=greedy(16)) for x in inputs))
        return [r.as_numpy("token_ids").tolist() for r in results]

    assert asyncio.run(run()) == want


def test_bad_parameters_are_refused_with_what_to_fix(served):
    sent = served.scheduler.scheduler.counts["requests"]
    with grpcclient.InferenceServerClient(served.address) as client:
        with pytest.raises(InferenceServerException, match="top_p must be in") as err:
            client.infer("gpt", text_input("x"), parameters={"top_p": "2.0"})
        assert "INVALID_ARGUMENT" in str(err.value.status())
        with pytest.raises(InferenceServerException, match="parameter 'max_tokens' must be a int64"):
            client.infer("gpt", text_input("x"), parameters={"max_tokens": "many"})
    assert served.scheduler.scheduler.counts["requests"] == sent  # refused at the door: none was queued


def test_seeded_sampling_is_repeatable(served):
    params = {"max_tokens": 12, "temperature": "0.9", "top_k": 50, "seed": 7}
    with grpcclient.InferenceServerClient(served.address) as client:
        first = client.infer("gpt", text_input("The"), parameters=params).as_numpy("token_ids").tolist()
        second = client.infer("gpt", text_input("The"), parameters=params).as_numpy("token_ids").tolist()
    assert first == second
    assert len(first) == 12 and all(0 <= t < demo_decoder.VOCAB_SIZE for t in first)


def test_a_cancelled_stream_frees_its_cache(served):
    engine = served.executors[0].generators[0].engine
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(served.address)
    try:
        client.start_stream(callback=partial(lambda q, result, error: q.put(error or result), got))
        client.async_stream_infer("gpt", text_input("The"), request_id="long",
                                  parameters={"max_tokens": 200, "ignore_eos": True, "temperature": 0})
        first = got.get(timeout=30)
        assert not isinstance(first, InferenceServerException), first
        assert engine.running, "the sequence runs while the stream is open"
        client.stop_stream(cancel_requests=True)
    finally:
        client.close()
    poll(lambda: not engine.running and not engine.waiting and engine.cache.free == engine.cache.slots, 10,
         "the cancelled sequence to leave the engine")
    assert got.qsize() < 199, "the sequence ended before its 200 tokens"


def test_generation_metrics_count_tokens_and_time_them(served):
    from prometheus_client import REGISTRY

    def sample(name: str) -> float:
        return REGISTRY.get_sample_value(name, {"model": "gpt", "version": "1"}) or 0.0

    before = {n: sample(n) for n in ("batchline_generation_tokens_total",
                                     "batchline_generation_time_to_first_token_seconds_count",
                                     "batchline_generation_time_per_output_token_seconds_count")}
    with grpcclient.InferenceServerClient(served.address) as client:
        result = client.infer("gpt", text_input("import"), parameters={"max_tokens": 9, "ignore_eos": True})
    assert len(result.as_numpy("token_ids")) == 9
    assert sample("batchline_generation_tokens_total") - before["batchline_generation_tokens_total"] == 9
    assert sample("batchline_generation_time_to_first_token_seconds_count") == \
        before["batchline_generation_time_to_first_token_seconds_count"] + 1
    assert sample("batchline_generation_time_per_output_token_seconds_count") == \
        before["batchline_generation_time_per_output_token_seconds_count"] + 1
    assert sample("batchline_generation_running_sequences") == 0
    assert sample("batchline_generation_cache_use") == 0


def test_admission_refuses_at_once_what_no_executor_can_meet(served):
    tiny = {"max_tokens": 2, "temperature": 0, "ttft_ms": "0.001"}

    def refused() -> InferenceServerException | None:
        # Admitted until an executor has measured its costs and registered them; and refused for a
        # full cache while a registration from an earlier test's load is still the newest.
        try:
            client.infer("gpt", text_input("a prompt of a few tokens"), parameters=tiny)
        except InferenceServerException as exc:
            return exc if "ttft_ms" in (exc.message() or "") else None
        return None

    with grpcclient.InferenceServerClient(served.address) as client:
        exc = poll(refused, 20, "the learned costs to refuse a budget of 1 µs to the first token")
        assert "RESOURCE_EXHAUSTED" in str(exc.status())
        assert "ttft_ms 0.001 ms" in exc.message() and "retry in" in exc.message()
        ok = client.infer("gpt", text_input("a prompt"), parameters={**tiny, "ttft_ms": 60_000, "tpot_ms": 10_000})
        assert len(ok.as_numpy("token_ids")) == 2
        with pytest.raises(InferenceServerException, match="'tpot_ms' must be milliseconds >= 0") as err:
            client.infer("gpt", text_input("x"), parameters={"tpot_ms": -5})
        assert "INVALID_ARGUMENT" in str(err.value.status())


def test_a_prompt_of_token_ids_is_continued_as_its_text_would_be(served, reference):
    prompt = [464, 1000, 17, 3000, 42]
    ids = grpcclient.InferInput("input_ids", [len(prompt)], "INT64")
    ids.set_data_from_numpy(np.array(prompt, np.int64))
    with grpcclient.InferenceServerClient(served.address) as client:
        result = client.infer("gpt", [ids], parameters=greedy(10))
        want = reference.greedy(prompt, 10)
        assert reference.clear(prompt, want)
        assert result.as_numpy("token_ids").tolist() == want
        both = text_input("x") + [ids]
        with pytest.raises(InferenceServerException, match="one of \\['text_input', 'input_ids'\\], not both"):
            client.infer("gpt", both)
        bad = grpcclient.InferInput("input_ids", [1], "INT64")
        bad.set_data_from_numpy(np.array([demo_decoder.VOCAB_SIZE], np.int64))
        with pytest.raises(InferenceServerException, match="not in the tokenizer's 4096 ids") as err:
            client.infer("gpt", [bad])
        assert "INVALID_ARGUMENT" in str(err.value.status())


def _post_generate(address: str, path: str, body: dict) -> tuple[int, dict, bytes]:
    host, port = address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        connection.request("POST", path, body=json.dumps(body).encode())
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def _events(body: bytes) -> list[dict]:
    assert body.endswith(b"\n\n"), body[-40:]
    return [json.loads(chunk.removeprefix(b"data: ")) for chunk in body.split(b"\n\n") if chunk]


def test_rest_generate_answers_the_grpc_greedy_text(served):
    parameters = greedy(12)
    with grpcclient.InferenceServerClient(served.address) as client:
        want = client.infer("gpt", text_input("def main("), parameters=parameters)
    status, headers, body = _post_generate(served.http_address, "/v2/models/gpt/generate",
                                           {"id": "g1", "text_input": "def main(", "parameters": parameters})
    assert status == 200, body
    assert headers["content-type"] == "application/json"
    answer = json.loads(body)
    assert answer["text_output"] == want.as_numpy("text_output")[0].decode()
    assert answer["token_ids"] == want.as_numpy("token_ids").tolist()
    assert (answer["model_name"], answer["model_version"], answer["id"]) == ("gpt", "1", "g1")
    prompt = [464, 1000, 17, 3000, 42]
    ids = grpcclient.InferInput("input_ids", [len(prompt)], "INT64")
    ids.set_data_from_numpy(np.array(prompt, np.int64))
    with grpcclient.InferenceServerClient(served.address) as client:
        want = client.infer("gpt", [ids], parameters=parameters).as_numpy("token_ids").tolist()
    status, _, body = _post_generate(served.http_address, "/v2/models/gpt/generate",
                                     {"input_ids": prompt, "parameters": parameters})
    assert status == 200 and json.loads(body)["token_ids"] == want, body


def test_rest_generate_reads_top_level_fields_as_triton_does(served):
    # TensorRT-LLM's examples send the sampling parameters beside the prompt, and fields the model
    # does not read ("bad_words"): a field that names no input is a request parameter, as in Triton.
    parameters = greedy(9)
    status, _, body = _post_generate(served.http_address, "/v2/models/gpt/generate",
                                     {"text_input": "def main(", "parameters": parameters})
    assert status == 200, body
    want = json.loads(body)["token_ids"]
    status, _, body = _post_generate(served.http_address, "/v2/models/gpt/generate",
                                     {"text_input": "def main(", "bad_words": "", "stop_words": "", **parameters})
    assert status == 200, body
    assert json.loads(body)["token_ids"] == want
    # An input given in `parameters` is the input, and a scalar is a one-element tensor.
    status, _, body = _post_generate(served.http_address, "/v2/models/gpt/generate",
                                     {"parameters": {"input_ids": 464, **greedy(9, ignore_eos=True)}})
    assert status == 200 and len(json.loads(body)["token_ids"]) == 9, body


def test_rest_generate_stream_sends_an_event_per_response(served):
    parameters = greedy(10)
    with grpcclient.InferenceServerClient(served.address) as client:
        want = client.infer("gpt", text_input("The tuple"), parameters=parameters)
    status, headers, body = _post_generate(served.http_address, "/v2/models/gpt/versions/1/generate_stream",
                                           {"text_input": "The tuple", "parameters": parameters})
    assert status == 200, body
    assert headers["content-type"] == "text/event-stream; charset=utf-8"
    events = _events(body)
    assert sum((e["token_ids"] for e in events), []) == want.as_numpy("token_ids").tolist()
    assert "".join(e["text_output"] for e in events) == want.as_numpy("text_output")[0].decode()


def test_rest_generate_stream_events_come_as_tokens_are_made(served):
    from prometheus_client import REGISTRY

    def tokens() -> float:
        return REGISTRY.get_sample_value("batchline_generation_tokens_total", {"model": "gpt", "version": "1"}) or 0.0

    engine = served.executors[0].generators[0].engine
    before = tokens()
    host, port = served.http_address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        connection.request("POST", "/v2/models/gpt/generate_stream", body=json.dumps(
            {"text_input": "The", "parameters": {"max_tokens": 200, "ignore_eos": True, "temperature": 0}}))
        response = connection.getresponse()
        assert response.status == 200
        first = json.loads(response.readline().removeprefix(b"data: "))
        assert len(first["token_ids"]) == 1
        assert engine.running, "the first event came before the sequence ended"
    finally:
        connection.close()
    poll(lambda: not engine.running and engine.cache.free == engine.cache.slots, 10,
         "the sequence of a client that went away to leave the engine")
    assert tokens() - before < 199, "the sequence ended before its 200 tokens"


def test_rest_generate_of_a_client_that_hangs_up_stops_its_sequence(served):
    # Unary generate sends nothing until the sequence ends: only the hang-up itself can stop it.
    engine = served.executors[0].generators[0].engine
    host, port = served.http_address.rsplit(":", 1)
    body = json.dumps({"text_input": "The", "parameters": {"max_tokens": 240, "ignore_eos": True,
                                                           "temperature": 0}}).encode()
    head = (f"POST /v2/models/gpt/generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((host, int(port)), timeout=10) as client:
        client.sendall(head + body)
        poll(lambda: engine.running, 10, "the sequence to start")
        sequence = engine.running[0]
    poll(lambda: not engine.running and engine.cache.free == engine.cache.slots, 10,
         "the sequence of a client that hung up to leave the engine")
    assert len(sequence.output) < 240, "the sequence ran to its end: the hang-up did not stop it"


def test_rest_generate_refuses_bad_input_with_400(served):
    for path in ("generate", "generate_stream"):
        status, _, body = _post_generate(served.http_address, f"/v2/models/gpt/{path}",
                                         {"text_input": "x", "parameters": {"top_p": "2.0"}})
        assert status == 400 and "top_p must be in" in json.loads(body)["error"], body
    status, _, body = _post_generate(served.http_address, "/v2/models/gpt/generate", {"text_input": {"a": 1}})
    assert status == 400 and "'text_input' must be a value or a flat list" in json.loads(body)["error"]
    status, _, body = _post_generate(served.http_address, "/v2/models/gpt/generate", {"input_ids": ["a"]})
    assert status == 400 and "'input_ids' is INT64: 'input_ids' must hold integers" in json.loads(body)["error"]
    status, _, body = _post_generate(served.http_address, "/v2/models/gpt/generate", {"parameters": {}})
    assert status == 400 and "`text_input` (a string)" in json.loads(body)["error"]
    status, _, body = _post_generate(served.http_address, "/v2/models/gpt/generate",
                                     {"text_input": "x", "max_tokens": 4, "parameters": {"max_tokens": 4}})
    assert status == 400 and "'max_tokens' is given twice" in json.loads(body)["error"]
    status, _, body = _post_generate(served.http_address, "/v2/models/nope/generate", {"text_input": "x"})
    assert status == 404, body


def test_generation_batches_teach_the_scheduler_no_latency_profile(served):
    # A generation batch lasts its whole answer; the scheduler places sequences by free slots and
    # plans no run time for them, so a profile learned from those batches would be used by nothing.
    from batchline.contract.keys import REPORTS
    from batchline.redis_client import connect_sync

    with grpcclient.InferenceServerClient(served.address) as client:
        client.infer("gpt", text_input("import"), parameters={"max_tokens": 6, "ignore_eos": True})
    redis = connect_sync(served.redis_url, 2)
    # The batch's report is written with its final reply: once the list is empty the scheduler took it.
    poll(lambda: redis.llen(REPORTS) == 0, 10, "the scheduler to take the execution reports")
    profiles = served.scheduler.scheduler.profiles.by_key
    assert not [key for key in profiles if key[0] == "gpt"], profiles


def test_the_record_of_tokens_sent_goes_with_the_finished_request(served):
    # The record is what an executor taking an unfinished request over continues from; once the
    # request is answered nothing reads it, so it goes with the payload rather than expire later.
    from batchline.contract import keys
    from batchline.redis_client import connect_sync

    redis = connect_sync(served.redis_url, 2)
    records = keys.generated(("gpt", "1"), "*")
    before = set(redis.keys(records))
    results = stream(served.address, ["import os", "def main"], greedy(24, ignore_eos=True))
    for got in results.values():
        assert sum(len(r.as_numpy("token_ids")) for r in got) == 24
        assert len(got) > 2, "tokens went in several responses: a record was written"
    assert set(redis.keys(records)) <= before
