"""One request's logit shaping: logit bias, bad words, repetition / frequency / presence penalties and
a grammar's mask, at the request's committed output plus whatever a verification walk pushed.

The same object shapes a decode step's row and every tree node a speculative verification visits:
the verifier pushes each accepted draft (the grammar's matcher accepts it, the penalty counts grow)
and pops them all when the walk is done; only Engine.commit advances the committed state. So a
node's logits are shaped exactly as a decode step at that node's position would shape them, and
greedy speculative output under any of these equals greedy plain output.
"""
from __future__ import annotations

import bisect
import time
from collections.abc import Sequence

import numpy as np
import torch

from augury.sampling import NO_TOKEN, argmax_ids
from augury.sampling_params import SamplingParams
from augury.structured.backend import GrammarBackend, ShapingStats

MAX_FORCED = 32  # forced tokens looked up per tree node (jump-forward drafts)


def bad_word_ids(tokenizer, words: Sequence[str]) -> list[list[int]]:
    """Each word's token ids as it appears in text: without and with a leading space (both are banned;
    vLLM keeps the spaced form only where it has as many tokens as the plain one)."""
    out: dict[tuple[int, ...], None] = {}  # insertion-ordered, each spelling once (a set's lookups)
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids:
                out.setdefault(ids)
    return [list(ids) for ids in out]


class RequestShaper:
    """augury.sampling.LogitsShaper for one request."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int], vocab_size: int, device: torch.device,
                 matcher=None, backend: GrammarBackend | None = None, bad_words: list[list[int]] | None = None,
                 stats: ShapingStats | None = None, stop_ids: Sequence[int] = ()) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.matcher = matcher
        self.backend = backend
        self.has_grammar = matcher is not None
        self.stats = stats or ShapingStats()
        self._bitmask = backend.new_bitmask(1) if backend is not None and matcher is not None else None
        self._bits = self._bitmask.numpy() if self._bitmask is not None else None  # the same memory
        p = params
        self.presence, self.frequency, self.repetition = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
        self.counts: torch.Tensor | None = None  # [V] float32: output tokens so far (committed + pushed)
        if self.presence or self.frequency:
            self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        self.seen: torch.Tensor | None = None  # [V] bool: tokens in the prompt or the output
        if self.repetition != 1.0:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.seen[torch.tensor(sorted(set(prompt_ids)), dtype=torch.long, device=device)] = True
        self.bias_ids = self.bias_values = None
        if p.logit_bias:
            self.bias_ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=device)
            self.bias_values = torch.tensor(list(p.logit_bias.values()), dtype=torch.float32, device=device)
        # min_tokens: the tokens that would end the request (EOS unless ignore_eos, stop_token_ids) are
        # masked while the output (committed + pushed, so a verification node is shaped as a decode
        # step at its position would be) is shorter than min_tokens
        self.min_tokens = p.min_tokens
        ends = sorted({t for t in stop_ids if 0 <= t < vocab_size})
        self.min_stop = torch.tensor(ends, dtype=torch.long, device=device) if p.min_tokens and ends else None
        words = bad_words or []
        single = sorted({w[0] for w in words if len(w) == 1})
        self.bad_single = torch.tensor(single, dtype=torch.long, device=device) if single else None
        self.bad_multi = [w for w in words if len(w) > 1]
        self.output: list[int] = []  # output tokens (committed, then pushed): bad words' context
        self._pushed = 0  # tokens pushed on top of the committed state
        self._newly_seen: list[int] = []  # pushed tokens that set a `seen` flag (cleared on pop)
        self._matched = 0  # pushed tokens the matcher accepted (rolled back on pop)
        self._off_grammar = False  # a pushed token the grammar refused: no mask past it (never committed)
        self._filled: bool | None = None  # the bitmask holds the current state's mask (True: it masks)
        # a grammar's requests: the output's bytes and each token's first byte in them (forced_tokens
        # spells forced text as the output last did)
        self._text: bytearray | None = bytearray() if self.matcher is not None else None
        self._starts: list[int] = []

    # ----------------------------------------------------------------- shaping
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] float32 (in place) -> shaped for the next token at the current state."""
        self._shape(logits)
        self._mask(logits)
        return logits

    def greedy(self, logits: torch.Tensor) -> int:
        """The greedy token of apply(logits) (logits [V] float32, shaped in place), the first index on
        ties, without masking the row where the grammar allows its unmasked argmax: that token is then
        the masked row's first largest value too (every earlier index is smaller, masked or not). The
        bitmask is filled all the same; applying it is what this saves (JSON at batch 1 on an AMX Xeon:
        a constrained greedy decode row's sampling 0.23 ms with it, 0.13 ms without)."""
        self._shape(logits)
        tok = argmax_ids(logits.view(1, -1))[0]
        if self._mask(logits, unless=tok if tok != NO_TOKEN else None):
            tok = argmax_ids(logits.view(1, -1))[0]  # NO_TOKEN where the mask left nothing
        return tok

    def shapes_beyond_mask(self) -> bool:
        """Whether anything but the grammar's mask shapes the next token at the current state: a logit
        bias, bad words, penalties, or min_tokens' mask of the tokens that would end the output."""
        return self.bias_ids is not None or self.bad_single is not None or bool(self.bad_multi) \
            or self.seen is not None or self.counts is not None \
            or (self.min_stop is not None and len(self.output) < self.min_tokens)

    def greedy_at(self, ids: np.ndarray, values: np.ndarray) -> int:
        """greedy() of a row whose logits are `values` at `ids` (allowed_ids at the current state) and
        -inf elsewhere, from those values alone, where shapes_beyond_mask() is False: the mask leaves the
        row as it is, so its greedy token is the first largest of the values (ids ascend: the first index
        on a tie, as argmax over the whole row), or NO_TOKEN where that is not finite (nothing allowed, or
        a NaN or infinity, as argmax_ids)."""
        self.stats.masked_tokens += 1
        if not len(ids):
            return NO_TOKEN
        i = int(np.argmax(values))
        return int(ids[i]) if np.isfinite(values[i]) else NO_TOKEN

    def _mask(self, logits: torch.Tensor, unless: int | None = None) -> bool:
        """Apply the grammar's mask at the current state to logits [V], unless it allows token `unless`;
        True when it was applied. Timed into the stats."""
        if not self._masking():
            return False
        t0 = time.perf_counter()
        applied = self._fill() and (unless is None or not self._allows(unless))
        if applied:
            self.backend.apply_bitmask(logits.view(1, -1), self._bitmask)
        self.stats.mask_seconds += time.perf_counter() - t0
        self.stats.masked_tokens += 1
        return applied

    def _masking(self) -> bool:
        """Whether a grammar's mask shapes the next token (not past a refused draft or the grammar's end)."""
        return self.matcher is not None and not self._off_grammar and not self.matcher.is_terminated()

    def _fill(self) -> bool:
        """The bitmask filled at the current state (once a state); True when it refuses any token."""
        if self._filled is None:
            self._filled = bool(self.matcher.fill_next_token_bitmask(self._bitmask))
        return self._filled

    def allowed_ids(self, limit: int) -> np.ndarray | None:
        """The tokens the grammar's mask allows next (sorted int64 ids), where a mask applies, covers the
        whole vocabulary and allows at most `limit` tokens; else None. A row computed at these tokens
        alone, -inf elsewhere (TargetModel.masked_logits), is what apply() makes of the whole row: the
        mask sets every other token to -inf, and the penalties, bias and bad words leave -inf as it is.
        The bitmask stays filled for the row's shaping."""
        if not self._masking():
            return None
        t0 = time.perf_counter()
        ids = None
        if self._fill() and self._bits.shape[-1] * 32 >= self.vocab_size:
            words = np.flatnonzero(self._bits[0])  # bit j of word i: token 32 i + j
            held = self._bits[0, words]
            if int(np.bitwise_count(held).sum()) <= limit:
                row, bit = np.nonzero(np.unpackbits(held.view(np.uint8), bitorder="little").reshape(len(words), 32))
                ids = words[row] * 32 + bit
                ids = ids[ids < self.vocab_size]
        self.stats.mask_seconds += time.perf_counter() - t0
        return ids

    def _allows(self, token: int) -> bool:
        """Whether the filled bitmask allows `token` (bit token % 32 of word token // 32; a token past the
        words counts as refused, which only costs applying the mask)."""
        word = token >> 5
        return word < self._bits.shape[-1] and bool((int(self._bits[0, word]) >> (token & 31)) & 1)

    def _shape(self, logits: torch.Tensor) -> None:
        """Everything apply does but the grammar's mask."""
        if self.min_stop is not None and len(self.output) < self.min_tokens:
            logits.index_fill_(0, self.min_stop, float("-inf"))
        if self.bias_ids is not None:
            logits.index_add_(0, self.bias_ids, self.bias_values)
        if self.bad_single is not None:
            logits.index_fill_(0, self.bad_single, float("-inf"))
        for word in self.bad_multi:
            n = len(word) - 1
            if len(self.output) >= n and self.output[-n:] == word[:-1]:
                logits[word[-1]] = float("-inf")
        if self.seen is not None:
            r = self.repetition
            seen = self.seen
            logits.copy_(torch.where(seen & (logits > 0), logits / r, torch.where(seen, logits * r, logits)))
        if self.counts is not None:
            logits.sub_(self.counts * self.frequency + (self.counts > 0).to(torch.float32) * self.presence)

    # ----------------------------------------------------------------- state
    def _add(self, token: int) -> None:
        self._filled = None
        self.output.append(token)
        if self._text is not None:
            self._starts.append(len(self._text))
            vocab = self.backend.token_bytes
            self._text += vocab[token] if token < len(vocab) else b""
        if self.counts is not None:
            self.counts[token] += 1
        if self.seen is not None and not bool(self.seen[token]):
            self.seen[token] = True
            if self._pushed:
                self._newly_seen.append(token)

    def push(self, token: int) -> None:
        self._pushed += 1
        self._add(token)
        if self.matcher is not None and not self._off_grammar:
            # past the grammar's end (a draft after its stop token) nothing more is allowed; asking the
            # terminated matcher would only make xgrammar log a warning per token
            if not self.matcher.is_terminated() and self.matcher.accept_token(token):
                self._matched += 1
            else:
                self._off_grammar = True

    def pop_all(self) -> None:
        if not self._pushed:
            return
        undone = self.output[-self._pushed:]
        del self.output[-self._pushed:]
        if self._text is not None:
            del self._text[self._starts[-self._pushed]:]
            del self._starts[-self._pushed:]
        if self.counts is not None:
            self.counts.index_add_(0, torch.tensor(undone, dtype=torch.long, device=self.device),
                                   torch.full((len(undone),), -1.0, device=self.device))
        if self.seen is not None and self._newly_seen:
            self.seen[torch.tensor(self._newly_seen, dtype=torch.long, device=self.device)] = False
        if self._matched:
            self.matcher.rollback(self._matched)
        self._filled = None
        self._pushed = self._matched = 0
        self._newly_seen = []
        self._off_grammar = False

    def commit(self, token: int) -> bool:
        if self._pushed:
            raise RuntimeError("RequestShaper.commit while a verification walk's tokens are pushed")
        self._add(token)
        if self.matcher is None:
            return False
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"the grammar refused committed token {token}: a token was chosen outside its mask")
        return self.matcher.is_terminated()

    @property
    def terminated(self) -> bool:
        return self.matcher is not None and self.matcher.is_terminated()

    # ----------------------------------------------------------------- drafts
    def forced_tokens(self, limit: int = MAX_FORCED) -> list[int]:
        """Tokens the grammar forces from the current state (jump-forward), at most `limit`.

        The forced text is spelled as this request's output last spelled the same text (a key repeated
        in an array of objects: the target wrote SmolLM2's "grams" as g|rams after ' "' where the
        tokenizer writes one token, refused each time), or as the model's tokenizer writes it where
        that reaches further (the target was trained on that: xgrammar's own greedy longest-match
        tokens split e.g. SmolLM2's "hobbies" as ho|bb|ies where the tokenizer, and the model under
        the mask, write h|ob|bies), as far as xgrammar's tokens reach (past that a token could still
        merge with the text the model writes next), each token checked with the matcher; xgrammar's
        tokens where neither spelling holds. Where jump-forward stops short of the forced text (its last
        token could merge with more) or the grammar is complete, and the grammar allows one token alone
        there (an object's closing '}', the stop token, which jump-forward leaves out), that token is
        drafted too, and jump-forward goes on from it: an answer's last step is drafted with its
        closing text and its stop token."""
        m = self.matcher
        if m is None or self._off_grammar or m.is_terminated() or limit <= 0:
            return []
        out: list[int] = []
        while len(out) < limit and not m.is_terminated():
            text = m.find_jump_forward_string().encode()
            part = self._jump(text, limit - len(out)) if text else []
            if not part and (text or m.is_completed()):
                sole = self._sole_token()  # e.g. '}' that xgrammar left out (it could merge), or the stop token
                part = [sole] if sole is not None else []
            n = self._advance(part)
            out += part[:n]
            if not part or n < len(part):
                break
        if out:
            m.rollback(len(out))
        return out

    def _jump(self, text: bytes, limit: int) -> list[int]:
        """The tokens forced_tokens drafts for the matcher's jump-forward text (not accepted)."""
        fallback = list(self.matcher.find_jump_forward_tokens())
        if not fallback:
            return []
        vocab = self.backend.token_bytes
        safe = sum(len(vocab[t]) for t in fallback)  # bytes xgrammar deems safe to force
        out, covered = fallback[:limit], -1
        encoded = self._encoded(text, safe, limit)
        for ids in (self._respelled(text[:safe], encoded, limit), encoded):
            n = sum(len(vocab[t]) for t in ids)
            # the output's own spelling unless the tokenizer's reaches further
            if ids and n > covered and b"".join(vocab[t] for t in ids) == text[:n] and self._accepts(ids):
                out, covered = ids, n
        return out

    def _advance(self, ids: Sequence[int]) -> int:
        """Feed ids to the matcher until it refuses one or has ended; how many it took (the caller
        rolls them back)."""
        m, n = self.matcher, 0
        for t in ids:
            if m.is_terminated() or not m.accept_token(t):
                break
            n += 1
        return n

    def _accepts(self, ids: list[int]) -> bool:
        """Whether the matcher takes ids one after another from its state (left unchanged)."""
        n = self._advance(ids)
        if n:
            self.matcher.rollback(n)
        return n == len(ids)

    def _encoded(self, text: bytes, safe: int, limit: int) -> list[int]:
        """text as the tokenizer writes it, the tokens within its first `safe` bytes (at most limit)."""
        vocab, ids, seen = self.backend.token_bytes, [], 0
        for t in self.backend.tokenizer.encode(text.decode("utf-8", "replace"), add_special_tokens=False):
            seen += len(vocab[t]) if t < len(vocab) else safe + 1
            if seen > safe or len(ids) == limit:
                break
            ids.append(t)
        return ids

    def _respelled(self, text: bytes, encoded: list[int], limit: int) -> list[int]:
        """text spelled as the output last spelled it from its start or, failing that, from a later
        token of its encoding (the encoding's tokens before it kept); [] when the output never did."""
        vocab, at = self.backend.token_bytes, 0
        for i in range(len(encoded) + 1):
            tail = self._spelled(text[at:], limit - i)
            if tail:
                return encoded[:i] + tail
            if i < len(encoded):
                at += len(vocab[encoded[i]])
        return []

    def _spelled(self, text: bytes, limit: int) -> list[int]:
        """The tokens of this request's output that last spelled `text` from a token's start, those
        within it (at most limit); [] when the output has not written it so."""
        buf, starts = self._text, self._starts
        if not text or buf is None:
            return []
        end = len(buf)
        for _ in range(4):  # the latest few occurrences
            at = buf.rfind(text, 0, end)
            if at < 0:
                return []
            i = bisect.bisect_left(starts, at)
            if i < len(starts) and starts[i] == at:
                ids, stop = [], at + len(text)
                for j in range(i, min(len(starts), i + limit)):
                    nxt = starts[j + 1] if j + 1 < len(starts) else len(buf)
                    if nxt > stop:
                        break
                    ids.append(self.output[j])
                return ids
            end = at + len(text) - 1
        return []

    def _sole_token(self) -> int | None:
        """The one token the grammar allows at the matcher's state, None when it allows more (or none)."""
        t0 = time.perf_counter()
        self.matcher.fill_next_token_bitmask(self._bitmask)
        self._filled = None  # filled at another state than the request's
        words = np.flatnonzero(self._bits[0])
        tok = None
        if len(words) == 1:
            w = int(self._bits[0, words[0]]) & 0xFFFFFFFF
            if w & (w - 1) == 0:
                tok = int(words[0]) * 32 + w.bit_length() - 1
        self.stats.mask_seconds += time.perf_counter() - t0
        return tok if tok is not None and tok < self.vocab_size else None

    def plan_tree(self, tokens: Sequence[int], parents: Sequence[int], size: int,
                  capacity: int) -> tuple[list[int], list[tuple[int, list[int]]]]:
        """Walk one draft tree (node 0 the root, at the committed state) with the matcher: keep the
        nodes whose token the grammar allows after their kept parent (a refused node goes with its
        subtree), and hang the grammar's forced continuation under each kept node none of whose
        kept children starts it, while the tree has room (`capacity` nodes in all), best-scored
        nodes first. Without a grammar: every node, no chains."""
        if self.matcher is None:
            return list(range(size)), []
        kids: list[list[int]] = [[] for _ in range(size)]
        for i in range(1, size):
            kids[parents[i]].append(i)
        keep = [0]
        m = self.matcher

        def visit(node: int) -> None:  # the matcher is at `node`'s state; collect its allowed subtree
            if m.is_terminated():  # past the grammar's stop token nothing is allowed (and xgrammar would warn)
                return
            for c in kids[node]:
                if m.accept_token(tokens[c]):
                    keep.append(c)
                    visit(c)
                    m.rollback(1)

        if not self._off_grammar and not m.is_terminated():
            visit(0)
        keep.sort()
        first_kid = {}
        for i in keep[1:]:
            first_kid.setdefault(parents[i], set()).add(tokens[i])
        room = capacity - len(keep)
        chains: list[tuple[int, list[int]]] = []
        if room <= 0 or self._off_grammar:
            return keep, chains
        for node in keep:  # index order: the best-scored first
            if room <= 0:
                break
            path = []
            n = node
            while n > 0:
                path.append(tokens[n])
                n = parents[n]
            ok = self._advance(path[::-1])
            if ok == len(path):
                forced = self.forced_tokens(room)
                if forced and forced[0] not in first_kid.get(node, ()):
                    chains.append((node, forced))
                    room -= len(forced)
            if ok:
                m.rollback(ok)
        return keep, chains
