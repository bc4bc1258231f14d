"""User turns written by the target itself (the Magpie recipe): the chat template is rendered up to
where a user's message starts, and the model, sampling at temperature ~1, writes the message. What
comes out follows the model's own idea of what users ask, far more varied than any template we
write, and needs no data set from a hub.

Kept: complete turns (the model ended its turn itself) of 3-120 words, printable text in the
Latin script (at least 95% ASCII), with no chat-template markers, not seen before (compared on
their first 64 characters, lowercased, spaces collapsed).
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

log = logging.getLogger("augury.train")

SENTINEL = "MAGPIE-USER-TURN-7f3a"
MIN_WORDS, MAX_WORDS = 3, 120
MIN_ASCII = 0.95


def user_header(tokenizer) -> str:
    """The chat template's text up to where a user's message starts (its default system turn
    included, when the template adds one)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False,
                                         add_generation_prompt=False)
    at = text.find(SENTINEL)
    if at < 0:
        raise ValueError("the chat template does not place the user's text verbatim; cannot write user turns")
    return text[:at]


def _key(text: str) -> str:
    return re.sub(r"\s+", " ", text.lower()).strip()[:64]


def keep(text: str, finish_reason: str | None) -> bool:
    """A complete, plain, reasonably sized user turn."""
    if finish_reason != "stop":
        return False
    words = len(text.split())
    if not MIN_WORDS <= words <= MAX_WORDS or "<|" in text or "|>" in text:
        return False
    return sum(ch.isascii() and (ch.isprintable() or ch in "\n\t") for ch in text) >= MIN_ASCII * len(text)


def write_user_turns(llm, count: int, out: Path, temperature: float = 1.0, top_p: float = 0.95,
                     max_tokens: int = 96, batch: int = 64, seed: int = 0, max_rounds: int = 20) -> list[str]:
    """Sample user turns from `llm` (augury's LLM on the target) until `count` pass `keep` and are
    distinct, or `max_rounds` batches found too few; appends them to `out` (JSON lines
    {"text", "source"}) as they come, so an interrupted run keeps what it made and a rerun tops it
    up. Returns every turn in `out`."""
    from augury.sampling_params import SamplingParams

    tok = llm.tokenizer
    header = tok.encode(user_header(tok), add_special_tokens=False)
    texts = [json.loads(line)["text"] for line in out.read_text().splitlines() if line.strip()] if out.is_file() else []
    seen = {_key(t) for t in texts}
    source = f"magpie:{Path(str(llm.config.model)).name}"
    rounds = 0
    while len(texts) < count and rounds < max_rounds:
        n = min(batch, 2 * (count - len(texts)))
        base = seed * 1_000_003 + len(texts) * 7919 + rounds * 104_729
        params = [SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=base + i)
                  for i in range(n)]
        outs = llm.generate([list(header)] * n, params, use_tqdm=False)
        new = []
        for o in outs:
            text = o.text.strip()
            if keep(text, o.finish_reason) and _key(text) not in seen:
                seen.add(_key(text))
                new.append(text)
        new = new[: count - len(texts)]
        if new:
            out.parent.mkdir(parents=True, exist_ok=True)
            with out.open("a") as f:
                f.writelines(json.dumps({"text": t, "source": source}) + "\n" for t in new)
        texts += new
        rounds = 0 if new else rounds + 1
        log.info("user turns written by the target: %d/%d (this batch kept %d of %d)", len(texts), count, len(new), n)
    if len(texts) < count:
        log.warning("only %d distinct user turns after %d batches without a new one", len(texts), max_rounds)
    return texts
