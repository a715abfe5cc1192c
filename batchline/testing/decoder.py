"""The demo decoder for the generation tests and benchmark: built once into a directory, its reference
greedy outputs from transformers on the same weights, and prompts of mixed lengths."""
from __future__ import annotations

import pathlib

import numpy as np

from batchline import demo_decoder


def build_gpt(root: pathlib.Path, in_place: bool = True, shape: demo_decoder.Shape = demo_decoder.DEMO,
              dtype: str = "float32") -> pathlib.Path:
    """`root`/gpt, built as `batchline build-models` builds it (config.toml last, as the repository does),
    unless one of that shape and layout is there; `in_place=False`: the traced graph whose cache the
    engine gathers and writes back; `dtype` float16: for the CUDA provider (in place only)."""
    model_dir = root / "gpt"
    config = model_dir / "config.toml"
    # The graph's type is not in the config's keys: a comment says it, so that a float32 graph is
    # not taken for the float16 one asked for.
    text = shape.config(in_place) + f"# the graph's type: {dtype}\n"
    if not config.is_file() or config.read_text() != text:
        demo_decoder.build(model_dir, shape, in_place, dtype)
        config.write_text(text)
    return model_dir


def mixed_prompts(count: int, seed: int = 0, longest: int = 150) -> list[list[int]]:
    """`count` prompts of random token ids (never the end-of-text id), lengths from 1 to `longest`,
    most short and a few long, as real prompts are."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(longest, 1 + rng.geometric(1 / 24, size=count))
    lengths[:2] = (1, longest)
    return [rng.integers(1, demo_decoder.VOCAB_SIZE, size=int(n)).tolist() for n in lengths]


class Reference:
    """transformers' GPT2LMHeadModel.generate on the weights the ONNX graph was exported from."""

    def __init__(self, shape: demo_decoder.Shape = demo_decoder.DEMO) -> None:
        self.model = demo_decoder.build_reference_model(shape)

    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens, fewer when the end-of-text token comes (it is the last then)."""
        import torch

        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                      do_sample=False, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    def clear(self, prompt: list[int], tokens: list[int], margin: float = 1e-3) -> bool:
        """Whether every token of the greedy `tokens` after `prompt` won its step by more than `margin`
        in logit: a near tie is decided by rounding, which differs between a batched run, a run
        padded to another length and a recomputed one, so only a clear run can be compared exactly."""
        import torch

        with torch.no_grad():
            logits = self.model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        top = torch.topk(logits, 2).values
        return bool(((top[:, 0] - top[:, 1]) > margin).all())
