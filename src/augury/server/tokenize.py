"""/tokenize and /detokenize, in vLLM's shapes.

/tokenize takes {model, prompt, add_special_tokens (true), return_token_strs} or {model, messages,
add_generation_prompt, continue_final_message, add_special_tokens (false), chat_template_kwargs,
tools, return_token_strs} and answers {count, max_model_len, tokens, token_strs}; the messages form
gives exactly the prompt a chat completion with those messages (and tools) would get
(serving.chat_prompt). /detokenize takes {model, tokens} and answers {prompt}. Both run on the
tokenizer thread and never reach the engine.
"""
from __future__ import annotations

from typing import Any

from fastapi import Body, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from augury.server.errors import bad_request
from augury.server.fields import REFUSED_CHAT, refuse
from augury.server.protocol import (DetokenizeRequest, DetokenizeResponse, TokenizeChatRequest,
                                    TokenizeCompletionRequest, TokenizeResponse)
from augury.server.serving import ServerState, _need_tokenizer, chat_prompt, check_model
from augury.structured import tools as tool_calls


def _parse(model: type[BaseModel], body: Any) -> Any:
    """body as `model`, or the 400 FastAPI's own validation gives (errors.py words it)."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None


def add_token_routes(app, state: ServerState, dependencies: list, responses: dict) -> None:
    @app.post("/tokenize", dependencies=dependencies, response_model=TokenizeResponse, responses=responses)
    async def tokenize(request: Request, body: dict[str, Any] = Body(...)) -> TokenizeResponse:
        chat = "messages" in body
        req = _parse(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)
        check_model(state, req.model)
        state.fields.check(req, request.scope.get("state"))
        tok = _need_tokenizer(state)
        if chat:
            refuse(req, {"chat_template": REFUSED_CHAT["chat_template"]})
            tools = None
            if req.tools:
                try:
                    state.limits.check_tools(req.tools)
                    tools = tool_calls.check_tools(req.tools)
                except ValueError as e:
                    raise bad_request(str(e), "tools") from None
            ids = await chat_prompt(state, req, tools)
        else:
            special = req.add_special_tokens
            ids = await state.on_tokenizer_thread(lambda: tok.encode(req.prompt, add_special_tokens=special))
        strs = await state.on_tokenizer_thread(tok.convert_ids_to_tokens, ids) if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids, token_strs=strs)

    @app.post("/detokenize", dependencies=dependencies, response_model=DetokenizeResponse, responses=responses)
    async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
        check_model(state, body.model)
        state.fields.check(body, request.scope.get("state"))
        tok = _need_tokenizer(state)
        if any(not 0 <= t < state.vocab_size for t in body.tokens):
            raise bad_request(f"tokens must be token ids in [0, {state.vocab_size})", "tokens")
        return DetokenizeResponse(prompt=await state.on_tokenizer_thread(tok.decode, body.tokens))
