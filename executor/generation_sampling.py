"""A request's sampling parameters, checked, and the choice of each next token from the logits.

A token's draw depends only on the sequence's seed, the token's index in the output and the logits:
a sequence preempted and recomputed here, or continued on another executor from the tokens already
sent, draws the same tokens as one that ran uninterrupted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


class SamplingError(ValueError):
    """A sampling parameter out of range; the message names it and its range."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: every token
    seed: int | None = None  # None: one drawn when the sequence is added
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be an integer >= 1 (got {self.max_tokens!r})")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise SamplingError(f"temperature must be a number >= 0; 0 chooses greedily (got {self.temperature!r})")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise SamplingError(f"top_p must be in (0, 1] (got {self.top_p!r})")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingError(f"top_k must be an integer >= 0; 0 keeps every token (got {self.top_k!r})")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise SamplingError(f"seed must be an integer >= 0 (got {self.seed!r})")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if not all(isinstance(s, str) and s for s in self.stop):
            raise SamplingError(f"stop must be non-empty strings (got {self.stop!r})")
        object.__setattr__(self, "stop", tuple(self.stop))


def choose(logits: np.ndarray, params: SamplingParams, seed: int, index: int) -> int:
    """The next token from one position's logits [vocabulary]; `index` is its place in the output."""
    if params.temperature == 0:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64)
    scaled[np.isnan(scaled)] = -np.inf
    top = scaled.max()
    if top == np.inf:  # logits that overflowed (float16): those tokens are infinitely the likeliest
        scaled = np.where(scaled == np.inf, 0.0, -np.inf)
    elif top == -np.inf:
        raise SamplingError("the model's logits hold no finite value to sample from")
    else:
        # Shifted before dividing: the largest is 0 whatever the temperature, so a tiny one makes the
        # others -inf rather than inf - inf (NaN).
        scaled = (scaled - top) / params.temperature
    if params.top_k and params.top_k < scaled.size:
        cutoff = np.partition(scaled, -params.top_k)[-params.top_k]
        scaled = np.where(scaled >= cutoff, scaled, -np.inf)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if params.top_p < 1:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        # The smallest prefix whose mass reaches top_p; the most likely token always stays.
        keep = order[:int(np.searchsorted(cumulative, params.top_p)) + 1]
        kept = np.zeros_like(probs)
        kept[keep] = probs[keep]
        probs = kept / kept.sum()
    rng = np.random.default_rng([seed, index])
    return int(rng.choice(probs.size, p=probs))
