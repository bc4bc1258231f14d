"""Incremental detokenization: text deltas that never split a multi-byte character."""
from __future__ import annotations


class IncrementalDetokenizer:
    """Decodes a growing list of ids; `step` returns only the newly finished text.

    It re-decodes a short window (from prefix_offset) rather than the whole output, and
    holds back text ending in U+FFFD (an incomplete UTF-8 sequence split across tokens).
    The text so far is kept as the pieces the steps released: a step appends one, and reading
    the end of the text (`tail`) walks back over the last few, so no step copies the whole text
    (`text` joins them, for whoever needs all of it).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.prefix_offset = 0
        self.read_offset = 0
        self._pieces: list[str] = []
        self.length = 0  # characters of text

    @property
    def text(self) -> str:
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def tail(self, n: int) -> str:
        """The last n characters of text (all of it when it is shorter)."""
        if n <= 0:
            return ""
        got, size = [], 0
        for piece in reversed(self._pieces):
            got.append(piece)
            size += len(piece)
            if size >= n:
                break
        joined = "".join(reversed(got))
        return joined[len(joined) - n:] if size > n else joined

    def cut(self, keep: int, then: str = "") -> None:
        """text becomes its first `keep` characters followed by `then` (a stop string ends it there)."""
        head = self.text[:keep]
        self._pieces = [head + then]
        self.length = keep + len(then)

    def _append(self, delta: str) -> None:
        if delta:
            self._pieces.append(delta)
            self.length += len(delta)

    def step(self, ids: list[int]) -> str:
        dec = self.tokenizer.decode
        prefix = dec(ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        full = dec(ids[self.prefix_offset :], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(ids)
            self._append(delta)
            return delta
        return ""

    def pending(self, ids: list[int]) -> str:
        """The whole characters decoded past `text` but not released yet: `step` holds back a
        window that ends in an incomplete character, yet its complete part can already end a
        stop string (a token "yz\\xc3" completes "yz" though the "\\xc3" waits for its
        continuation)."""
        dec = self.tokenizer.decode
        prefix = dec(ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        full = dec(ids[self.prefix_offset :], skip_special_tokens=True)
        return full[len(prefix) :].rstrip("\ufffd") if len(full) > len(prefix) else ""

    def stop_prefix_len(self, stops: list[str]) -> int:
        """Length of the longest end of `text` that begins some stop string (shorter than it).

        A stream holds those characters back: the next tokens may complete the stop string,
        and then they must never have been shown."""
        end = self.tail(max(len(s) for s in stops) - 1)
        best = 0
        for s in stops:
            for k in range(min(len(s) - 1, len(end)), best, -1):
                if end.endswith(s[:k]):
                    best = k
                    break
        return best

    def flush(self, ids: list[int]) -> str:
        """At the end: whatever is left, even a dangling partial character."""
        prefix = self.tokenizer.decode(ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        full = self.tokenizer.decode(ids[self.prefix_offset :], skip_special_tokens=True)
        delta = full[len(prefix) :] if len(full) > len(prefix) else ""
        self.read_offset = self.prefix_offset = len(ids)
        self._append(delta)
        return delta
