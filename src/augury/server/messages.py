"""Chat messages -> the prompt: the messages as the chat template takes them (tool calls and tool
answers natively, or as text in the tool-call format for a template that renders no calls), rendered with vLLM's
template fields (add_generation_prompt, continue_final_message, chat_template_kwargs,
add_special_tokens). Runs on the server's tokenizer thread (render) or the event loop (the rest).
"""
from __future__ import annotations

import json
from typing import Any

from augury.server.errors import bad_request
from augury.server.fields import template_kwargs
from augury.structured import tools as tool_calls


def message_text(content: Any, where: str) -> str:
    if isinstance(content, list):
        if any(part.type != "text" or part.text is None for part in content):
            raise bad_request("only text content parts are supported", where, "unsupported_parameter")
        return "".join(part.text or "" for part in content)
    return content or ""


def message_dicts(req: Any, native_tools: bool, fmt: str = "hermes") -> list[dict[str, Any]]:
    """The messages as the chat template takes them. An assistant turn's tool_calls and a tool turn's
    answer go to a template that renders calls as they are (arguments as objects, as Hugging Face
    templates expect); for one that does not, they become text: the calls as the model writes them
    in the tool-call format `fmt` in the assistant's content, the answer inside <tool_response> tags."""
    out = []
    for i, m in enumerate(req.messages):  # roles are checked by the request model
        d: dict[str, Any] = {"role": m.role, "content": message_text(m.content, f"messages.{i}.content")}
        if m.role == "assistant" and m.tool_calls:
            calls = []
            for j, call in enumerate(m.tool_calls):
                fn = call.get("function") if isinstance(call, dict) else None
                try:
                    name, args = fn["name"], fn.get("arguments") or "{}"
                    parsed = json.loads(args) if isinstance(args, str) else args
                    if not isinstance(name, str) or not isinstance(parsed, dict):
                        raise TypeError
                except (TypeError, KeyError, ValueError):
                    raise bad_request("a tool call needs function.name and function.arguments (a JSON object)",
                                      f"messages.{i}.tool_calls.{j}") from None
                calls.append({"id": call.get("id"), "type": "function",
                              "function": {"name": name, "arguments": parsed}})
            if native_tools:
                d["tool_calls"] = calls
            else:
                text = "\n".join(tool_calls.call_text(c["function"]["name"], json.dumps(c["function"]["arguments"]),
                                                       fmt) for c in calls)
                d["content"] = f"{d['content']}\n{text}" if d["content"] else text
        if m.role == "tool":
            if native_tools:
                d["tool_call_id"] = m.tool_call_id
            else:
                d["content"] = f"<tool_response>\n{d['content']}\n</tool_response>"
        out.append(d)
    return out


def render_chat(tok: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                 req: Any = None) -> list[int]:
    """The prompt's ids; req (a ChatTemplateFields): add_generation_prompt, continue_final_message,
    chat_template_kwargs (checked: fields.template_kwargs) and add_special_tokens (default False:
    the template holds the special tokens)."""
    kw: dict[str, Any] = {"tools": tools} if tools else {}
    generation, cont, special = True, False, False
    if req is not None:
        generation, cont = req.add_generation_prompt, req.continue_final_message
        special = bool(req.add_special_tokens)
        kw.update(template_kwargs(tok, req.chat_template_kwargs))
        if cont:
            kw["continue_final_message"] = True
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation, **kw)
    return tok.encode(text, add_special_tokens=special)


def chat_template_check(req: Any) -> None:
    """vLLM's rule: the answer either opens a new assistant turn or continues the last message."""
    if req.add_generation_prompt and req.continue_final_message:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true "
                          "(set add_generation_prompt: false to continue the last message)", "continue_final_message")


def with_tools_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                      fmt: str = "hermes") -> list[dict[str, Any]]:
    """For a template that takes no tools: describe them in the system message (and how to call them
    in the tool-call format `fmt`)."""
    prompt = tool_calls.tools_prompt(tools, fmt)
    if messages and messages[0]["role"] in ("system", "developer"):
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]
