"""A Responses answer's output items, built from chat's parsed deltas (chat_text.ChatTextStream: reasoning,
content, tool calls) together with the streaming events that announce them.

One builder serves both forms: a non-streamed answer feeds its whole text once and keeps the items; a
streamed one feeds each delta and sends the events. The parser gives the same deltas (joined) for the
whole text as for any cutting of it, so the streamed items are the non-streamed ones. Items open and
close in the order the model wrote them: a `reasoning` item (its text as one reasoning_text part), a
`message` (one output_text part), a `function_call` per call; a new kind of delta closes the open item.
An answer with neither text nor calls still has a message (with empty text), as OpenAI's has.

Events carry no sequence_number: the writer numbers them as it sends them.
"""
from __future__ import annotations

import uuid
from typing import Any


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    """feed(delta) and finish(final status) -> Responses events; `items`: the output so far."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item deltas go to, if any
        self._calls: dict[int, dict[str, Any]] = {}  # the parser's call index -> its item
        self._messages = 0

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        index = next(i for i, x in enumerate(self.items) if x is item)
        return {"item_id": item["id"], "output_index": index}

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close("completed")
        self.items.append(item)
        self._open = item
        events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                       "item": _copy(item)})
        if item["type"] == "message":
            self._messages += 1
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        elif item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": ""}
        else:
            return events
        item["content"].append(dict(part))
        events.append({"type": "response.content_part.added", **self._where(item), "content_index": 0,
                       "part": part})
        return events

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        where = self._where(item)
        events: list[dict[str, Any]] = []
        if item["type"] == "function_call":
            events.append({"type": "response.function_call_arguments.done", **where, "name": item["name"],
                           "arguments": item["arguments"]})
        else:
            part = item["content"][0]
            done = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
            extra = {"logprobs": []} if item["type"] == "message" else {}
            events.append({"type": done, **where, "content_index": 0, "text": part["text"], **extra})
            events.append({"type": "response.content_part.done", **where, "content_index": 0, "part": dict(part)})
        events.append({"type": "response.output_item.done", "output_index": where["output_index"],
                       "item": _copy(item)})
        return events

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """One chat delta: {"reasoning_content"}, {"content"} or {"tool_calls": [one call's part]}."""
        events: list[dict[str, Any]] = []
        if delta.get("reasoning_content"):
            if self._open is None or self._open["type"] != "reasoning":
                events += self._add({"type": "reasoning", "id": _id("rs"), "summary": [], "content": [],
                                     "status": "in_progress"})
            events += self._text(self._open, delta["reasoning_content"], "response.reasoning_text.delta")
        if delta.get("content"):
            if self._open is None or self._open["type"] != "message":
                events += self._add({"type": "message", "id": _id("msg"), "role": "assistant",
                                     "status": "in_progress", "content": []})
            events += self._text(self._open, delta["content"], "response.output_text.delta")
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            if "id" in call:  # a new call: its id and name first, then its arguments
                item = {"type": "function_call", "id": _id("fc"), "call_id": call["id"], "name": fn.get("name", ""),
                        "arguments": "", "status": "in_progress"}
                events += self._add(item)
                self._calls[call["index"]] = item
            item = self._calls[call["index"]]
            if fn.get("arguments"):
                item["arguments"] += fn["arguments"]
                events.append({"type": "response.function_call_arguments.delta", **self._where(item),
                               "delta": fn["arguments"]})
        return events

    def _text(self, item: dict[str, Any], text: str, kind: str) -> list[dict[str, Any]]:
        item["content"][0]["text"] += text
        extra = {"logprobs": []} if item["type"] == "message" else {}
        return [{"type": kind, **self._where(item), "content_index": 0, "delta": text, **extra}]

    def finish(self, status: str) -> list[dict[str, Any]]:
        """The end of the answer: the open item closes with `status` (completed, or incomplete when
        max_output_tokens cut it); an answer without a message or a call gets an empty message."""
        events = []
        if not self._messages and not self._calls:
            events += self._add({"type": "message", "id": _id("msg"), "role": "assistant", "status": "in_progress",
                                 "content": []})
        return events + self._close(status)


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """An item as it stands now (events hold snapshots; the builder keeps changing its own)."""
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(p) for p in out["content"]]
    return out
