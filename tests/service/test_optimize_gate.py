"""batchline optimize on small models built in the test: where each variant is judged (the
provider), how each output is judged (embedding, classes, values) in bounded memory, --texts by the
model's [tokenizer] table, and the INT8 search that keeps the most harmful MatMuls in FP32."""
from __future__ import annotations

import pathlib
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from batchline.optimize import VARIANTS, gate
from batchline.optimize.run import OptimizeError, Options, optimize
from batchline.optimize.inputs import InputsError
from batchline.optimize.variants import Int8Options


def _save(repo: pathlib.Path, name: str, nodes: list, inputs: list, outputs: list, weights: dict[str, np.ndarray],
          config: str) -> pathlib.Path:
    graph = helper.make_graph(nodes, name, inputs, outputs, [numpy_helper.from_array(v, k) for k, v in weights.items()])
    (repo / name / "1").mkdir(parents=True)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
              str(repo / name / "1" / "model.onnx"))
    (repo / name / "config.toml").write_text(config)
    return repo / name


def _features(rows: int = 512, width: int = 16, seed: int = 0) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float32)}


def _classifier(repo: pathlib.Path, config: str = "max_batch_size = 64\n") -> pathlib.Path:
    """16 features in; 10 classes out as `logits` and as `scores` (their softmax); and `hidden`, 12 wide."""
    rng = np.random.default_rng(1)
    f32 = TensorProto.FLOAT
    return _save(repo, "classifier", [
        helper.make_node("MatMul", ["x", "w_hidden"], ["hidden"], name="to_hidden"),
        helper.make_node("Tanh", ["hidden"], ["active"]),
        helper.make_node("MatMul", ["active", "w_logits"], ["logits"], name="to_logits"),
        helper.make_node("Softmax", ["logits"], ["scores"], axis=-1)],
        [helper.make_tensor_value_info("x", f32, ["batch", 16])],
        [helper.make_tensor_value_info(n, f32, ["batch", w])
         for n, w in (("logits", 10), ("scores", 10), ("hidden", 12))],
        {"w_hidden": rng.standard_normal((16, 12)).astype(np.float32) / 4,
         "w_logits": rng.standard_normal((12, 10)).astype(np.float32)}, config)


# ---------------------------------------------------------------- providers (7)


def test_fp16_and_tensorrt_int8_are_judged_on_the_gpu_where_one_serves_and_skipped_with_the_reason_on_a_cpu_host():
    from batchline.optimize import providers

    gpu_host = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    serves_on = providers.serving(["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
                                  gpu_host)
    assert serves_on == "TensorrtExecutionProvider"
    steps = {s.variant: s for s in providers.plan(VARIANTS, gpu_host, serves_on)}
    assert (steps["fp16"].provider, steps["fp16"].choosable) == ("CUDAExecutionProvider", True)
    assert (steps["tensorrt-int8"].provider, steps["tensorrt-int8"].choosable) == ("TensorrtExecutionProvider", True)
    assert (steps["int8-dynamic"].provider, steps["int8-dynamic"].choosable) == ("CPUExecutionProvider", False)

    cpu_host = ["CPUExecutionProvider"]
    steps = {s.variant: s for s in providers.plan(VARIANTS, cpu_host, providers.serving(gpu_host, cpu_host))}
    assert steps["fp16"].provider is None and "CUDAExecutionProvider" in steps["fp16"].skipped
    assert steps["tensorrt-int8"].provider is None
    assert "TensorRT is not available here" in steps["tensorrt-int8"].skipped
    assert all(steps[v].provider == "CPUExecutionProvider" and steps[v].choosable
               for v in ("graph", "int8-dynamic", "int8-static"))

    # The choice: the fastest that passed, among those judged on the device that serves the model.
    def judged(name, provider, ratio, passed=True):
        return {"name": name, "provider": provider, "gate": {"passed": passed},
                "speed": {"32": {"throughput_ratio": ratio}}}

    results = [judged("int8-dynamic", "CPUExecutionProvider", 2.0), judged("fp16", "CUDAExecutionProvider", 1.6),
               judged("tensorrt-int8", "TensorrtExecutionProvider", 3.0, passed=False)]
    assert providers.choose(results, "32", 1.05, "TensorrtExecutionProvider")[0] == "fp16"
    assert providers.choose(results, "32", 1.05, "CPUExecutionProvider")[0] == "int8-dynamic"
    assert providers.choose(results[2:], "32", 1.05, "CUDAExecutionProvider") == (
        None, "no variant for GPU executors passed the gate (CUDAExecutionProvider serves the model here)")


def test_the_report_names_the_provider_each_variant_ran_on(tmp_path):
    _classifier(tmp_path)
    report = optimize(Options("classifier", tmp_path, variants=("graph", "fp16"), min_gain=0.0))
    graph, fp16 = report["variants"]
    # What an executor with the default providers runs it on here.
    asked = [p for p in ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
             if p in ort.get_available_providers()]
    here = ort.InferenceSession(graph["file"], providers=asked).get_providers()[0]
    assert graph["provider"] == here == report["reference_provider"] == report["serves_on"] == "CPUExecutionProvider"
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        assert "CUDAExecutionProvider" in fp16["skipped"] and "gate" not in fp16
        assert report["chosen"] == "graph"


def test_a_variant_that_cannot_be_built_is_that_variants_result_alone(tmp_path, monkeypatch):
    from batchline.optimize import variants

    _classifier(tmp_path)
    real = variants.build

    def build(name, *args, **kwargs):
        if name == "graph":
            raise RuntimeError("an operator the optimizer does not know")
        return real(name, *args, **kwargs)

    monkeypatch.setattr("batchline.optimize.run.build", build)
    report = optimize(Options("classifier", tmp_path, variants=("graph", "int8-dynamic"), min_gain=0.0))
    graph, int8 = report["variants"]
    assert graph["skipped"] == "failed: RuntimeError: an operator the optimizer does not know"
    assert "gate" in int8  # judged all the same


# ---------------------------------------------------------------- what each output is (8)


def test_each_output_is_judged_as_what_it_is_by_name_values_or_config(tmp_path):
    _classifier(tmp_path)
    np.savez(tmp_path / "x.npz", **_features())
    report = optimize(Options("classifier", tmp_path, variants=("int8-dynamic",), calibration=tmp_path / "x.npz",
                              min_gain=0.0))
    assert {k: v["kind"] for k, v in report["outputs"].items()} == {"logits": "classes", "scores": "classes",
                                                                    "hidden": "values"}
    assert "probabilities" in report["outputs"]["scores"]["why"]
    measured = report["variants"][0]["gate"]["outputs"]
    assert "argmax_agreement" in measured["logits"] and "argmax_agreement" in measured["scores"]
    assert "mean_cosine" not in measured["hidden"] and "argmax_agreement" not in measured["hidden"]
    # config.toml says otherwise: it wins.
    config = tmp_path / "classifier" / "config.toml"
    config.write_text('max_batch_size = 64\n[optimize]\noutputs = { hidden = "embedding", scores = "values" }\n')
    shutil.rmtree(tmp_path / "classifier" / "2", ignore_errors=True)
    report = optimize(Options("classifier", tmp_path, variants=("graph",), calibration=tmp_path / "x.npz"))
    assert {k: v["kind"] for k, v in report["outputs"].items()} == {"logits": "classes", "scores": "values",
                                                                    "hidden": "embedding"}
    assert report["outputs"]["hidden"]["why"] == "[optimize] outputs in config.toml"
    # --output says otherwise again: it wins over config.toml.
    report = optimize(Options("classifier", tmp_path, variants=("graph",), calibration=tmp_path / "x.npz",
                              outputs={"hidden": "values"}))
    assert report["outputs"]["hidden"] == {"kind": "values", "why": "--output"}
    assert report["outputs"]["scores"]["kind"] == "values"  # config.toml's, for what --output leaves alone
    with pytest.raises(OptimizeError, match=r"--output names \['nope'\], not outputs of model"):
        optimize(Options("classifier", tmp_path, variants=("graph",), outputs={"nope": "values"}))
    config.write_text('max_batch_size = 64\n[optimize]\noutputs = { probability = "classes" }\n')
    with pytest.raises(OptimizeError, match=r"\[optimize\] outputs names \['probability'\], not outputs of model"):
        optimize(Options("classifier", tmp_path, variants=("graph",)))
    config.write_text('max_batch_size = 64\n[optimize]\noutputs = { hidden = "vector" }\n')
    with pytest.raises(OptimizeError, match="optimize.outputs.hidden"):
        optimize(Options("classifier", tmp_path, variants=("graph",)))


def test_a_classifier_whose_argmax_flips_fails_the_gate_however_close_its_cosines(tmp_path):
    _classifier(tmp_path)
    session = ort.InferenceSession(str(tmp_path / "classifier" / "1" / "model.onnx"),
                                   providers=["CPUExecutionProvider"])
    reference = session.run(["logits"], _features(2000))[0]
    # The two best classes swapped where they are within 0.2 of each other: every cosine near 1.
    top = np.argsort(-reference, axis=1)[:, :2]
    rows = np.nonzero(np.take_along_axis(reference, top, 1) @ [1, -1] < 0.2)[0]
    flipped = reference.copy()
    first, second = top[rows, 0], top[rows, 1]
    flipped[rows, first], flipped[rows, second] = reference[rows, second], reference[rows, first]
    assert 0.02 < len(rows) / len(reference) and gate.cosines(reference, flipped).min() > 0.99
    kind, _ = gate.kind_of("logits", reference, {})
    verdict = gate.judge({"logits": reference}, {"logits": flipped}, gate.Thresholds(max_abs_error=1.0),
                         {"logits": kind})
    assert not verdict["passed"] and verdict["failed"][0].startswith("logits: argmax_agreement")


def test_neighbours_are_found_in_bounded_memory_and_as_a_full_search_finds_them():
    import tracemalloc

    rng = np.random.default_rng(0)
    small = rng.standard_normal((300, 16))
    noisy = small + 0.05 * rng.standard_normal(small.shape)

    def brute(x):
        unit = x / np.linalg.norm(x, axis=1, keepdims=True)
        similarity = unit @ unit.T
        np.fill_diagonal(similarity, -np.inf)
        return np.argsort(-similarity, axis=1)[:, :10]

    expected = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(brute(small), brute(noisy))])
    assert gate.neighbour_overlap(small, noisy, 10) == pytest.approx(expected)
    # 6,000 rows: an n x n similarity matrix alone would be 288 MB.
    big = rng.standard_normal((6_000, 16)).astype(np.float32)
    tracemalloc.start()
    overlap = gate.neighbour_overlap(big, big + 0.01 * rng.standard_normal(big.shape).astype(np.float32), 10)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert overlap > 0.5 and peak < 64 * 2**20, peak


# ---------------------------------------------------------------- the model's [tokenizer] (9)

WORDS = ["the", "model", "takes", "text", "and", "answers", "with", "vectors", "of", "its", "own", "kind"]


def _words_model(repo: pathlib.Path, tokenizer_table: str) -> pathlib.Path:
    """Text in through a word-level tokenizer, into inputs named as no BERT names them: ids `input_ids`,
    mask `padding_mask`, token types `segments`; a masked mean of word vectors out, through a MatMul."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    rng = np.random.default_rng(2)
    i64, f32 = TensorProto.INT64, TensorProto.FLOAT
    model_dir = _save(repo, "words", [
        helper.make_node("Gather", ["table", "input_ids"], ["vectors"]),
        helper.make_node("Gather", ["segment_table", "segments"], ["segment_vectors"]),
        helper.make_node("Add", ["vectors", "segment_vectors"], ["summed"]),
        helper.make_node("Cast", ["padding_mask"], ["mask"], to=f32),
        helper.make_node("Unsqueeze", ["mask", "last"], ["mask3"]),
        helper.make_node("Mul", ["summed", "mask3"], ["masked"]),
        helper.make_node("ReduceSum", ["masked", "one"], ["total"], keepdims=0),
        helper.make_node("ReduceSum", ["mask3", "one"], ["count"], keepdims=0),
        helper.make_node("Div", ["total", "count"], ["mean"]),
        helper.make_node("MatMul", ["mean", "projection"], ["sentence_embedding"], name="project")],
        [helper.make_tensor_value_info(n, i64, ["batch", "sequence"])
         for n in ("input_ids", "padding_mask", "segments")],
        [helper.make_tensor_value_info("sentence_embedding", f32, ["batch", 24])],
        {"table": rng.standard_normal((len(WORDS) + 1, 24)).astype(np.float32),
         "segment_table": np.zeros((2, 24), np.float32), "last": np.array([-1]), "one": np.array([1]),
         "projection": rng.standard_normal((24, 24)).astype(np.float32)},
        "max_batch_size = 8\n" + tokenizer_table)
    tokenizer = Tokenizer(models.WordLevel({w: i + 1 for i, w in enumerate(WORDS)} | {"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.enable_padding(length=32)  # what tokenizer.json says is overridden by the model's [tokenizer]
    (model_dir / "tokenizer").mkdir()
    tokenizer.save(str(model_dir / "tokenizer" / "tokenizer.json"))
    return model_dir


def _sentences(path: pathlib.Path, count: int = 64) -> pathlib.Path:
    rng = np.random.default_rng(3)
    path.write_text("\n".join(" ".join(rng.choice(WORDS, rng.integers(2, 12))) for _ in range(count)) + "\n")
    return path


def test_texts_are_tokenized_as_the_model_s_tokenizer_table_says(tmp_path):
    table = ('[tokenizer]\npath = "tokenizer"\nmax_length = 6\nmask_input = "padding_mask"\n'
             'type_ids_input = "segments"\n')
    _words_model(tmp_path, table)
    texts = _sentences(tmp_path / "sentences.txt")
    report = optimize(Options("words", tmp_path, variants=("int8-dynamic",), texts=texts, min_gain=0.0))
    assert report["inputs"] == "sentences.txt: 64 texts, tokenized with the model's [tokenizer] (at most 6 tokens)"
    assert report["variants"][0]["gate"]["outputs"]["sentence_embedding"]["kind"] == "embedding"
    # The batches: the graph's own input names, cut at max_length, padded to the longest of each.
    from batchline.optimize import inputs
    from executor.repository import load_model, read_config

    model_dir = tmp_path / "words"
    loaded = load_model(model_dir, model_dir / "1", read_config(model_dir), ["CPUExecutionProvider"], "", 0, True, 0)
    data = inputs.from_texts(texts, loaded.tokenizer_json, loaded.info, 8)
    lengths = sorted(min(len(line.split()), 6) for line in texts.read_text().splitlines())
    assert all(set(b) == {"input_ids", "padding_mask", "segments"} for b in data.batches)
    assert [int(n) for b in data.batches for n in b["padding_mask"].sum(1)] == lengths
    assert [b["input_ids"].shape[1] for b in data.batches] == [max(lengths[i:i + 8]) for i in range(0, 64, 8)]
    # A [tokenizer] that does not truncate: a longer text is refused, by its line.
    (model_dir / "config.toml").write_text("max_batch_size = 8\n" + table + "truncate = false\n")
    first_long = next(i for i, line in enumerate(texts.read_text().splitlines()) if len(line.split()) > 6)
    with pytest.raises(InputsError, match=rf"sentences.txt: text {first_long + 1} is \d+ tokens, more than the 6"):
        optimize(Options("words", tmp_path, variants=("int8-dynamic",), texts=texts))
    (model_dir / "config.toml").write_text("max_batch_size = 8\n")
    with pytest.raises(InputsError, match=r"--texts needs a \[tokenizer\] table in the config.toml of model 'words'"):
        optimize(Options("words", tmp_path, variants=("int8-dynamic",), texts=texts))


# ---------------------------------------------------------------- the search for nodes to keep in FP32 (12)


def _sensitive(repo: pathlib.Path) -> pathlib.Path:
    """Three MatMuls; the middle one's input has a channel 1,000 times the others (its weights scale
    it back), so quantizing that input per tensor, as dynamic INT8 does, wipes out the others."""
    rng = np.random.default_rng(4)
    first = rng.standard_normal((16, 32)).astype(np.float32) / 4
    first[:, 0] *= 1000
    middle = rng.standard_normal((32, 32)).astype(np.float32) / 6
    middle[0] /= 1000
    f32 = TensorProto.FLOAT
    return _save(repo, "sensitive", [
        helper.make_node("MatMul", ["x", "w_first"], ["h1"], name="first"),
        helper.make_node("MatMul", ["h1", "w_middle"], ["h2"], name="middle"),
        helper.make_node("Tanh", ["h2"], ["a2"]),
        helper.make_node("MatMul", ["a2", "w_last"], ["embedding"], name="last")],
        [helper.make_tensor_value_info("x", f32, ["batch", 16])],
        [helper.make_tensor_value_info("embedding", f32, ["batch", 24])],
        {"w_first": first, "w_middle": middle, "w_last": rng.standard_normal((32, 24)).astype(np.float32) / 6},
        "max_batch_size = 64\n")


def test_the_search_keeps_the_harmful_matmul_in_fp32_and_quantizes_the_rest(tmp_path):
    _sensitive(tmp_path)
    np.savez(tmp_path / "x.npz", **_features())
    plain = optimize(Options("sensitive", tmp_path, variants=("int8-dynamic",), calibration=tmp_path / "x.npz",
                             int8=Int8Options(search=False), min_gain=0.0))
    assert not plain["variants"][0]["gate"]["passed"] and plain["written_version"] is None

    report = optimize(Options("sensitive", tmp_path, variants=("int8-dynamic",), calibration=tmp_path / "x.npz",
                              min_gain=0.0, scratch=tmp_path / "scratch"))
    [variant] = report["variants"]
    found = variant["search"]
    assert found["fp32_nodes"] == ["middle"] and found["quantized_nodes"] == 3
    assert found["ranking"][0]["node"] == "middle" and found["ranking"][0]["effect"] > 0.5
    assert not found["all_quantized"]["gate"]["passed"] and variant["gate"]["passed"]
    assert [t["fp32_nodes"] for t in found["tried"]] == [1] and found["tried"][0]["passed"]
    assert "1 of 3 quantized nodes kept in FP32" in variant["notes"][-1]
    assert report["written_version"] == "2" and set(variant["speed"]) == {"16", "64"}
    # The version written: the middle MatMul in FP32, the others quantized.
    ops = {n.name: n.op_type for n in onnx.load(str(tmp_path / "sensitive" / "2" / "model.onnx")).graph.node}
    assert ops["middle"] == "MatMul" and "first" not in ops and "last" not in ops
    assert sum(op == "MatMulInteger" for op in ops.values()) == 2


@pytest.mark.parametrize("kind", ["embedding", "values", "classes"])
def test_nan_or_infinity_where_fp32_has_numbers_fails_the_gate(kind):
    from batchline.optimize.gate import Thresholds, distance, judge

    rng = np.random.default_rng(0)
    reference = rng.random((200, 8)).astype(np.float32)
    reference /= reference.sum(-1, keepdims=True)
    broken = reference.copy()
    broken[:2] = np.nan  # an fp16 overflow in two rows
    verdict = judge({"out": reference}, {"out": broken}, Thresholds(), {"out": kind})
    assert not verdict["passed"]
    assert any("NaN or infinite" in why for why in verdict["failed"]), verdict["failed"]
    infinite = np.full_like(reference, np.inf)
    assert not judge({"out": reference}, {"out": infinite}, Thresholds(), {"out": kind})["passed"]
    assert distance({"out": reference}, {"out": broken}, {"out": kind}) == float("inf")
    assert judge({"out": reference}, {"out": reference.copy()}, Thresholds(), {"out": kind})["passed"]
