"""The Responses API's memory: finished responses kept for `previous_response_id` (and GET / DELETE
/v1/responses/{id}) for the server's lifetime, in a least-recently-used store bounded by count and
by bytes (--max-stored-responses, --max-stored-responses-mb), so a long-running server's memory
stays flat however many conversations pass through it. Nothing is written to disk.

Each entry is the response object as answered plus the conversation's input items up to it (its
own input after the previous response's conversation), so a follow-up rebuilds the whole
conversation from one entry. Touched on the event loop only; the lock makes it safe elsewhere too.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_RESPONSES = 1024
DEFAULT_MAX_MB = 64.0


@dataclass(frozen=True)
class Stored:
    response: dict[str, Any]  # the response object as the client got it
    inputs: list[dict[str, Any]]  # every input item of the conversation up to it (earlier outputs included)
    size: int  # bytes, as JSON: what the bound counts

    def conversation(self) -> list[dict[str, Any]]:
        """The items a follow-up continues: the inputs, then this response's output."""
        return [*self.inputs, *self.response.get("output", [])]


class ResponseStore:
    """An LRU of Stored responses: at most max_items entries and max_bytes bytes (JSON size); 0
    items stores nothing. A response larger than max_bytes alone is not stored (put says so)."""

    def __init__(self, max_items: int = DEFAULT_MAX_RESPONSES, max_bytes: int = int(DEFAULT_MAX_MB * 2**20)) -> None:
        if isinstance(max_items, bool) or not isinstance(max_items, int) or max_items < 0:
            raise ValueError(f"max_stored_responses must be a non-negative integer, got {max_items!r}")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_stored_responses_mb must be a non-negative size, got {max_bytes!r}")
        self.max_items, self.max_bytes = max_items, max_bytes
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.max_items > 0 and self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    def put(self, response: dict[str, Any], inputs: list[dict[str, Any]]) -> bool:
        """Keep it (most recent), evicting the least recently used past the bounds; False when it
        cannot be kept (the store is off, or it alone is over the byte bound)."""
        size = len(json.dumps(response, separators=(",", ":"))) + len(json.dumps(inputs, separators=(",", ":")))
        if not self.enabled or size > self.max_bytes:
            return False
        entry = Stored(response, inputs, size)
        with self._lock:
            old = self._entries.pop(response["id"], None)
            if old is not None:
                self._bytes -= old.size
            self._entries[response["id"]] = entry
            self._bytes += size
            while len(self._entries) > self.max_items or self._bytes > self.max_bytes:
                _, gone = self._entries.popitem(last=False)
                self._bytes -= gone.size
        return True

    def get(self, response_id: str) -> Stored | None:
        """The entry (now the most recently used), or None when it was never kept or was evicted."""
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str) -> bool:
        with self._lock:
            entry = self._entries.pop(response_id, None)
            if entry is not None:
                self._bytes -= entry.size
            return entry is not None
