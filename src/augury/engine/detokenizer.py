"""Incremental detokenization: text deltas that never split a multi-byte character."""
from __future__ import annotations


class IncrementalDetokenizer:
    """Decodes a growing list of ids; `step` returns only the newly finished text.

    It re-decodes a short window (from prefix_offset) rather than the whole output, and
    holds back text ending in U+FFFD (an incomplete UTF-8 sequence split across tokens).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def step(self, ids: list[int]) -> str:
        dec = self.tokenizer.decode
        prefix = dec(ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        full = dec(ids[self.prefix_offset :], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(ids)
            self.text += delta
            return delta
        return ""

    def flush(self, ids: list[int]) -> str:
        """At the end: whatever is left, even a dangling partial character."""
        prefix = self.tokenizer.decode(ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        full = self.tokenizer.decode(ids[self.prefix_offset :], skip_special_tokens=True)
        delta = full[len(prefix) :] if len(full) > len(prefix) else ""
        self.read_offset = self.prefix_offset = len(ids)
        self.text += delta
        return delta
