"""augury's answer extension for requests with `return_token_sources: true`: how each generated token
came and what speculation did at each step, in an `augury` object beside a choice's content.

    "augury": {"tokens": [{"text": "{\"", "source": "forced"}, ...],
               "steps": [{"mode": "draft", "draft_tokens": 8, "accepted": 3, "reason": "on: ..."}, ...]}

`tokens`: one entry per generated token, in order, its source one of outputs.TOKEN_SOURCES ("head",
"lookup", "forced": an accepted draft of the EAGLE-3 head, of text lookup, a grammar's forced
token; "target": the target's own) and its text, decoded in the context of the tokens before it
(TokenPieces), so the texts join to the generated text; a token that ends inside a character
(byte-level tokenizers) has "" and the character comes with the token that completes it; a stop
string's cut is not applied to them. `steps`: one per decode step (outputs.SpecStep). A streamed
chunk carries the entries of the tokens and steps since the previous chunk (a chunk with an empty
delta where they showed no text yet); a whole answer carries them all. Requests that do not ask get
no `augury` object and cost nothing: the engine keeps no such lists for them.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from augury.outputs import RequestOutput

KEEP = 32  # ids kept behind the window before the list is trimmed


class TokenPieces:
    """Each token's text in the context of the tokens before it, one choice's tokens fed in order.

    Decoding a token alone loses what depends on its neighbours (a SentencePiece word's leading space,
    the bytes of a character split across tokens); this decodes a short window ending at the token
    and takes what it added (the incremental detokenizer's prefix/read offsets), holding back a
    piece that ends inside a character until a later token completes it."""

    def __init__(self, skip_special_tokens: bool = True) -> None:
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read]: context already shown
        self.read = 0
        self.skip = skip_special_tokens

    def feed(self, tok: Any, ids: list[int], final: bool = False) -> list[str]:
        """The pieces of `ids` (run on the tokenizer thread); final: they end the output, so the last one
        takes whatever is held (bytes no token completed decode as U+FFFD, as in the text). No
        tokenizer: "token_id:<id>" each."""
        if tok is None:
            return [f"token_id:{t}" for t in ids]
        out = []
        for i, t in enumerate(ids):
            self.ids.append(t)
            shown = tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=self.skip)
            text = tok.decode(self.ids[self.prefix:], skip_special_tokens=self.skip)
            last = final and i == len(ids) - 1
            if not last and (text.endswith("\ufffd") or not text.startswith(shown)):
                out.append("")  # inside a character: its text comes with a later token
                continue
            out.append(text[len(shown):])
            self.prefix, self.read = self.read, len(self.ids)  # the next window opens with this piece's tokens
            if self.prefix > KEEP:  # drop what no later window reads
                del self.ids[: self.prefix]
                self.read -= self.prefix
                self.prefix = 0
        return out


def asked(params: list) -> bool:
    """Whether a job's requests asked for the extension (SamplingParams.return_token_sources)."""
    return bool(params) and bool(params[0].return_token_sources)


class HeldProvenance:
    """Per choice of a stream: its TokenPieces, and the entries no chunk has carried yet."""

    def __init__(self, skip_special_tokens: bool = True) -> None:
        self.skip = skip_special_tokens
        self.pieces: dict[int, TokenPieces] = {}
        self.held: dict[int, tuple[list[dict[str, str]], list[dict[str, Any]]]] = {}

    def add(self, tok: Any, index: int, out: RequestOutput) -> None:
        """A delta output of choice `index` (on the tokenizer thread: it decodes)."""
        if out.token_sources is None:
            return
        texts = self.pieces.setdefault(index, TokenPieces(self.skip)).feed(tok, out.token_ids, out.finished)
        tokens, steps = self.held.setdefault(index, ([], []))
        tokens.extend({"text": x, "source": s} for x, s in zip(texts, out.token_sources))
        steps.extend(dataclasses.asdict(st) for st in out.spec_steps or [])

    def pending(self, index: int) -> bool:
        tokens, steps = self.held.get(index, ((), ()))
        return bool(tokens or steps)

    def take(self, index: int) -> dict[str, Any] | None:
        """The `augury` object of choice `index`'s next chunk (None: nothing held)."""
        held = self.held.pop(index, None)
        return {"tokens": held[0], "steps": held[1]} if held else None


def whole(tok: Any, out: RequestOutput, skip_special_tokens: bool = True) -> dict[str, Any] | None:
    """A whole answer's `augury` object (None: the request did not ask)."""
    if out.token_sources is None:
        return None
    texts = TokenPieces(skip_special_tokens).feed(tok, out.token_ids, final=True)
    return {"tokens": [{"text": x, "source": s} for x, s in zip(texts, out.token_sources)],
            "steps": [dataclasses.asdict(st) for st in out.spec_steps or []]}
