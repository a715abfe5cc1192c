"""The choice of each next token from the logits, by a request's sampling parameters (batchline/sampling.py).

A token's draw depends only on the sequence's seed, the token's index in the output and the logits:
a sequence preempted and recomputed here, or continued on another executor from the tokens already
sent, draws the same tokens as one that ran uninterrupted.
"""
from __future__ import annotations

import numpy as np

from batchline.sampling import SamplingError, SamplingParams


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
