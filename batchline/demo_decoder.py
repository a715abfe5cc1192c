"""The demo generative model: a small GPT-2 with random weights and a byte-level BPE tokenizer.

``gpt`` is built into ``<repo>/gpt/1/model.onnx`` with its tokenizer in ``<repo>/gpt/tokenizer/``.
No package ships a GPT-style decoder small enough, so the weights are random (a fixed seed): the
text it writes is nonsense, but every step of generation (prefill, cache, sampling, stopping,
detokenization) runs as it would for a trained model. The tokenizer is a byte-level BPE, the kind
GPT-2 and Llama 3 use, trained in code on Python's reference manual (pydoc_data, which every Python
ships): its tokens split multi-byte characters, the case incremental detokenization has to get
right, which the WordPiece tokenizer shipped with minilm never produces.

The graph (batchline/decoder_graph.py) takes ``input_ids``, ``position_ids`` [batch, sequence] and
``attention_mask`` [batch, total], and the key/value cache as buffers ``past.<layer>.key|value``
[batch, heads, max_context, head_dim] that its attention updates in place: the present outputs are
those buffers, and the engine binds both to its slots (``cache_in_place``). ``build(...,
in_place=False)`` exports the other kind a decoder can be, traced from transformers: the past is
exactly the cached positions and the presents return only the new ones, which the engine gathers
and writes back around each run.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # heavy imports stay out of module import time
    import torch
    from tokenizers import Tokenizer

VOCAB_SIZE = 4096
MAX_CONTEXT = 256
SEED = 0
END_OF_TEXT = "<|endoftext|>"


@dataclass(frozen=True)
class Shape:
    """A decoder's size: the demo's is tiny, so that tests build and run it in seconds."""
    layers: int
    heads: int
    embedding: int

    def __post_init__(self) -> None:
        if min(self.layers, self.heads, self.embedding) < 1 or self.embedding % self.heads:
            raise ValueError(f"a shape needs layers, heads and an embedding divisible by the heads, got {self}")

    def config(self, in_place: bool = True) -> str:
        """The model's config.toml (`in_place`: for the graph that updates its cache in place)."""
        layers = range(self.layers)
        return f"""\
# A GPT-2 of {self.layers} layers x {self.embedding} with random weights (fixed seed) and a byte-level BPE
# tokenizer: a demo decoder. Sequences in one decode step.
max_batch_size = 32
[generation]
cache_inputs = [{", ".join(f'"past.{i}.key", "past.{i}.value"' for i in layers)}]
cache_outputs = [{", ".join(f'"present.{i}.key", "present.{i}.value"' for i in layers)}]
eos_token_ids = [0]
max_context = {MAX_CONTEXT}
tokenizer = "tokenizer"
cache_in_place = {"true" if in_place else "false"}
"""

    def cache_mb(self, sequences: int, dtype: str = "float32") -> float:
        """MiB of key/value cache that `sequences` at the full context take in `dtype`."""
        import numpy as np

        return sequences * MAX_CONTEXT * self.layers * 2 * self.embedding * np.dtype(dtype).itemsize / 2**20


DEMO = Shape(layers=4, heads=4, embedding=128)
# GPT-2 small's layers, heads and width (with the demo's vocabulary and context): a decoder whose
# compute, not the serving around it, is most of a token's cost (benchmarks/generation.py --shape).
GPT2_SMALL = Shape(layers=12, heads=12, embedding=768)
SHAPES = {"demo": DEMO, "gpt2-small": GPT2_SMALL}
LAYERS, HEADS, EMBEDDING = DEMO.layers, DEMO.heads, DEMO.embedding
CONFIG = DEMO.config()


def train_tokenizer() -> "Tokenizer":
    """The byte-level BPE, trained on Python's reference manual: the same one on every build."""
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=[END_OF_TEXT], show_progress=False,
        # Every byte is a token of its own, so any text encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([topics[k] for k in sorted(topics)], trainer)
    return tokenizer


def build_reference_model(shape: Shape = DEMO) -> "torch.nn.Module":
    """The transformers GPT2LMHeadModel that the ONNX graph is exported from (eval mode, same weights every call)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB_SIZE, n_positions=MAX_CONTEXT, n_embd=shape.embedding, n_layer=shape.layers,
        n_head=shape.heads,
        bos_token_id=0, eos_token_id=0, attn_implementation="eager",
        # Ten times GPT-2's: at 0.02 random weights repeat one token for a dozen steps, which would
        # hide a cache that feeds the wrong positions; at 0.2 the next token depends on the context.
        initializer_range=0.2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = GPT2LMHeadModel(config)
    return model.eval()


def build_decoder_module(model: "torch.nn.Module") -> "torch.nn.Module":
    """`model` as a graph with flat cache inputs and outputs.

    Attention is written out here on the model's own weights and layers: transformers' cache
    classes and mask builders do not trace to a graph whose cache is a plain tensor pair.
    """
    import torch

    class Decoder(torch.nn.Module):
        def __init__(self, gpt: torch.nn.Module) -> None:
            super().__init__()
            self.gpt = gpt

        def forward(self, input_ids, position_ids, attention_mask, *past):
            body = self.gpt.transformer
            heads = body.config.n_head
            hidden = body.wte(input_ids) + body.wpe(position_ids)
            batch, new = input_ids.shape[0], input_ids.shape[1]
            total = attention_mask.shape[1]
            # New position i sits at column total - new + i: it sees the columns up to its own
            # that the attention mask keeps.
            columns = torch.arange(total).unsqueeze(0)
            rows = torch.arange(new).unsqueeze(1) + (total - new)
            allowed = (columns <= rows).unsqueeze(0).unsqueeze(0) & attention_mask.bool()[:, None, None, :]
            presents = []
            for i, block in enumerate(body.h):
                x = block.ln_1(hidden)
                q, k, v = block.attn.c_attn(x).split(body.config.n_embd, dim=2)
                q, k, v = (t.view(batch, new, heads, -1).transpose(1, 2) for t in (q, k, v))
                past_k, past_v = past[2 * i], past[2 * i + 1]
                # Only the new positions go out (the engine keeps its cache in its slots), and attention
                # is taken over the past and the new positions apart: concatenating them would copy the
                # whole cache once more every step, as much as a step's matrix products on a
                # GPT-2-small-sized model (docs/design/generation.md).
                presents += [k, v]
                scale = q.shape[-1] ** -0.5
                scores = torch.cat([torch.matmul(q, past_k.transpose(-1, -2)), torch.matmul(q, k.transpose(-1, -2))],
                                   dim=-1) * scale
                scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
                weights = torch.softmax(scores, dim=-1)
                cached = past_k.shape[2]
                attended = torch.matmul(weights[..., :cached], past_v) + torch.matmul(weights[..., cached:], v)
                attended = attended.transpose(1, 2).reshape(batch, new, -1)
                hidden = hidden + block.attn.c_proj(attended)
                hidden = hidden + block.mlp(block.ln_2(hidden))
            logits = self.gpt.lm_head(body.ln_f(hidden))
            return (logits, *presents)

    return Decoder(model).eval()


def build(model_dir: Path, shape: Shape = DEMO, in_place: bool = True, dtype: str = "float32") -> None:
    """Write the graph and its tokenizer into `model_dir` (config.toml is the caller's: `shape.config(in_place)`).
    `dtype` float16 is for the CUDA provider, and only for the graph in place."""
    import torch

    from batchline.decoder_graph import in_place_graph
    from batchline.demo_models import MODEL_FILE, TOKENIZER_DIR, VERSION_DIR, _atomic_write, _export_onnx

    if in_place:
        graph = in_place_graph(build_reference_model(shape), MAX_CONTEXT, dtype)
        _atomic_write(model_dir / VERSION_DIR / MODEL_FILE, graph.SerializeToString())
        _atomic_write(model_dir / TOKENIZER_DIR / "tokenizer.json", train_tokenizer().to_str())
        return
    if dtype != "float32":
        raise ValueError(f"the traced graph is float32 only, not {dtype}")
    module = build_decoder_module(build_reference_model(shape))
    head_dim = shape.embedding // shape.heads
    # Batch 2, 3 new positions after 5 cached: distinct sizes so the tracer keeps every one free.
    batch, new, cached = 2, 3, 5
    past = [torch.zeros(batch, shape.heads, cached, head_dim) for _ in range(2 * shape.layers)]
    past_names = [f"past.{i}.{kind}" for i in range(shape.layers) for kind in ("key", "value")]
    present_names = [name.replace("past", "present") for name in past_names]
    axes = {"input_ids": {0: "batch", 1: "sequence"}, "position_ids": {0: "batch", 1: "sequence"},
            "attention_mask": {0: "batch", 1: "total"}, "logits": {0: "batch", 1: "sequence"}}
    axes |= {name: {0: "batch", 2: "past"} for name in past_names}
    axes |= {name: {0: "batch", 2: "sequence"} for name in present_names}
    _export_onnx(
        module,
        (torch.ones(batch, new, dtype=torch.int64), torch.arange(cached, cached + new).repeat(batch, 1),
         torch.ones(batch, cached + new, dtype=torch.int64), *past),
        model_dir / VERSION_DIR / MODEL_FILE,
        input_names=["input_ids", "position_ids", "attention_mask", *past_names],
        output_names=["logits", *present_names],
        dynamic_axes=axes,
    )
    _atomic_write(model_dir / TOKENIZER_DIR / "tokenizer.json", train_tokenizer().to_str())
