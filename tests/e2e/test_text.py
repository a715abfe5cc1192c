"""Text in: the demo minilm takes sentences (tokenized by the gateway) through stock tritonclient,
sync, aio and streaming, and answers what sentence-transformers' encode() gives; bad text gets
INVALID_ARGUMENT naming the element."""
from __future__ import annotations

import asyncio
import queue
import shutil

import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.grpc.aio as tca
from tritonclient.utils import InferenceServerException

from batchline import demo_models
from batchline.bench.sentences import python_doc_sentences

SHORT = ["hello world", "Batching puts requests of similar length together.", "é ü 漢字 — ok"]


@pytest.fixture(scope="module")
def served(model_repository, tmp_path_factory):
    from batchline.testing.in_process import InProcessMesh

    repo = tmp_path_factory.mktemp("text") / "repository"
    shutil.copytree(model_repository / "minilm", repo / "minilm")
    with InProcessMesh(None, str(repo), models=["minilm"]) as m:
        yield m, repo


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(demo_models.minilm_package_dir()), device="cpu")


def _text(sentences: list[str], mod=tc) -> tc.InferInput:
    inp = mod.InferInput("text", [len(sentences), 1], "BYTES")
    inp.set_data_from_numpy(np.array([[s.encode()] for s in sentences], dtype=object))
    return inp


def _mixed() -> list[str]:
    """32 sentences of very different lengths, the longest past the 256 tokens the model takes."""
    pool = sorted(python_doc_sentences(400), key=len)
    picked = [pool[i * (len(pool) - 1) // 30] for i in range(31)]
    return picked + [" ".join(pool[-40:])]  # far over 256 tokens: truncated, as encode() does


def _close(got: np.ndarray, want: np.ndarray) -> None:
    cos = np.sum(got * want, axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cos.min() >= 0.9999, cos.min()
    assert np.abs(got - want).max() <= 1e-4


def test_metadata_shows_the_text_input_beside_the_token_ids(served):
    m, _ = served
    with tc.InferenceServerClient(m.address) as client:
        meta = client.get_model_metadata("minilm")
        config = client.get_model_config("minilm").config
    assert [(i.name, i.datatype, list(i.shape)) for i in meta.inputs] == [
        ("input_ids", "INT64", [-1, -1]), ("attention_mask", "INT64", [-1, -1]), ("text", "BYTES", [-1, 1])]
    assert [i.name for i in config.input] == ["input_ids", "attention_mask", "text"]


def test_text_through_the_sync_client_equals_sentence_transformers(served, reference):
    m, _ = served
    mixed = _mixed()
    with tc.InferenceServerClient(m.address) as client:
        for sentences, cut in (([SHORT[0]], 0), (SHORT, 0), (mixed, 1)):
            # (32 rows padded to 256 tokens: seconds on a small CPU, more than the default 5 s budget)
            result = client.infer("minilm", [_text(sentences)], client_timeout=120)
            _close(result.as_numpy("sentence_embedding"), reference.encode(sentences, normalize_embeddings=True))
            # The answer says how many of its texts were cut to the model's max_length; none: no parameter.
            parameters = result.get_response().parameters
            assert (parameters["text_truncated"].int64_param if "text_truncated" in parameters else 0) == cut
        # One sentence a request, [batch] shaped, 32 at once: batched together by the scheduler.
        flat = tc.InferInput("text", [1], "BYTES")
        flat.set_data_from_numpy(np.array([mixed[5].encode()], dtype=object))
        _close(client.infer("minilm", [flat]).as_numpy("sentence_embedding"), reference.encode([mixed[5]]))


def test_text_through_the_aio_client_and_a_stream(served, reference):
    m, _ = served
    mixed = _mixed()
    want = reference.encode(mixed, normalize_embeddings=True)

    async def aio():
        async with tca.InferenceServerClient(m.address) as client:
            results = await asyncio.gather(*(client.infer("minilm", [_text([s], tca)], client_timeout=120)
                                             for s in mixed))
            return np.concatenate([r.as_numpy("sentence_embedding") for r in results])

    before = _padding()
    _close(asyncio.run(aio()), want)
    # 32 sentences of very different lengths at once share batches: the padding shows.
    count, total = (a - b for a, b in zip(_padding(), before))
    assert count > 0 and total / count < 1.0

    answers: queue.Queue = queue.Queue()
    with tc.InferenceServerClient(m.address) as client:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        for i, s in enumerate(mixed):
            client.async_stream_infer("minilm", [_text([s])], request_id=str(i), timeout=120_000_000)
        got = {}
        for _ in mixed:
            result, error = answers.get(timeout=60)
            assert error is None, error
            got[int(result.get_response().id)] = result.as_numpy("sentence_embedding")[0]
        client.stop_stream()
    _close(np.stack([got[i] for i in range(len(mixed))]), want)


def _padding() -> tuple[float, float]:
    """(batches, sum of padding efficiency) of minilm, from this process's metrics (the mesh runs here)."""
    from prometheus_client import REGISTRY

    count = REGISTRY.get_sample_value("batchline_padding_efficiency_count", {"model": "minilm", "version": "1"})
    total = REGISTRY.get_sample_value("batchline_padding_efficiency_sum", {"model": "minilm", "version": "1"})
    return count or 0.0, total or 0.0


def _status(call) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as info:
        call()
    return info.value.status(), info.value.message()


def test_bad_text_is_refused_naming_the_element(served):
    m, _ = served
    with tc.InferenceServerClient(m.address) as client:
        def send(items: list[bytes], shape=None, datatype="BYTES"):
            inp = tc.InferInput("text", shape or [len(items), 1], datatype)
            inp.set_data_from_numpy(np.array(items, dtype=object).reshape(shape or [len(items), 1]))
            return lambda: client.infer("minilm", [inp])

        code, message = _status(send([b"fine", b"\xff\xfe not utf-8"]))
        assert code == "StatusCode.INVALID_ARGUMENT" and "element 1 is not valid UTF-8" in message
        code, message = _status(send([b"fine", b"   "]))
        assert code == "StatusCode.INVALID_ARGUMENT" and "element 1 is empty" in message
        code, message = _status(send([b"a", b"b", b"c", b"d"], shape=[2, 2]))
        assert code == "StatusCode.INVALID_ARGUMENT" and "shape ['batch'] or ['batch', 1], got [2, 2]" in message
        code, message = _status(send([b"x"] * 33))
        assert code == "StatusCode.INVALID_ARGUMENT" and "batch size 33" in message
        ids = tc.InferInput("input_ids", [1, 2], "INT64").set_data_from_numpy(np.ones((1, 2), np.int64))
        code, message = _status(lambda: client.infer("minilm", [_text(["x"]), ids]))
        assert code == "StatusCode.INVALID_ARGUMENT" and "sent alone" in message
    # Raw bytes beyond the inputs, or raw and typed both: refused as for any request, not read in part.
    from batchline.codec import serialize_bytes
    from batchline.protocol import inference_pb2 as ipb
    from batchline.protocol import inference_pb2_grpc

    def raw_request(extra_raw: bool, typed: bool) -> ipb.ModelInferRequest:
        request = ipb.ModelInferRequest(model_name="minilm")
        tensor = request.inputs.add(name="text", datatype="BYTES", shape=[1])
        request.raw_input_contents.append(serialize_bytes(np.array([b"hello"], dtype=object)))
        if extra_raw:
            request.raw_input_contents.append(b"more")
        if typed:
            tensor.contents.bytes_contents.append(b"hello")
        return request

    import grpc

    with grpc.insecure_channel(m.address) as channel:
        stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
        for extra_raw, typed, says in ((True, False, "raw_input_contents has 2 entries for 1 inputs"),
                                       (False, True, "contents field must not be specified")):
            with pytest.raises(grpc.RpcError) as refused:
                stub.ModelInfer(raw_request(extra_raw, typed), timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in refused.value.details()


def test_a_model_that_refuses_long_text_says_which_element(model_repository, tmp_path):
    from batchline.testing.in_process import InProcessMesh

    repo = tmp_path / "repository"
    shutil.copytree(model_repository / "minilm", repo / "minilm")
    config = repo / "minilm" / "config.toml"
    config.write_text(config.read_text().replace("max_length = 256", "max_length = 16\ntruncate = false"))
    with InProcessMesh(None, str(repo), models=["minilm"]) as m, tc.InferenceServerClient(m.address) as client:
        assert client.infer("minilm", [_text(["short enough"])]).as_numpy("sentence_embedding").shape == (1, 384)
        code, message = _status(lambda: client.infer("minilm", [_text(["short", "word " * 40])]))
    assert code == "StatusCode.INVALID_ARGUMENT"
    assert "element 1 is 42 tokens, more than the 16" in message


def test_a_tokenizer_table_that_does_not_fit_the_graph_stops_the_load(model_repository, tmp_path):
    from executor.repository import RepositoryError, load_repository

    repo = tmp_path / "repository"
    shutil.copytree(model_repository / "minilm", repo / "minilm")
    config = repo / "minilm" / "config.toml"
    original = config.read_text()
    config.write_text(original.replace('path = "tokenizer"', 'path = "tokenizer"\nids_input = "ids"'))
    with pytest.raises(RepositoryError, match="ids_input 'ids' is not an input of the graph"):
        load_repository(repo)
    config.write_text(original.replace('path = "tokenizer"', 'path = "nowhere"'))
    with pytest.raises(RepositoryError, match="cannot read .*nowhere/tokenizer.json"):
        load_repository(repo)


def test_text_for_a_graph_of_a_fixed_length_is_padded_to_it(model_repository, tmp_path):
    """A graph exported at a fixed sequence length (8 here): texts are padded (masked) to it, not to
    their longest; a max_length past it stops the load."""
    import onnx
    from onnx import TensorProto, helper

    from batchline.testing.in_process import InProcessMesh
    from executor.repository import RepositoryError, load_repository

    repo = tmp_path / "repository"
    (repo / "fixed" / "1").mkdir(parents=True)
    shutil.copytree(model_repository / "minilm" / "tokenizer", repo / "fixed" / "tokenizer")
    # tokens: the mask's sum, each row (how many tokens the text has, padding masked out).
    graph = helper.make_graph(
        [helper.make_node("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),
         helper.make_node("ReduceSum", ["m"], ["tokens"], keepdims=1, axes=[1]),
         helper.make_node("Identity", ["input_ids"], ["ids"])],
        "fixed",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", 8]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", 8])],
        [helper.make_tensor_value_info("tokens", TensorProto.FLOAT, ["batch", 1]),
         helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", 8])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)]),
              repo / "fixed" / "1" / "model.onnx")
    config = repo / "fixed" / "config.toml"
    config.write_text('max_batch_size = 8\n[tokenizer]\npath = "tokenizer"\nmax_length = 16\n')
    with pytest.raises(RepositoryError, match="max_length 16 is more than the 8 tokens"):
        load_repository(repo)
    config.write_text('max_batch_size = 8\n[tokenizer]\npath = "tokenizer"\nmax_length = 8\n')
    with InProcessMesh(None, str(repo), models=["fixed"]) as m, tc.InferenceServerClient(m.address) as client:
        result = client.infer("fixed", [_text(["a b", "one two three four"])])
    assert result.as_numpy("tokens")[:, 0].tolist() == [4.0, 6.0]  # [CLS] a b [SEP]; [CLS] 4 words [SEP]
    assert result.as_numpy("ids").shape == (2, 8) and result.as_numpy("ids")[0, 4:].tolist() == [0] * 4
