"""A chat choice's text as OpenAI's assistant message, whole (`chat_message`, app.py) or streamed
(`ChatTextStream`, streams.py), by the same rules:

1. with --reasoning-parser, the reasoning block is split off first (structured/reasoning.py) into
   `reasoning_content` (null when there is none);
2. with tools (tool_choice not "none"), the answer after it is read for calls in the request's
   tool-call format (structured/tool_parsers.py): `tool_calls`, and the rest as content;
3. else the answer is the content, stripped when a reasoning parser split it, as the model wrote it
   otherwise.

Both parsers give the same result for the whole text and for any cutting of it, so a streamed
choice's deltas join into the non-streamed message.
"""
from __future__ import annotations

from typing import Any

from augury.structured.reasoning import ReasoningStream, split_reasoning
from augury.structured.tool_parsers import ToolCallStream, Trimmed, parse_tool_calls


def chat_message(job: Any, text: str) -> tuple[dict[str, Any], bool]:
    """(the message of a whole choice, whether it called a tool). job: serving.Job."""
    reasoning = None
    if job.reasoning is not None:
        reasoning, text = split_reasoning(text, job.reasoning)
    calls = []
    if job.parse_tools:
        content, calls = parse_tool_calls(text, job.tool_names, job.tool_format)
    elif job.reasoning is not None:
        content = text.strip() or None
    else:
        content = text
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if job.reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [c.openai() for c in calls]
    return message, bool(calls)


class ChatTextStream:
    """One streamed choice: feed(new text) and finish() -> OpenAI chat deltas ({"reasoning_content"},
    {"content"}, {"tool_calls"}); `called`: whether a call went out (the choice then finishes with
    "tool_calls" where it stopped)."""

    def __init__(self, job: Any) -> None:
        self._reasoning = ReasoningStream(job.reasoning) if job.reasoning is not None else None
        self._tools = ToolCallStream(job.tool_names, job.tool_format) if job.parse_tools else None
        self._content = Trimmed() if self._reasoning is not None and self._tools is None else None

    @property
    def called(self) -> bool:
        return self._tools is not None and bool(self._tools.calls)

    def feed(self, text: str) -> list[dict[str, Any]]:
        reasoning, answer = self._reasoning.feed(text) if self._reasoning is not None else ("", text)
        return self._deltas(reasoning, answer, False)

    def finish(self) -> list[dict[str, Any]]:
        reasoning, answer = self._reasoning.finish() if self._reasoning is not None else ("", "")
        return self._deltas(reasoning, answer, True)

    def _deltas(self, reasoning: str, answer: str, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [{"reasoning_content": reasoning}] if reasoning else []
        if self._tools is not None:
            out += self._tools.feed(answer) + (self._tools.finish() if final else [])
        elif self._content is not None:
            piece = self._content(answer)  # trailing whitespace held back, dropped at the end
            out += [{"content": piece}] if piece else []
        elif answer:
            out.append({"content": answer})
        return out
