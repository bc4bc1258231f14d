"""What the server does with each request field it does not simply map onto SamplingParams.

- Fields augury does not implement but clients send (OpenAI's and vLLM's): accepted at their
  neutral value, a 400 naming them otherwise (REFUSED_*, `refuse`).
- Fields nobody declared (`unknown_fields`): by default each is logged once per name with a warning
  and listed in the response's X-Augury-Ignored-Fields header (FieldPolicy); with --strict-fields a
  400 names the first. An unknown field whose value is null asks for nothing and passes silently.
- vLLM's prompt extras shared by the routes: truncate_prompt_tokens, chat_template_kwargs.

docs/api.md holds the table of every field and what augury does with it.
"""
from __future__ import annotations

import inspect
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from augury.server.errors import bad_request

log = logging.getLogger("augury.server")
IGNORED_HEADER = "X-Augury-Ignored-Fields"
MAX_REMEMBERED = 256  # unknown names warned about once each; past this many, one last warning and no more
_HEADER_NAMES = 16  # names listed in the header at most (the rest: "...")

# field -> the values that ask for nothing (accepted); anything else is a 400 naming the field
REFUSED_SHARED: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0),
    "allowed_token_ids": (None,),
    "prompt_logprobs": (None,),
    "priority": (None, 0),
    "return_tokens_as_token_ids": (None, False),
    "return_token_ids": (None, False),
    "mm_processor_kwargs": (None, {}),
    "store": (None, False),  # OpenAI: keep the answer for later retrieval; augury keeps nothing
}
REFUSED_COMPLETION: dict[str, tuple[Any, ...]] = {**REFUSED_SHARED, "best_of": (None, 1), "suffix": (None, "")}
REFUSED_CHAT: dict[str, tuple[Any, ...]] = {
    **REFUSED_SHARED,
    "echo": (None, False),  # vLLM's chat echo
    "chat_template": (None,),  # a template per request (vLLM refuses it too unless trusted)
    "documents": (None, []),
    "functions": (None, []),  # OpenAI's deprecated forms of tools and tool_choice
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
}


def refuse(req: BaseModel, table: dict[str, tuple[Any, ...]]) -> None:
    """A 400 naming the first field of `table` whose value is not one of its neutral values."""
    for name, neutral in table.items():
        value = getattr(req, name, None)
        # == would let True pass for 1 (bool is an int): compare types too
        if not any(value == ok and type(value) in (type(ok), int if isinstance(ok, float) else type(ok))
                   for ok in neutral):
            raise bad_request(f"{name} is not supported by this server", name, "unsupported_parameter")


def unknown_fields(model: BaseModel, prefix: str = "") -> list[tuple[str, str]]:
    """(name, where) of every field the request models do not declare, nested ones included: name
    without list indices (what the header and the warning say, e.g. messages.refusal), where with
    them (the 400's param, messages.0.refusal). Null values are left out: they ask for nothing."""
    out = [(prefix + k, prefix + k) for k, v in (model.model_extra or {}).items() if v is not None]
    for name in type(model).model_fields:
        value = getattr(model, name, None)
        if isinstance(value, BaseModel):
            out += unknown_fields(value, f"{prefix}{name}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    out += [(n, w.replace(f"{prefix}{name}.", f"{prefix}{name}.{i}.", 1))
                            for n, w in unknown_fields(item, f"{prefix}{name}.")]
    return out


@dataclass
class FieldPolicy:
    """What happens to unknown fields: strict, a 400; else a warning the first time a name is seen and
    the names in the response header (through the ASGI scope's state, which RequestContext reads)."""

    strict: bool = False
    _seen: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def check(self, req: BaseModel, scope_state: dict[str, Any] | None) -> list[str]:
        found = unknown_fields(req)
        if not found:
            return []
        if self.strict:
            where = found[0][1]
            raise bad_request(f"unknown field {where!r}: this server refuses fields it does not implement "
                              "(--strict-fields)", where, "unknown_parameter")
        names = list(dict.fromkeys(n for n, _ in found))
        fresh = []
        with self._lock:
            for n in names:
                if n in self._seen or len(self._seen) > MAX_REMEMBERED:
                    continue
                self._seen.add(n)
                fresh.append(n)
            last = len(self._seen) == MAX_REMEMBERED + 1 and fresh
            if last:
                self._seen.add("")  # never again
        for n in fresh:
            log.warning("request field %r is not known to augury and was ignored (warned once per name; "
                        "--strict-fields refuses such requests)", n[:100])
        if last:
            log.warning("%d distinct unknown request fields seen: no more are warned about", MAX_REMEMBERED)
        if scope_state is not None:
            scope_state["ignored_fields"] = names
        return names


def header_value(names: list[str]) -> str:
    """The header's value: the names, comma-separated, each in printable ASCII (others escaped)."""
    safe = [n[:64].encode("ascii", "backslashreplace").decode().replace(",", "\\x2c") for n in names[:_HEADER_NAMES]]
    safe = ["".join(c if 32 <= ord(c) < 127 else "?" for c in n) for n in safe]
    return ", ".join(safe + (["..."] if len(names) > _HEADER_NAMES else []))


def truncate(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the prompt's last `keep` tokens (-1: max_model_len of them)."""
    if keep is None:
        return ids
    if keep == -1:
        keep = max_model_len
    if isinstance(keep, bool) or not 1 <= keep <= max_model_len:
        raise bad_request(f"truncate_prompt_tokens must be -1 (this model's context) or in [1, {max_model_len}], "
                          f"got {keep}", "truncate_prompt_tokens")
    return ids[-keep:]


def template_kwargs(tok: Any, given: dict[str, Any] | None) -> dict[str, Any]:
    """chat_template_kwargs, checked: extra variables for the chat template (e.g. enable_thinking), none of
    them one of apply_chat_template's own parameters (those have fields of their own, or are augury's)."""
    if not given:
        return {}
    own = set(inspect.signature(type(tok).apply_chat_template).parameters) - {"kwargs", "self"}
    clash = sorted(k for k in given if k in own)
    if clash:
        raise bad_request(f"chat_template_kwargs must not set {', '.join(clash)} (parameters of the template "
                          "call itself; use the request's own fields)", "chat_template_kwargs")
    return dict(given)
