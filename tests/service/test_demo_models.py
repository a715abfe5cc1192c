"""The demo repository's ONNX files, checked with real ONNX Runtime sessions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import onnxruntime as ort
import pytest

from batchline import demo_models
from batchline.testing.checkout import ROOT

SENTENCES = [
    "Hi.",
    "The quick brown fox jumps over the lazy dog.",
    "Batching variable-length requests needs padding, and the attention mask "
    "must hide every padded position from the pooling step.",
    "ONNX Runtime",
    "A sentence embedding maps text to a fixed-size vector whose cosine similarity "
    "tracks semantic similarity; all-MiniLM-L6-v2 produces 384 dimensions.",
]


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model_repository")
    assert demo_models.build_repository(path) == path
    return path


def _session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def minilm_session(repo) -> ort.InferenceSession:
    return _session(repo / "minilm" / "1" / "model.onnx")


@pytest.fixture(scope="module")
def mlp_session(repo) -> ort.InferenceSession:
    return _session(repo / "mlp" / "1" / "model.onnx")


@pytest.fixture(scope="module")
def tokenizer(repo):
    return demo_models.load_minilm_tokenizer(repo)


def _embed(session, tokenizer, sentences) -> np.ndarray:
    enc = tokenizer(sentences, padding=True, truncation=True, return_tensors="np")
    feeds = {
        "input_ids": enc["input_ids"].astype(np.int64),
        "attention_mask": enc["attention_mask"].astype(np.int64),
    }
    (out,) = session.run(["sentence_embedding"], feeds)
    return out


def test_repository_layout(repo):
    for name in ("minilm", "mlp"):
        assert (repo / name / "config.toml").is_file()
        assert (repo / name / "1" / "model.onnx").is_file()
    assert (repo / "minilm" / "tokenizer" / "tokenizer.json").is_file()
    # Atomic writes must not leave temp files behind for the server to trip on.
    assert not [p for p in repo.rglob("*") if p.name.endswith(".tmp")]


def test_minilm_graph_signature(minilm_session):
    inputs = {i.name: i for i in minilm_session.get_inputs()}
    assert list(inputs) == ["input_ids", "attention_mask"]
    for i in inputs.values():
        assert i.type == "tensor(int64)"
        assert len(i.shape) == 2 and all(isinstance(d, str) for d in i.shape)
    (out,) = minilm_session.get_outputs()
    assert out.name == "sentence_embedding"
    assert out.type == "tensor(float)"
    assert isinstance(out.shape[0], str) and out.shape[1] == 384


def test_minilm_matches_sentence_transformers(minilm_session, tokenizer):
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(demo_models.minilm_package_dir()), device="cpu")
    expected = reference.encode(SENTENCES, convert_to_numpy=True)
    got = _embed(minilm_session, tokenizer, SENTENCES)
    assert got.shape == (len(SENTENCES), 384)
    assert got.dtype == np.float32
    assert np.abs(got - expected).max() < 1e-4
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_minilm_padding_is_exact(minilm_session, tokenizer):
    # The batcher pads requests together; each row must equal its unpadded run.
    batched = _embed(minilm_session, tokenizer, SENTENCES)
    for i, sentence in enumerate(SENTENCES):
        alone = _embed(minilm_session, tokenizer, [sentence])
        assert np.abs(alone[0] - batched[i]).max() < 1e-5


def test_minilm_tokenizer_truncates_like_sentence_transformers(tokenizer):
    cfg = json.loads((demo_models.minilm_package_dir() / "sentence_bert_config.json").read_text())
    assert tokenizer.model_max_length == cfg["max_seq_length"] == demo_models.MINILM_MAX_SEQ_LENGTH
    enc = tokenizer(["word " * 1000], truncation=True)
    assert len(enc["input_ids"][0]) == cfg["max_seq_length"]


def test_mlp_graph_signature(mlp_session):
    (i,) = mlp_session.get_inputs()
    assert (i.name, i.type, i.shape[1]) == ("features", "tensor(float)", 32)
    (o,) = mlp_session.get_outputs()
    assert (o.name, o.type, o.shape[1]) == ("probability", "tensor(float)", 1)


@pytest.mark.parametrize("n", [1, 7, 64])
def test_mlp_matches_torch(mlp_session, n):
    import torch

    module = demo_models.build_mlp_module()
    x, _ = demo_models.make_mlp_dataset(n, seed=7)
    with torch.no_grad():
        expected = module(torch.from_numpy(x)).numpy()
    (got,) = mlp_session.run(["probability"], {"features": x})
    assert got.shape == (n, 1)
    assert np.abs(got - expected).max() < 1e-6
    assert ((got > 0) & (got < 1)).all()


def test_mlp_is_deterministic():
    a = demo_models.build_mlp_module().state_dict()
    b = demo_models.build_mlp_module().state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] == b[k]).all(), k


def test_mlp_classifies(mlp_session):
    for seed in (demo_models.MLP_SEED, 12345):  # training data and held-out data
        x, y = demo_models.make_mlp_dataset(2000, seed=seed)
        (p,) = mlp_session.run(["probability"], {"features": x})
        accuracy = ((p[:, 0] > 0.5) == (y > 0.5)).mean()
        assert accuracy > 0.8, (seed, accuracy)


def test_configs(repo):
    minilm = tomllib.loads((repo / "minilm" / "config.toml").read_text())
    assert minilm == {
        "max_batch_size": 32,
        "max_queue_delay_ms": 5.0,
        "default_timeout_ms": 5000,
        "instance_count": 2,
        "padding": {"input_ids": 0, "attention_mask": 0},
        "tokenizer": {"path": "tokenizer", "max_length": 256},
    }
    mlp = tomllib.loads((repo / "mlp" / "config.toml").read_text())
    assert mlp == {"max_batch_size": 64, "max_queue_delay_ms": 10.0, "default_timeout_ms": 5000}


def test_import_does_not_load_torch():
    code = (
        "import sys, batchline.demo_models\n"
        "heavy = {'torch', 'transformers', 'sentence_transformers', 'onnx'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_cli_help(capsys):
    with pytest.raises(SystemExit) as exc:
        demo_models.main(["--help"])
    assert exc.value.code == 0
    assert "--force" in capsys.readouterr().out


# Kept last in the file: force=True rewrites the shared repository.
def test_build_is_idempotent_and_force_rebuilds(repo):
    onnx_files = [repo / name / "1" / "model.onnx" for name in ("minilm", "mlp")]
    # Back-date the files so a rewrite is visible regardless of the
    # filesystem's timestamp granularity.
    old_ns = 1_000_000_000 * 10**9
    for f in onnx_files:
        os.utime(f, ns=(old_ns, old_ns))

    demo_models.build_repository(repo)
    assert [f.stat().st_mtime_ns for f in onnx_files] == [old_ns, old_ns]

    demo_models.build_repository(repo, force=True)
    assert all(f.stat().st_mtime_ns != old_ns for f in onnx_files)
    # The rebuilt files are still valid models.
    (p,) = _session(onnx_files[1]).run(None, {"features": np.zeros((2, 32), np.float32)})
    assert p.shape == (2, 1)
