"""Reasoning parsers (vLLM's --reasoning-parser names): a chat answer's <think>...</think> block
split off into `reasoning_content`, whole (`split_reasoning`) or as it streams (`ReasoningStream`), and
a request's output constraint moved after it (`after_reasoning`).

Where the answer starts (`start_state`) depends on the parser and on the prompt the template wrote:
- "inside": the answer opens inside the reasoning (DeepSeek-R1's template ends the prompt with
  <think>, so R1 writes no opening tag; Qwen3-Thinking-2507 and Qwen3.5 templates do the same); an
  opening tag the model writes anyway is dropped. Everything up to </think> is reasoning, all of it
  when </think> never comes (an answer cut by max_tokens).
- "maybe" (qwen3 when the prompt opens nothing): the model opens <think> itself, at the start of
  its answer, or writes no reasoning at all (an answer without the tag is all content).
- "done": the prompt closed the reasoning already (Qwen3's template with enable_thinking false
  ends the prompt with an empty <think>\\n\\n</think>): everything is content.

Reasoning is stripped of surrounding whitespace (None when empty); the text after it is the answer,
which the server then reads for tool calls, or strips as content. Both paths read the answer by the
rules above and the stream holds back only what may still become a tag, so for every answer and
every way of cutting it the stream's pieces join into the whole split. Torch-free.
"""
from __future__ import annotations

from typing import Any

from augury.structured.tool_parsers import Trimmed, partial_suffix

PARSERS = ("qwen3", "deepseek_r1")
OPEN, CLOSE = "<think>", "</think>"
STATES = ("inside", "maybe", "done")


def check_parser(name: str) -> str:
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; one of {', '.join(PARSERS)}")
    return name


def start_state(parser: str, prompt: str) -> str:
    """How the answer to `prompt` (the rendered chat prompt's text) starts, for `parser`."""
    tail = prompt.rstrip()
    if tail.endswith(CLOSE):
        return "done"
    if tail.endswith(OPEN):
        return "inside"
    return "inside" if check_parser(parser) == "deepseek_r1" else "maybe"


def split_reasoning(text: str, start: str) -> tuple[str | None, str]:
    """A whole answer -> (reasoning, the answer after it)."""
    if start == "done":
        return None, text
    s = text.lstrip()
    if s.startswith(OPEN):
        body = s[len(OPEN):]
    elif start == "inside":
        body = text
    else:
        return None, text
    j = body.find(CLOSE)
    if j < 0:
        return body.strip() or None, ""
    return body[:j].strip() or None, body[j + len(CLOSE):]


class ReasoningStream:
    """feed(text) and finish() -> (reasoning piece, answer text): the reasoning released as it comes
    (stripped as Trimmed does), holding back only what may still become <think> at the start or
    </think>; the answer's text after </think> passed on as it arrives."""

    def __init__(self, start: str) -> None:
        if start not in STATES:
            raise ValueError(f"start must be one of {', '.join(STATES)}, got {start!r}")
        self.start = start
        self._phase = "answer" if start == "done" else "start"  # then "reasoning", then "answer"
        self._buf = ""
        self._reasoning = Trimmed()

    def feed(self, text: str) -> tuple[str, str]:
        if self._phase == "answer":
            return "", text
        self._buf += text
        if self._phase == "start":
            s = self._buf.lstrip()
            if s.startswith(OPEN):
                self._buf, self._phase = s[len(OPEN):], "reasoning"
            elif not s or OPEN.startswith(s):  # may still become the opening tag
                return "", ""
            elif self.start == "inside":
                self._phase = "reasoning"
            else:
                answer, self._buf, self._phase = self._buf, "", "answer"
                return "", answer
        j = self._buf.find(CLOSE)
        if j >= 0:
            piece = self._reasoning(self._buf[:j])
            answer, self._buf, self._phase = self._buf[j + len(CLOSE):], "", "answer"
            return piece, answer
        cut = len(self._buf) - partial_suffix(self._buf, CLOSE)
        piece, self._buf = self._reasoning(self._buf[:cut]), self._buf[cut:]
        return piece, ""

    def finish(self) -> tuple[str, str]:
        """The answer ended: what was held is reasoning (inside one) or answer."""
        held, self._buf = self._buf, ""
        phase, self._phase = self._phase, "answer"
        if phase == "reasoning" or (phase == "start" and self.start == "inside"):
            return self._reasoning(held), ""
        return "", held


def after_reasoning(fmt: dict[str, Any], start: str) -> dict[str, Any]:
    """A structural-tag format (xgrammar): the reasoning as the model likes, then `fmt` (the request's
    constraint), so structured output shapes the answer and never the reasoning. Between </think>
    and the answer: a few blank characters at most (Qwen writes two newlines)."""
    if start == "done":
        return fmt
    think: dict[str, Any] = {"type": "tag", "begin": "" if start == "inside" else OPEN,
                             "content": {"type": "any_text"}, "end": CLOSE}
    if start == "maybe":
        think = {"type": "optional", "content": think}
    gap = {"type": "regex", "pattern": "[ \\n]{0,4}"}
    return {"type": "sequence", "elements": [think, gap, fmt]}
