"""xgrammar over one tokenizer: compile a request's constraint (cached, bounded) and make its matcher.

Grammars are compiled by xgrammar's GrammarCompiler, whose cache (keyed by the constraint's text
and options) is bounded by CACHE_BYTES, least recently used first; masks are built on the CPU.
A backend is shared by the engine thread (matchers for admitted requests) and the server's
grammar threads (compiling a request's constraint before admission, so a bad schema is a 400
before anything streams, and handing the compiled grammar to the engine with the request:
StructuredOutputsParams.compiled, so the engine thread never compiles a server's request). No lock:
xgrammar's compiler and its cache take concurrent compiles (vLLM compiles from a thread pool too),
so a slow compile holds neither the engine thread nor another request's compile; matchers are per
request.
"""
from __future__ import annotations

import json
import re

import numpy as np
from dataclasses import dataclass

from augury.sampling_params import StructuredOutputsParams

CACHE_BYTES = 64 * 2**20  # compiled grammars kept (xgrammar's LRU cache); more are compiled again


@dataclass
class ShapingStats:
    """Counters the server's /metrics reads (written by the engine thread only)."""

    constrained_requests: int = 0  # requests admitted with a grammar
    mask_seconds: float = 0.0  # time spent filling and applying grammar masks
    masked_tokens: int = 0  # rows (a decode step's, or a verified node's) a grammar mask was built for


def clean_error(exc: BaseException) -> str:
    """xgrammar's messages open with '[hh:mm:ss] /path/file.cc:123: '; keep the sentence."""
    text = str(exc).strip()
    text = re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", text)
    return text.splitlines()[0] if text else type(exc).__name__


_BOUNDED_STRING = '^[^\\x00-\\x1f"\\\\]{%d,%s}$'


def bounded_strings(schema):
    """A copy of a JSON schema where each string with minLength/maxLength (and no pattern, format, enum
    or const) becomes the equivalent pattern without control characters. xgrammar 0.2's own rule for
    length-bounded strings lets raw control characters through (invalid JSON: a random model wrote
    "\x01" inside one); its pattern rule does not. (Escape sequences are not generated in such
    strings, as in xgrammar's own rule.)"""
    if isinstance(schema, list):
        return [bounded_strings(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded_strings(v) for k, v in schema.items()}
    if (out.get("type") == "string" and ("minLength" in out or "maxLength" in out)
            and not any(k in out for k in ("pattern", "format", "enum", "const"))):
        lo, hi = out.get("minLength", 0), out.get("maxLength")
        if isinstance(lo, int) and (hi is None or isinstance(hi, int)):  # else xgrammar judges it as given
            out.pop("minLength", None)
            out.pop("maxLength", None)
            out["pattern"] = _BOUNDED_STRING % (lo, "" if hi is None else hi)
    return out


def _ebnf_literal(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def constraint_format(spec: StructuredOutputsParams) -> dict:
    """The constraint as a structural-tag format (xgrammar), the same language GrammarBackend.compile
    makes of it, to be placed inside a larger structural tag (after a reasoning block:
    reasoning.after_reasoning). ValueError naming the constraint when xgrammar refuses it."""
    import xgrammar as xgr

    kind = spec.kind
    try:
        if kind in ("json", "json_object"):
            schema, strict = ((spec.json if isinstance(spec.json, dict) else {}), True) if kind == "json" \
                else ({"type": "object"}, False)
            grammar = xgr.Grammar.from_json_schema(json.dumps(bounded_strings(schema)), strict_mode=strict,
                                                   any_whitespace=not spec.disable_any_whitespace)
            return {"type": "grammar", "grammar": str(grammar)}
        if kind == "regex":
            return {"type": "grammar", "grammar": str(xgr.Grammar.from_regex(spec.regex))}
        if kind == "choice":
            return {"type": "grammar", "grammar": "root ::= " + " | ".join(_ebnf_literal(x) for x in spec.choice)}
        if kind == "grammar":
            return {"type": "grammar", "grammar": str(xgr.Grammar.from_ebnf(spec.grammar))}
        tag = json.loads(spec.structural_tag)
        if not isinstance(tag, dict) or not isinstance(tag.get("format"), dict):
            raise ValueError('a structural tag is {"type": "structural_tag", "format": {...}}')
        return tag["format"]
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"structured_outputs.{kind} cannot be compiled: {clean_error(e)}") from None


class GrammarBackend:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int] | list[int],
                 cache_bytes: int = CACHE_BYTES) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer  # the engine's: forced text is encoded on the engine thread only
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(stop_token_ids))
        self.token_bytes: list[bytes] = list(self.info.decoded_vocab)  # each token's text, as bytes
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=True,
                                            cache_limit_bytes=cache_bytes)
        self.stats = ShapingStats()
        self._shifts = None  # 0..31 (int32), for apply_bitmask

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar of `spec`; ValueError naming the constraint when xgrammar refuses it."""
        kind = spec.kind
        c = self.compiler
        try:
            if kind == "json":
                schema = spec.json if isinstance(spec.json, dict) else {}  # true: any JSON value
                return c.compile_json_schema(json.dumps(bounded_strings(schema)),
                                             any_whitespace=not spec.disable_any_whitespace,
                                             strict_mode=True)
            if kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=not spec.disable_any_whitespace,
                                             strict_mode=False)
            if kind == "regex":
                return c.compile_regex(spec.regex)
            if kind == "choice":
                return c.compile_grammar("root ::= " + " | ".join(_ebnf_literal(x) for x in spec.choice))
            if kind == "grammar":
                return c.compile_grammar(spec.grammar)
            return c.compile_structural_tag(spec.structural_tag)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs.{kind} cannot be compiled: {clean_error(e)}") from None

    def matcher(self, spec: StructuredOutputsParams):
        """A fresh matcher for one request (rollback unbounded: a verification walk pushes at most a
        tree's depth, and pops it), of the grammar compiled before admission where there is one."""
        compiled = spec.compiled if spec.compiled is not None else self.compile(spec)
        return self._xgr.GrammarMatcher(compiled, max_rollback_tokens=-1)

    def dead_end(self, compiled, banned: set[int]) -> str | None:
        """Why a grammar cannot be followed when `banned` tokens (a request's one-token bad words) are
        never chosen, where that shows at its start: every token it allows first is banned, or every
        end-of-sequence token is (a grammar ends with one); None when neither. Deeper conflicts end
        the request with finish_reason "error" when it meets them (Engine.fail)."""
        stops = set(self.info.stop_token_ids)
        if stops and stops <= banned:
            return "bad_words ban every end-of-sequence token, and the structured output needs one to end"
        bits = self.new_bitmask(1)
        self._xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bits)
        held = bits.numpy()[0].view(np.uint32)
        allowed = np.flatnonzero(np.unpackbits(held.view(np.uint8), bitorder="little"))
        allowed = allowed[allowed < self.vocab_size]
        if 0 < len(allowed) <= len(banned) and all(int(t) in banned for t in allowed):
            return "bad_words ban every token the structured output allows first"
        return None

    def new_bitmask(self, rows: int = 1):
        return self._xgr.allocate_token_bitmask(rows, self.vocab_size)

    def apply_bitmask(self, logits, bitmask) -> None:
        """logits [R, V] (in place): -inf where bitmask [R, W] (int32, bit j of word i = token 32 i + j)
        has a 0, for the first min(V, 32 W) tokens, as xgrammar's apply_token_bitmask_inplace does. On
        the CPU in torch: four operators over the vocabulary took ~40 us at 49,152 tokens against
        ~190 us in xgrammar's CPU kernel (AMX Xeon), per decode row and verified node."""
        if logits.device.type != "cpu":
            self._xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True))
            return
        import torch

        if self._shifts is None:
            self._shifts = torch.arange(32, dtype=torch.int32)
        rows = logits.view(-1, logits.shape[-1])  # a lone [V] row as [1, V]
        words = bitmask.view(-1, bitmask.shape[-1])
        n = min(rows.shape[-1], words.shape[-1] * 32)
        allowed = ((words.unsqueeze(-1) >> self._shifts) & 1).view(words.shape[0], -1)[:, :n]  # [R, n]
        rows[:, :n].masked_fill_(allowed == 0, float("-inf"))

    @property
    def cache_bytes(self) -> int:
        return int(self.compiler.get_cache_size_bytes())
