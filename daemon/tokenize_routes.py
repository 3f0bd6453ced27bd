"""POST /tokenize and /detokenize, in vLLM's shapes, at the server root.

tokenize:   {model, prompt, add_special_tokens=true}
          | {model, messages, tools, add_generation_prompt=true, continue_final_message=false,
             add_special_tokens=false}                    -> {count, max_model_len, tokens[, token_strs]}
            (tools as on /v1/chat/completions: the ids are the ones a chat request with them is given)
detokenize: {model, tokens}                               -> {prompt}
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvpilot.common.errors import APIError, invalid
from kvpilot.common.protocol import parse_chat_tools, parse_messages

from .async_engine import AsyncEngine
from .request_body import read_json_body

MAX_DETOKENIZE_TOKENS = 1 << 20


@dataclass
class TokenizeRequest:
    model: str | None
    prompt: str | None
    messages: list[dict[str, Any]] | None
    tools: list[Any]
    add_special_tokens: bool
    add_generation_prompt: bool
    continue_final_message: bool
    return_token_strs: bool


def _opt(body: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, kind):
        raise invalid(name, f"'{name}' must be a {'boolean' if kind is bool else 'string'}", "invalid_type")
    return v


def parse_tokenize_request(body: dict[str, Any]) -> TokenizeRequest:
    model = _opt(body, "model", str, None)
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise invalid("prompt", "send exactly one of 'prompt' or 'messages'", "missing_required_parameter")
    prompt = messages = None
    tools: list[Any] = []
    if has_prompt:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise invalid("prompt", "'prompt' must be a string", "invalid_type")
    else:
        messages = parse_messages(body["messages"])
        tools = parse_chat_tools(body)
    add_gen = _opt(body, "add_generation_prompt", bool, True)
    cont = _opt(body, "continue_final_message", bool, False)
    if messages is not None and cont:
        if add_gen:
            raise invalid("continue_final_message",
                          "'continue_final_message' and 'add_generation_prompt' cannot both be true")
        if messages[-1]["role"] != "assistant":
            raise invalid("continue_final_message", "'continue_final_message' needs a final assistant message")
    # the chat template already holds the special tokens; a plain prompt gets them added
    special = _opt(body, "add_special_tokens", bool, messages is None)
    return TokenizeRequest(model, prompt, messages, tools, special, add_gen, cont,
                           _opt(body, "return_token_strs", bool, False))


def parse_detokenize_request(body: dict[str, Any]) -> tuple[str | None, list[int]]:
    model = _opt(body, "model", str, None)
    tokens = body.get("tokens")
    if tokens is None:
        raise invalid("tokens", "'tokens' is required", "missing_required_parameter")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise invalid("tokens", "'tokens' must be an array of integers", "invalid_type")
    if len(tokens) > MAX_DETOKENIZE_TOKENS:
        raise invalid("tokens", f"at most {MAX_DETOKENIZE_TOKENS} tokens per request")
    return model, tokens


class TokenizeRoutes:
    """The two handlers. `check_model` and `chat_prompt` are the generation routes' own, so the
    model names and the chat template behave exactly as on /v1/chat/completions."""

    def __init__(self, engine: AsyncEngine, check_model: Callable[[str | None], object],
                 chat_prompt: Callable[[list[dict[str, Any]], bool, bool, list[Any]], str]) -> None:
        self.engine = engine
        self.check_model = check_model
        self.chat_prompt = chat_prompt

    async def tokenize(self, request: web.Request) -> web.Response:
        req = parse_tokenize_request(await read_json_body(request))
        self.check_model(req.model)
        self.engine.check_accepting()  # 503 while the model loads
        tok = self.engine.tokenizer
        text = req.prompt
        if req.messages is not None:
            text = self.chat_prompt(req.messages, req.add_generation_prompt, req.continue_final_message, req.tools)
        ids = list(tok.encode(text, add_special_tokens=req.add_special_tokens)) if text else []
        out: dict[str, Any] = {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = list(tok.convert_ids_to_tokens(ids))
        return web.json_response(out)

    async def detokenize(self, request: web.Request) -> web.Response:
        model, tokens = parse_detokenize_request(await read_json_body(request))
        self.check_model(model)
        processor = self.engine.check_accepting()
        processor.check_token_ids(tokens, "tokens")  # InputError -> 400 naming the field
        try:
            text = self.engine.tokenizer.decode(tokens)
        except (ValueError, OverflowError, TypeError) as exc:
            raise APIError(f"the tokens could not be decoded: {exc}", param="tokens",
                           code="invalid_value") from None
        return web.json_response({"prompt": text})
