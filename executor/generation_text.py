"""A sequence's output as text, a few tokens at a time: incremental detokenization and stop strings.

Decoding each new token alone is wrong twice over: a byte-level BPE token may hold part of a
character's UTF-8 bytes (decoded alone it is U+FFFD), and a tokenizer's decoder may change a
token's text by what precedes it (leading spaces). So the text of a window of recent tokens is
decoded and only what it adds past the window's previous text is taken, and nothing while that
ends in an incomplete character (the method of text-generation-inference and vLLM).
"""
from __future__ import annotations

from typing import Sequence

from tokenizers import Tokenizer

# Prompt tokens decoded ahead of the output, so its first token's text is the one it has in context.
CONTEXT_TOKENS = 5
REPLACEMENT = "\ufffd"


class OutputText:
    """The text of a sequence's output tokens, cut at the first stop string."""

    def __init__(self, tokenizer: Tokenizer, prompt: Sequence[int], stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt[-CONTEXT_TOKENS:])
        self.prefix = 0  # self.ids[prefix:read] is the window whose text was last taken
        self.read = len(self.ids)
        self.stop = tuple(stop)
        self.text = ""
        self.sent = 0  # chars of self.text handed out by take()
        self.stopped = False

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def add(self, token: int) -> bool:
        """Append a token's text; true when a stop string has appeared (the text is then cut before it)."""
        if self.stopped:
            raise ValueError("the output already ended at a stop string")
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        new = len(before)
        if before.endswith(REPLACEMENT):
            # The prompt's ids may end inside a character (ids cut anywhere): a token that completes it
            # turns its U+FFFD into the character, which is the output's. Bytes that stay invalid keep
            # their U+FFFD, which is the prompt's.
            new = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), new)
        if len(after) > new and not after.endswith(REPLACEMENT):
            searched_from = max(0, len(self.text) - max((len(s) for s in self.stop), default=0) + 1)
            self.text += after[new:]
            self.prefix, self.read = self.read, len(self.ids)
            found = [i for i in (self.text.find(s, searched_from) for s in self.stop) if i >= 0]
            if found:
                self.text = self.text[:min(found)]
                self.stopped = True
        return self.stopped

    def take(self, final: bool = False) -> str:
        """The text not handed out yet. Until `final`, the last characters that could begin a stop
        string are held back, so that no text beyond a stop string is ever sent."""
        hold = 0 if final or self.stopped else max((len(s) for s in self.stop), default=1) - 1
        end = max(self.sent, len(self.text) - hold)
        out, self.sent = self.text[self.sent:end], end
        return out
