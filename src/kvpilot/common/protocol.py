"""OpenAI request validation: a JSON body -> a checked request, shared by the daemon and the router.

Every problem with a request becomes an `APIError` (errors.py) naming the field in `param`. What the
engine adds on top (SamplingParams, a response_format's grammar, a forced tool call's grammar) is the
daemon's (daemon/protocol.py); here sampling comes out as SamplingParams' keyword arguments, checked,
so that the router, which only renders prompts, refuses exactly the bodies the daemon refuses without
loading the engine.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import APIError, invalid
from .tools import (
    Tool,
    ToolChoice,
    parse_message_tool_fields,
    parse_tool_choice,
    parse_tools,
    single_call_stop,
)

MAX_N = 128
MAX_LOGPROBS = 20
MAX_BATCH_PROMPTS = 256
MAX_STOP_STRINGS = 64
MAX_LOGIT_BIAS = 1024
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_json_body(raw: bytes | str) -> dict[str, Any]:
    """The request body as a JSON object; NaN/Infinity and non-objects are rejected."""

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    if not raw or not raw.strip():
        raise APIError("request body is empty; expected a JSON object", code="invalid_json")
    try:
        body = json.loads(raw, parse_constant=no_constants)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise APIError(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(f"request body must be a JSON object, got {_type_name(body)}", code="invalid_json")
    return body


# JSON's names for Python's types; bool before int, since a bool is an int in Python.
_JSON_TYPE_NAMES: tuple[tuple[type, str], ...] = (
    (type(None), "null"), (bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
    (list, "array"), (dict, "object"),
)


def _type_name(v: Any) -> str:
    for t, name in _JSON_TYPE_NAMES:
        if isinstance(v, t):
            return name
    return type(v).__name__


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


class _Fields:
    """Typed, range-checked access to the body's fields; errors name the field in `param`."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    def _get(self, name: str, ok: Callable[[Any], bool], want: str, default: Any) -> Any:
        v = self.body.get(name)
        if v is None:
            return default
        if not ok(v):
            raise invalid(name, f"'{name}' must be {want}, got {_type_name(v)}", "invalid_type")
        return v

    def boolean(self, name: str, default: bool | None = False) -> bool | None:
        return self._get(name, lambda v: isinstance(v, bool), "a boolean", default)

    def string(self, name: str, default: str | None = None) -> str | None:
        return self._get(name, lambda v: isinstance(v, str), "a string", default)

    def obj(self, name: str) -> dict[str, Any] | None:
        return self._get(name, lambda v: isinstance(v, dict), "an object", None)

    def integer(self, name: str, default: int | None = None, lo: int | None = None,
                hi: int | None = None) -> int | None:
        v = self._get(name, _is_int, "an integer", default)
        if self.body.get(name) is not None:
            _check_range(name, v, lo, hi, kind="integer")
        return v

    def number(self, name: str, default: float | None = None, lo: float | None = None, hi: float | None = None,
               lo_open: bool = False) -> float | None:
        v = self._get(name, _is_num, "a number", default)
        if self.body.get(name) is not None:
            _check_range(name, v, lo, hi, lo_open, kind="decimal")
            v = float(v)
        return v


def _check_range(name: str, v: float, lo: float | None, hi: float | None, lo_open: bool = False,
                 kind: str = "integer") -> None:
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise invalid(name, f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {v}", f"{kind}_below_min_value")
    if hi is not None and v > hi:
        raise invalid(name, f"'{name}' must be <= {hi}, got {v}", f"{kind}_above_max_value")


@dataclass
class StreamOptions:
    include_usage: bool = False
    continuous_usage_stats: bool = False


@dataclass
class CompletionBody:
    """A checked /v1/completions body; `sampling`: SamplingParams' keyword arguments (no constraint)."""

    model: str | None
    prompts: list[str | list[int]]
    sampling: dict[str, Any]
    stream: bool = False
    stream_options: StreamOptions = field(default_factory=StreamOptions)
    echo: bool = False
    logprobs: int | None = None
    priority: int = 0
    max_tokens_set: bool = True
    cache_salt: str | None = None


@dataclass
class ChatBody:
    """A checked /v1/chat/completions body; `sampling`: SamplingParams' keyword arguments (no constraint)."""

    model: str | None
    messages: list[dict[str, Any]]
    sampling: dict[str, Any]
    stream: bool = False
    stream_options: StreamOptions = field(default_factory=StreamOptions)
    logprobs: bool = False
    top_logprobs: int = 0
    priority: int = 0
    cache_salt: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    max_tokens_set: bool = False
    tools: list[Tool] = field(default_factory=list)
    tool_choice: ToolChoice | None = None  # None: no tools in play ("none")
    parallel_tool_calls: bool = True

    @property
    def tool_mode(self) -> str:
        return self.tool_choice.mode if self.tool_choice is not None else "none"


def _stop(f: _Fields) -> list[str]:
    v = f.body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise invalid("stop", "'stop' must be a string or an array of strings", "invalid_type")
    if len(v) > MAX_STOP_STRINGS:
        raise invalid("stop", f"'stop' may hold at most {MAX_STOP_STRINGS} strings, got {len(v)}")
    if any(not s for s in v):
        raise invalid("stop", "'stop' strings must not be empty")
    return list(v)


def _token_id_list(name: str, v: Any) -> list[int]:
    if not isinstance(v, list) or not all(_is_int(t) for t in v):
        raise invalid(name, f"'{name}' must be an array of integers", "invalid_type")
    if any(t < 0 for t in v):
        raise invalid(name, f"'{name}' must hold non-negative token ids")
    return list(v)


def _stream_options(f: _Fields, stream: bool) -> StreamOptions:
    so = f.obj("stream_options")
    if so is None:
        return StreamOptions()
    if not stream:
        raise invalid("stream_options", "'stream_options' is only allowed when 'stream' is true")
    inner = _Fields(so)
    try:
        return StreamOptions(include_usage=bool(inner.boolean("include_usage")),
                             continuous_usage_stats=bool(inner.boolean("continuous_usage_stats")))
    except APIError as exc:
        exc.param = f"stream_options.{exc.param}"
        raise


def _reject_unsupported(f: _Fields, names: tuple[str, ...]) -> None:
    for name in names:
        v = f.body.get(name)
        if v not in (None, {}, [], "", False):
            raise invalid(name, f"'{name}' is not supported by this server", "unsupported_parameter")


def _logit_bias(f: _Fields) -> dict[int, float] | None:
    """OpenAI's {"token id": bias} map, as {int: float}; ids in the vocabulary are checked later."""
    lb = f.obj("logit_bias")
    if not lb:
        return None
    if len(lb) > MAX_LOGIT_BIAS:
        raise invalid("logit_bias", f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} entries, got {len(lb)}")
    out: dict[int, float] = {}
    for key, bias in lb.items():
        k = key.strip()
        if not k.isascii() or not k.isdigit() or len(k) > 12:
            raise invalid("logit_bias", f"'logit_bias' keys must be token ids (non-negative integers), got {key!r}")
        if not _is_num(bias):
            raise invalid("logit_bias", f"'logit_bias' values must be numbers, got {_type_name(bias)} for {key!r}",
                          "invalid_type")
        if not -100 <= bias <= 100:
            raise invalid("logit_bias", f"'logit_bias' values must be in [-100, 100], got {bias} for {key!r}")
        out[int(k)] = float(bias)
    return out


def _common_sampling(f: _Fields, *, n: int, max_tokens: int | None, logprobs: int | None,
                     best_of: int | None = None, prompt_logprobs: int | None = None,
                     extra_stop: str | None = None) -> dict[str, Any]:
    """Fields shared by both routes, vLLM's extra parameters included, as SamplingParams' keyword
    arguments. extra_stop: a stop string the server adds (not counted against MAX_STOP_STRINGS)."""
    temperature = f.number("temperature", 1.0, 0.0, 2.0)
    top_p = f.number("top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = f.integer("top_k", 0, -1)
    min_p = f.number("min_p", 0.0, 0.0, 1.0)
    seed = f.integer("seed", None, _SEED_MIN, _SEED_MAX)
    presence = f.number("presence_penalty", 0.0, -2.0, 2.0)
    frequency = f.number("frequency_penalty", 0.0, -2.0, 2.0)
    repetition = f.number("repetition_penalty", 1.0, 0.0, 20.0, lo_open=True)
    ignore_eos = f.boolean("ignore_eos", False)
    min_tokens = f.integer("min_tokens", 0, 0)
    stop = _stop(f)
    if extra_stop is not None and extra_stop not in stop:
        stop.append(extra_stop)
    stop_token_ids = _token_id_list("stop_token_ids", f.body["stop_token_ids"]) \
        if f.body.get("stop_token_ids") is not None else []
    include_stop = f.boolean("include_stop_str_in_output", False)
    skip_special = f.boolean("skip_special_tokens", True)
    if max_tokens is not None and min_tokens > max_tokens:
        raise invalid("min_tokens", f"'min_tokens' ({min_tokens}) must be <= max_tokens ({max_tokens})")
    if best_of is not None and best_of < n:
        raise invalid("best_of", f"'best_of' ({best_of}) must be >= n ({n})")
    logit_bias = _logit_bias(f)
    prompt_logprobs = f.integer("prompt_logprobs", prompt_logprobs, 0, MAX_LOGPROBS)
    return dict(
        n=n, best_of=best_of, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
        presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition,
        stop=stop or None, stop_token_ids=stop_token_ids, include_stop_str_in_output=include_stop,
        ignore_eos=ignore_eos, max_tokens=max_tokens, min_tokens=min_tokens, logprobs=logprobs,
        skip_special_tokens=skip_special, logit_bias=logit_bias, prompt_logprobs=prompt_logprobs,
    )


def _model(f: _Fields) -> str | None:
    return f.string("model")


def _priority(f: _Fields) -> int:
    return f.integer("priority", 0, -(2**31), 2**31 - 1)


def _cache_salt(f: _Fields) -> str | None:
    """vLLM's per-request salt: prompts with different salts never share prefix-cache blocks (tenants)."""
    salt = f.string("cache_salt")
    if salt is not None and not salt:
        raise invalid("cache_salt", "'cache_salt' must be a non-empty string", "invalid_value")
    if salt is not None and len(salt) > 256:
        raise invalid("cache_salt", "'cache_salt' is longer than 256 characters", "invalid_value")
    return salt


def parse_completion_body(body: dict[str, Any]) -> CompletionBody:
    f = _Fields(body)
    model = _model(f)
    prompts = _prompts(body.get("prompt"))
    stream = f.boolean("stream", False)
    stream_options = _stream_options(f, stream)
    echo = f.boolean("echo", False)
    n = f.integer("n", 1, 1, MAX_N)
    best_of = f.integer("best_of", None, 1, MAX_N)
    if stream and best_of is not None and best_of > n:
        raise invalid("best_of", "'best_of' > n is not supported with streaming")
    max_tokens_set = body.get("max_tokens") is not None
    max_tokens = f.integer("max_tokens", 16, 1)
    logprobs = f.integer("logprobs", None, 0, MAX_LOGPROBS)
    _reject_unsupported(f, ("suffix",))
    # echo with logprobs scores the prompt too (vLLM: prompt_logprobs = logprobs)
    sampling = _common_sampling(f, n=n, max_tokens=max_tokens, logprobs=logprobs, best_of=best_of,
                                prompt_logprobs=logprobs if echo and logprobs is not None else None)
    return CompletionBody(model=model, prompts=prompts, sampling=sampling, stream=stream,
                          stream_options=stream_options, echo=echo, logprobs=logprobs,
                          priority=_priority(f), max_tokens_set=max_tokens_set, cache_salt=_cache_salt(f))


def _prompts(v: Any) -> list[str | list[int]]:
    """OpenAI's four prompt shapes: string, array of strings, token array, array of token arrays."""
    if v is None:
        raise invalid("prompt", "'prompt' is required", "missing_required_parameter")
    if isinstance(v, str):
        prompts: list[Any] = [v]
    elif isinstance(v, list):
        if not v:
            raise invalid("prompt", "'prompt' must not be an empty array")
        if all(isinstance(p, str) for p in v):
            prompts = list(v)
        elif all(_is_int(p) for p in v):
            prompts = [_token_id_list("prompt", v)]
        elif all(isinstance(p, list) for p in v):
            prompts = [_token_id_list("prompt", p) for p in v]
        else:
            raise invalid("prompt", "'prompt' must be a string, an array of strings, an array of token ids "
                                    "or an array of token id arrays", "invalid_type")
    else:
        raise invalid("prompt", f"'prompt' must be a string or an array, got {_type_name(v)}", "invalid_type")
    if len(prompts) > MAX_BATCH_PROMPTS:
        raise invalid("prompt", f"at most {MAX_BATCH_PROMPTS} prompts per request, got {len(prompts)}")
    if any(len(p) == 0 for p in prompts):
        raise invalid("prompt", "'prompt' must not be empty")
    return prompts


def _message_content(i: int, msg: dict[str, Any]) -> str | None:
    content = msg.get("content")
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise invalid(f"messages[{i}].content[{j}]", "content parts must be objects with a 'type'",
                              "invalid_type")
            if part["type"] != "text":
                raise invalid(f"messages[{i}].content[{j}].type",
                              f"content part type {part['type']!r} is not supported (text only)",
                              "unsupported_parameter")
            if not isinstance(part.get("text"), str):
                raise invalid(f"messages[{i}].content[{j}].text", "'text' must be a string", "invalid_type")
            texts.append(part["text"])
        return "\n".join(texts)
    raise invalid(f"messages[{i}].content", "'content' must be a string or an array of content parts",
                  "invalid_type")


def parse_messages(v: Any) -> list[dict[str, Any]]:
    """Chat messages, checked and normalized (text content only)."""
    if v is None:
        raise invalid("messages", "'messages' is required", "missing_required_parameter")
    if not isinstance(v, list):
        raise invalid("messages", f"'messages' must be an array, got {_type_name(v)}", "invalid_type")
    if not v:
        raise invalid("messages", "'messages' must not be empty")
    out = []
    for i, msg in enumerate(v):
        if not isinstance(msg, dict):
            raise invalid(f"messages[{i}]", "each message must be an object", "invalid_type")
        role = msg.get("role")
        if role not in CHAT_ROLES:
            raise invalid(f"messages[{i}].role", f"'role' must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        content = _message_content(i, msg)
        if content is None and role != "assistant":
            raise invalid(f"messages[{i}].content", f"a {role} message needs 'content'",
                          "missing_required_parameter")
        clean: dict[str, Any] = {"role": role, "content": content or ""}
        if isinstance(msg.get("name"), str):
            clean["name"] = msg["name"]
        if role == "tool" or msg.get("tool_calls") is not None:
            clean.update(parse_message_tool_fields(i, msg))
        out.append(clean)
    return out


def parse_chat_tools(body: dict[str, Any]) -> list[Tool]:
    """A chat body's `tools`, checked (an APIError naming the field); [] without any. /tokenize takes them
    too, so that its ids are the ones the chat route renders."""
    return parse_tools(body.get("tools"))


def _tools(f: _Fields, auto_tool_choice: bool) -> tuple[list[Tool], ToolChoice | None, bool]:
    """tools, tool_choice (checked against the tools) and parallel_tool_calls."""
    parallel = f.boolean("parallel_tool_calls", True)
    if f.body.get("tools") is None and f.body.get("tool_choice") in (None, "none"):
        return [], None, parallel
    tools = parse_chat_tools(f.body)
    return tools, parse_tool_choice(f.body.get("tool_choice"), tools, auto_enabled=auto_tool_choice), parallel


def parse_chat_body(body: dict[str, Any], *, auto_tool_choice: bool = False) -> ChatBody:
    """auto_tool_choice: the server parses tool calls out of free text (--enable-auto-tool-choice).
    response_format and forced tool calls are left to the daemon (daemon/protocol.py): parsing a grammar
    loads xgrammar and torch (2.4 s on the first one), which the router, rendering prompts only, never needs."""
    f = _Fields(body)
    model = _model(f)
    messages = parse_messages(body.get("messages"))
    stream = f.boolean("stream", False)
    stream_options = _stream_options(f, stream)
    n = f.integer("n", 1, 1, MAX_N)
    max_completion = f.integer("max_completion_tokens", None, 1)
    max_tokens = f.integer("max_tokens", None, 1)
    max_tokens = max_completion if max_completion is not None else max_tokens
    logprobs = f.boolean("logprobs", False)
    top_logprobs = f.integer("top_logprobs", None, 0, MAX_LOGPROBS)
    if top_logprobs is not None and top_logprobs > 0 and not logprobs:
        raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs' set to true")
    tools, tool_choice, parallel = _tools(f, auto_tool_choice)
    _reject_unsupported(f, ("functions", "function_call"))  # the deprecated forms: use tools/tool_choice
    add_gen = f.boolean("add_generation_prompt", True)
    cont = f.boolean("continue_final_message", False)
    if add_gen and cont:
        raise invalid("continue_final_message",
                      "'continue_final_message' and 'add_generation_prompt' cannot both be true")
    if cont and messages[-1]["role"] != "assistant":
        raise invalid("continue_final_message", "'continue_final_message' needs a final assistant message")
    sampling = _common_sampling(f, n=n, max_tokens=max_tokens, logprobs=(top_logprobs or 0) if logprobs else None,
                                extra_stop=single_call_stop(tool_choice, bool(parallel)))
    return ChatBody(model=model, messages=messages, sampling=sampling, stream=stream,
                    stream_options=stream_options, logprobs=logprobs, top_logprobs=top_logprobs or 0,
                    priority=_priority(f), cache_salt=_cache_salt(f), add_generation_prompt=add_gen,
                    continue_final_message=cont, max_tokens_set=max_tokens is not None, tools=tools,
                    tool_choice=tool_choice, parallel_tool_calls=bool(parallel))
