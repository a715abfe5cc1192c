"""Real English sentences of many lengths, from a text every Python ships: the reference manual's
topics (pydoc_data.topics). Nothing is downloaded."""
from __future__ import annotations

import random
import re

# Sentences shorter than this are mostly headings and code fragments; longer, run-on listings.
MIN_CHARS, MAX_CHARS = 40, 400


def python_doc_sentences(n: int | None = None, seed: int = 0) -> list[str]:
    """`n` sentences (all, when None) from the Python reference manual, shuffled with `seed`."""
    from pydoc_data.topics import topics

    text = re.sub(r"\s+", " ", " ".join(topics[k] for k in sorted(topics)))
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text)]
    sentences = [s for s in sentences if MIN_CHARS <= len(s) <= MAX_CHARS and s[0].isupper()]
    random.Random(seed).shuffle(sentences)
    return sentences if n is None else sentences[:n]
