"""Incremental detokenization: text deltas that never split a multi-byte character."""
from __future__ import annotations


class IncrementalDetokenizer:
    """Decodes a growing list of ids; `step` returns only the newly finished text.

    It re-decodes a short window (from prefix_offset) rather than the whole output, and
    holds back text ending in U+FFFD (an incomplete UTF-8 sequence split across tokens).
    The text so far is kept as the pieces the steps released: a step appends one, and reading
    the end of the text (`tail`) walks back over the last few, so no step copies the whole text
    (`text` joins them, for whoever needs all of it).

    skip_special_tokens (default): special tokens are left out of the text. Without it,
    spaces_between_special_tokens (default) keeps the tokenizer's own decoding of them; False joins
    the text of every added token (special or not) to the text around it with nothing in between:
    the runs of ordinary tokens are decoded apart and the added tokens' text put between them (the
    decoders of some tokenizers, e.g. WordPiece's and SentencePiece's, put spaces there).
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # id -> text of each added token, where they are decoded apart from the text around them
        self._added: dict[int, str] | None = None
        if not skip_special_tokens and not spaces_between_special_tokens:
            added = getattr(tokenizer, "added_tokens_decoder", None) or {}
            self._added = {int(i): str(getattr(t, "content", t)) for i, t in added.items()}
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

    def _decode(self, ids: list[int]) -> str:
        if self._added is None:
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        parts: list[str] = []
        run: list[int] = []
        for t in ids:
            if t in self._added:
                if run:
                    parts.append(self.tokenizer.decode(run, skip_special_tokens=False))
                    run = []
                parts.append(self._added[t])
            else:
                run.append(t)
        if run:
            parts.append(self.tokenizer.decode(run, skip_special_tokens=False))
        return "".join(parts)

    def step(self, ids: list[int]) -> str:
        dec = self._decode
        prefix = dec(ids[self.prefix_offset : self.read_offset])
        full = dec(ids[self.prefix_offset :])
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
        dec = self._decode
        prefix = dec(ids[self.prefix_offset : self.read_offset])
        full = dec(ids[self.prefix_offset :])
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
        prefix = self._decode(ids[self.prefix_offset : self.read_offset])
        full = self._decode(ids[self.prefix_offset :])
        delta = full[len(prefix) :] if len(full) > len(prefix) else ""
        self.read_offset = self.prefix_offset = len(ids)
        self._append(delta)
        return delta
