"""`batchline bench`: input generation, closed/open loop against the real in-process mesh, CLI errors."""
from __future__ import annotations

import json
import socket

import numpy as np
import pytest
from tritonclient.grpc import service_pb2
from tritonclient.utils import deserialize_bytes_tensor

from batchline import cli
from batchline.bench import (
    BenchResult,
    InputError,
    InputOptions,
    TensorInfo,
    build_pool,
    plot,
    read_json,
    run_closed,
    run_open,
)
from batchline.bench.inputs import parse_int_range, parse_shape
from batchline.bench.loadgen import arrival_times
from batchline.bench.streams import STREAM_ERROR, stream_answer, with_id
from batchline.protocol import inference_pb2 as ipb

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

TOKENS = [TensorInfo("input_ids", "INT64", (-1, -1)), TensorInfo("attention_mask", "INT64", (-1, -1))]


def _decode(payload: bytes) -> dict[str, np.ndarray]:
    req = service_pb2.ModelInferRequest.FromString(payload)
    out = {}
    for tensor, raw in zip(req.inputs, req.raw_input_contents):
        shape = list(tensor.shape)
        if tensor.datatype == "BYTES":
            out[tensor.name] = deserialize_bytes_tensor(raw).reshape(shape)
        else:
            dtype = {"INT64": np.int64, "INT32": np.int32, "FP32": np.float32, "UINT8": np.uint8}[tensor.datatype]
            out[tensor.name] = np.frombuffer(raw, dtype=dtype).reshape(shape)
    return out


def test_generator_honours_shape_and_int_range():
    inputs = TOKENS + [TensorInfo("features", "FP32", (-1, 8)), TensorInfo("words", "BYTES", (-1, -1)),
                       TensorInfo("pixels", "UINT8", (3, -1))]
    opts = InputOptions(shapes=dict([parse_shape("input_ids=2,7"), parse_shape("attention_mask=2,7")]),
                        int_ranges=dict([parse_int_range("input_ids=5:9"), parse_int_range("pixels=200:255")]),
                        default_dim=4, pool_size=8)
    pool = build_pool("m", inputs, opts, version="3", budget_ms=250, priority=2)
    assert pool.shapes == {"input_ids": [2, 7], "attention_mask": [2, 7], "features": [1, 8], "words": [1, 4],
                           "pixels": [3, 4]}
    assert len(pool) == 8 and len(set(pool.requests)) == 8  # distinct requests
    for payload in pool.requests:
        req = service_pb2.ModelInferRequest.FromString(payload)
        assert (req.model_name, req.model_version) == ("m", "3")
        assert req.parameters["timeout"].int64_param == 250_000  # µs
        assert req.parameters["priority"].uint64_param == 2
        t = _decode(payload)
        assert t["input_ids"].shape == (2, 7) and t["input_ids"].min() >= 5 and t["input_ids"].max() <= 9
        assert (t["attention_mask"] == 1).all()  # masks default to all ones
        assert t["features"].shape == (1, 8) and t["features"].dtype == np.float32
        assert t["pixels"].shape == (3, 4) and t["pixels"].min() >= 200
        words = [w.decode() for w in t["words"].ravel()]
        assert len(words) == 4 and all(w.isascii() and w.isalpha() for w in words)


def test_seq_len_sets_token_dims_and_no_budget_sends_no_timeout():
    pool = build_pool("minilm", TOKENS, InputOptions(seq_len=128, default_dim=3, pool_size=2))
    assert pool.shapes == {"input_ids": [1, 128], "attention_mask": [1, 128]}
    req = service_pb2.ModelInferRequest.FromString(pool.requests[0])
    assert "timeout" not in req.parameters and "priority" not in req.parameters
    ids = _decode(pool.requests[0])["input_ids"]
    assert 0 <= ids.min() and ids.max() <= 100


@pytest.mark.parametrize("opts, message", [
    (InputOptions(shapes={"input_ids": [1, 2, 3]}), "has 2 dims"),
    (InputOptions(shapes={"nope": [1, 2]}), "no input nope"),
    (InputOptions(int_ranges={"input_ids": (-1, 2**40)}), None),  # fits INT64: accepted
])
def test_generator_rejects_options_that_do_not_fit(opts, message):
    if message is None:
        build_pool("minilm", TOKENS, opts)
        return
    with pytest.raises(InputError, match=message):
        build_pool("minilm", TOKENS, opts)


def test_generator_rejects_fixed_dim_mismatch_and_bad_syntax():
    with pytest.raises(InputError, match="fixed to 32"):
        build_pool("mlp", [TensorInfo("features", "FP32", (-1, 32))], InputOptions(shapes={"features": [1, 31]}))
    with pytest.raises(InputError, match="does not fit UINT8"):
        build_pool("x", [TensorInfo("p", "UINT8", (-1,))], InputOptions(int_ranges={"p": (0, 300)}))
    for bad in ("input_ids", "input_ids=1,x", "=1,2", "a=1,-1"):
        with pytest.raises(InputError):
            parse_shape(bad)
    for bad in ("mask=1", "mask=2:1", "mask"):
        with pytest.raises(InputError):
            parse_int_range(bad)


def test_arrival_schedule_poisson_plus_bursts():
    rng = np.random.default_rng(1)
    plain = arrival_times(1000, 2.0, None, rng)
    assert (np.diff(plain) >= 0).all() and plain.min() >= 0 and plain.max() < 2.0
    assert 1700 < len(plain) < 2300  # ~2000 expected; >6 sigma either side
    with_bursts = arrival_times(1000, 2.0, (50, 0.5), np.random.default_rng(1))
    # Bursts at 0.5, 1.0 and 1.5 s on top of the same Poisson draw.
    assert len(with_bursts) == len(plain) + 150
    values, counts = np.unique(with_bursts, return_counts=True)
    assert sorted(values[counts >= 50].tolist()) == [0.5, 1.0, 1.5]


def test_closed_loop_cli_on_mlp_writes_json_and_png(mesh, tmp_path, capsys):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    code = cli.main(["bench", "--url", mesh.address, "--model", "mlp", "--concurrency", "4", "--duration", "1",
                     "--warmup", "0.3", "--budget-ms", "5000", "--json", str(out_json), "--plot", str(out_png),
                     "--quiet"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "concurrency 4" in printed and "OK=" in printed

    json.loads(out_json.read_text())  # plain JSON
    result = read_json(out_json)
    assert isinstance(result, BenchResult) and result.target["model"] == "mlp"
    assert result.config["input_shapes"] == {"features": [1, 32]}
    [step] = result.steps
    assert step.mode == "closed" and step.concurrency == 4
    assert step.status_counts.get("OK", 0) > 0
    assert step.goodput_rps <= step.throughput_rps
    assert step.throughput_rps == pytest.approx(step.status_counts["OK"] / step.duration_s)
    lat = step.latency_ms
    assert 0 < lat["p50"] <= lat["p95"] <= lat["p99"] <= lat["max"]
    # Every answered request went through at least one execution; batches hold >= 1 request each.
    assert step.inference_count >= step.status_counts["OK"]
    assert step.mean_batch_size is not None and step.mean_batch_size >= 1
    assert out_png.read_bytes()[:8] == PNG_SIGNATURE


def test_open_loop_tiny_budget_counts_failures_instead_of_crashing(mesh, tmp_path):
    # minilm at 64 tokens cannot be answered within 1 ms, through Redis, on any machine.
    step = run_open(mesh.address, "minilm", rate=40, duration=1.0, warmup=0.2, budget_ms=1,
                    inputs=InputOptions(seq_len=64, pool_size=8))
    counts = step.status_counts
    assert step.sent > 0 and sum(counts.values()) == step.sent
    assert set(counts) <= {"OK", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"}
    assert counts.get("DEADLINE_EXCEEDED", 0) + counts.get("RESOURCE_EXHAUSTED", 0) > 0
    assert step.goodput_rps <= step.throughput_rps
    assert step.offered_rps == pytest.approx(step.sent / step.duration_s)
    assert step.send_lag_p99_ms is not None
    out_png = tmp_path / "open.png"
    plot(out_png, BenchResult(target={"url": mesh.address, "model": "minilm", "version": ""},
                              config={"mode": "open"}, started_at="", steps=[step]))
    assert out_png.read_bytes()[:8] == PNG_SIGNATURE


def test_streaming_closed_loop_answers_on_streams_and_reads_each_answer_status(mesh, capsys):
    code = cli.main(["bench", "--url", mesh.address, "--model", "mlp", "--concurrency", "4", "--duration", "1",
                     "--warmup", "0.3", "--streaming", "--quiet"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "over ModelStreamInfer streams" in printed and "concurrency 4 (stream)" in printed

    step = run_closed(mesh.address, "mlp", 4, 1.0, warmup=0.3, budget_ms=5000, streaming=True)
    assert step.streaming and step.status_counts.get("OK", 0) > 0 and set(step.status_counts) == {"OK"}
    assert step.inference_count >= step.status_counts["OK"]
    # The gateway answers requests it cannot serve in their budget on the stream, which stays usable:
    # minilm at 64 tokens is refused at 1 ms, every request is counted, none hangs or is lost.
    tiny = run_closed(mesh.address, "minilm", 2, 1.0, warmup=0.1, budget_ms=1, streaming=True,
                      inputs=InputOptions(seq_len=64, pool_size=4))
    assert tiny.sent > 2 and set(tiny.status_counts) == {"DEADLINE_EXCEEDED"}


def test_stream_answer_reads_the_code_batchline_puts_in_error_message_and_the_retry_hint():
    ok = ipb.ModelStreamInferResponse(infer_response=ipb.ModelInferResponse(model_name="m"))
    assert stream_answer(ok.SerializeToString()) == ("OK", None)
    refused = ipb.ModelStreamInferResponse(error_message="[RESOURCE_EXHAUSTED] model 'm' is overloaded: retry")
    assert stream_answer(refused.SerializeToString()) == ("RESOURCE_EXHAUSTED", None)
    refused.infer_response.parameters["retry-after-ms"].int64_param = 250
    assert stream_answer(refused.SerializeToString()) == ("RESOURCE_EXHAUSTED", 0.25)
    # Another server's error (Triton's carry no code) or a bracket that is not a status name.
    for message in ("Request for unknown model: 'm' is not found", "[not a code] x"):
        blob = ipb.ModelStreamInferResponse(error_message=message).SerializeToString()
        assert stream_answer(blob) == (STREAM_ERROR, None)


def test_open_loop_over_streams_matches_every_answer_to_its_request(mesh):
    step = run_open(mesh.address, "mlp", rate=200, duration=1.0, warmup=0.2, budget_ms=5000, streaming=True,
                    inputs=InputOptions(pool_size=8))
    assert step.streaming and "(stream)" in step.label
    # Every request sent was answered on some stream and matched by its id: none left waiting.
    assert step.sent > 50 and step.status_counts == {"OK": step.sent}
    assert step.inference_count >= step.sent
    tiny = run_open(mesh.address, "minilm", rate=40, duration=1.0, warmup=0.1, budget_ms=1, streaming=True,
                    inputs=InputOptions(seq_len=64, pool_size=4))
    assert tiny.sent > 10 and tiny.status_counts == {"DEADLINE_EXCEEDED": tiny.sent}


def test_with_id_sets_the_request_id_without_reserializing():
    req = ipb.ModelInferRequest(model_name="mlp", id="from-the-pool")
    req.inputs.add(name="features", datatype="FP32", shape=[1, 32])
    tagged = ipb.ModelInferRequest.FromString(with_id(req.SerializeToString(), "bench-7"))
    assert tagged.id == "bench-7" and tagged.model_name == "mlp" and tagged.inputs[0].name == "features"


def test_cli_unknown_model_exits_non_zero_with_message(mesh, capsys):
    assert cli.main(["bench", "--url", mesh.address, "--model", "no-such-model", "--quiet"]) != 0
    err = capsys.readouterr().err
    assert "no-such-model" in err and "not served" in err


def test_cli_unreachable_endpoint_exits_non_zero_with_message(capsys):
    with socket.socket() as s:  # a port nothing listens on (closed again before the run)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert cli.main(["bench", "--url", f"127.0.0.1:{port}", "--model", "mlp", "--quiet"]) != 0
    assert "cannot reach" in capsys.readouterr().err


def test_seq_len_dist_draws_each_requests_length_and_refuses_bad_specs():
    from batchline.bench.inputs import parse_seq_len_dist

    assert parse_seq_len_dist("16,64") == [16, 64]
    tail = parse_seq_len_dist("lognormal:40:256", seed=1)
    assert max(tail) <= 256 and min(tail) >= 1 and 30 < np.mean(tail) < 50 and np.percentile(tail, 99) > 100
    for bad in ("", "0,3", "lognormal:40", "lognormal:x:1", "16,a"):
        with pytest.raises(InputError, match="--seq-len-dist"):
            parse_seq_len_dist(bad)
    tokens = [TensorInfo("input_ids", "INT64", (-1, -1)), TensorInfo("attention_mask", "INT64", (-1, -1))]
    pool = build_pool("minilm", tokens, InputOptions(seq_lens=[8, 24], pool_size=40, seed=3))
    seen = set()
    for blob in pool.requests:
        req = service_pb2.ModelInferRequest.FromString(blob)
        ids, mask = req.inputs
        assert list(ids.shape) == list(mask.shape)  # one length per request, every token input
        seen.add(ids.shape[1])
    assert seen == {8, 24}


def test_texts_send_one_sentence_a_request_on_the_text_input(mesh, tmp_path, capsys):
    sentences = tmp_path / "s.txt"
    sentences.write_text("A short one.\n\nA somewhat longer sentence about batching requests of many lengths.\n")
    out_json = tmp_path / "r.json"
    code = cli.main(["bench", "--url", mesh.address, "--model", "minilm", "--texts", str(sentences), "--concurrency",
                     "2", "--duration", "1", "--warmup", "0.2", "--budget-ms", "5000", "--json", str(out_json),
                     "--quiet"])
    assert code == 0, capsys.readouterr()
    [step] = read_json(out_json).steps
    assert step.status_counts.get("OK", 0) > 0 and set(step.status_counts) == {"OK"}
    assert read_json(out_json).config["input_shapes"] == {"text": [1, 1]}
    # A model without a text input says so.
    assert cli.main(["bench", "--url", mesh.address, "--model", "mlp", "--texts", str(sentences), "--duration", "1",
                     "--quiet"]) != 0
    assert "takes no text input" in capsys.readouterr().err


def test_http_closed_loop_drives_the_rest_port_with_binary_tensors(mesh, capsys):
    code = cli.main(["bench", "--protocol", "http", "--url", mesh.http_address, "--model", "mlp", "--concurrency", "4",
                     "--duration", "1", "--warmup", "0.3", "--budget-ms", "5000", "--quiet"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "over HTTP" in printed and "concurrency 4" in printed and "OK=" in printed

    step = run_closed(mesh.http_address, "mlp", 4, 1.0, warmup=0.3, budget_ms=5000, protocol="http")
    assert set(step.status_counts) == {"OK"} and step.inference_count >= step.status_counts["OK"] > 0
    # Refusals are counted by their gRPC names, read off the HTTP status: minilm at 64 tokens in 1 ms.
    tiny = run_closed(mesh.http_address, "minilm", 2, 1.0, warmup=0.1, budget_ms=1, protocol="http",
                      inputs=InputOptions(seq_len=64, pool_size=4))
    assert tiny.sent > 2 and set(tiny.status_counts) <= {"DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"}


def test_http_bench_refuses_what_http_cannot_do_and_unknown_models(mesh, capsys):
    assert cli.main(["bench", "--protocol", "http", "--url", mesh.http_address, "--model", "mlp", "--streaming",
                     "--quiet"]) != 0
    assert "HTTP has no streams" in capsys.readouterr().err
    assert cli.main(["bench", "--protocol", "http", "--url", mesh.http_address, "--model", "no-such-model",
                     "--quiet"]) != 0
    err = capsys.readouterr().err
    assert "no-such-model" in err and "not served" in err


def test_grpc_bench_needs_no_http_client():
    """tritonclient's HTTP client (gevent) is imported only for --protocol http: a gRPC run works
    where tritonclient is installed with its gRPC extra alone."""
    import subprocess
    import sys

    code = "import sys, batchline.bench; assert 'tritonclient.http' not in sys.modules, 'imported'"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
