"""OpenAI `tools` / `tool_choice` / tool-message validation, and tools in the chat template's inputs.

Shared by the daemon (which also forces and parses calls: daemon/tools/) and the router (which renders
the same prompt). Tool calls are written in the Hermes (NousResearch) format, as Qwen2.5 and many
fine-tunes print them. Templates that know tools (their source mentions `tools`) get `tools=` and the
messages as HF templates expect them (assistant `tool_calls[].function.arguments` as a dict). Templates
that do not (SmolLM2's) get a Hermes system prompt listing the tools, and tool calls / tool results
written into message text, so any model can still be prompted for calls.

Every problem is an APIError (400) naming the field in `param`."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from .errors import invalid_field

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
CALL_BEGIN = "<tool_call>"
CALL_END = "</tool_call>"
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

Mode = Literal["none", "auto", "required", "named"]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]
    strict: bool | None = None

    def to_openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolChoice:
    mode: Mode
    name: str | None = None  # mode "named"


def parse_tools(value: Any) -> list[Tool]:
    """`tools` of a chat request; raises an APIError naming the bad field."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise invalid_field("tools", "must be an array of tools")
    tools = [_parse_tool(i, t) for i, t in enumerate(value)]
    names = [t.name for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise invalid_field("tools", f"function name {dup!r} appears more than once")
    return tools


def _parse_tool(i: int, t: Any) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type", "function") != "function":
        raise invalid_field(f"{where}.type", "only tools of type 'function' are supported")
    fn = t.get("function")
    if not isinstance(fn, dict):
        raise invalid_field(f"{where}.function", "is required and must be an object")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise invalid_field(f"{where}.function.name", "must be 1-64 characters of a-z, A-Z, 0-9, _ and -")
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise invalid_field(f"{where}.function.description", "must be a string")
    params = fn.get("parameters", _EMPTY_PARAMETERS)
    if not isinstance(params, dict):
        raise invalid_field(f"{where}.function.parameters", "must be a JSON schema object")
    import jsonschema  # only requests with tools pay for it

    try:
        jsonschema.validators.validator_for(params).check_schema(params)
    except jsonschema.SchemaError as exc:
        at = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise invalid_field(f"{where}.function.parameters", f"invalid JSON schema at {at}: {exc.message}") from None
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid_field(f"{where}.function.strict", "must be a boolean")
    return Tool(name=name, description=desc, parameters=params, strict=strict)


def parse_tool_choice(value: Any, tools: list[Tool], *, auto_enabled: bool) -> ToolChoice:
    """tool_choice, checked against the tools. Absent: "auto" when the server parses tool calls,
    else "none". "auto" needs --enable-auto-tool-choice (a parser must read the free text)."""
    if value is None:
        return ToolChoice("auto" if tools and auto_enabled else "none")
    if value in ("none", "auto", "required"):
        if value != "none" and not tools:
            raise invalid_field("tool_choice", f"{value!r} needs a non-empty 'tools'")
        if value == "auto" and not auto_enabled:
            raise invalid_field("tool_choice", '"auto" tool choice needs the server started with '
                                "--enable-auto-tool-choice and --tool-call-parser")
        return ToolChoice(value)
    if isinstance(value, dict) and value.get("type") == "function":
        fn = value.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise invalid_field("tool_choice.function.name", "is required")
        if name not in {t.name for t in tools}:
            raise invalid_field("tool_choice.function.name", f"{name!r} is not one of the given tools")
        return ToolChoice("named", name)
    raise invalid_field("tool_choice", "must be 'none', 'auto', 'required' or "
                        '{"type": "function", "function": {"name": ...}}')


def single_call_stop(choice: ToolChoice | None, parallel: bool) -> str | None:
    """The stop string that enforces parallel_tool_calls=false for "auto": generation ends at the
    first call's end marker, so a second call is never written (nor paid for). Forced calls need
    none: their grammar already stops after one call."""
    return CALL_END if choice is not None and choice.mode == "auto" and not parallel else None


# ----------------------------------------------------------------- messages and the template


def template_supports_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the "tool_use" one, else the default
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and "tools" in template


def parse_message_tool_fields(i: int, msg: dict[str, Any]) -> dict[str, Any]:
    """The tool fields of request message i to keep (assistant tool_calls, tool tool_call_id)."""
    extra: dict[str, Any] = {}
    if msg.get("role") == "tool":
        tcid = msg.get("tool_call_id")
        if not isinstance(tcid, str) or not tcid:
            raise invalid_field(f"messages[{i}].tool_call_id", "a tool message needs 'tool_call_id'")
        extra["tool_call_id"] = tcid
    calls = msg.get("tool_calls")
    if calls is not None:
        if msg.get("role") != "assistant" or not isinstance(calls, list):
            raise invalid_field(f"messages[{i}].tool_calls", "only assistant messages have tool_calls (an array)")
        extra["tool_calls"] = [_message_call(f"messages[{i}].tool_calls[{j}]", c) for j, c in enumerate(calls)]
    return extra


def _message_call(where: str, c: Any) -> dict[str, Any]:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise invalid_field(f"{where}.function.name", "is required")
    args = fn.get("arguments", "{}")
    if not isinstance(args, str):
        raise invalid_field(f"{where}.function.arguments", "must be a JSON string")
    try:
        json.loads(args)
    except ValueError:
        raise invalid_field(f"{where}.function.arguments", "is not valid JSON") from None
    return {"id": c.get("id") or new_call_id(), "type": "function",
            "function": {"name": fn["name"], "arguments": args}}


def template_inputs(messages: list[dict[str, Any]], tools: list[Tool], native: bool) -> tuple[list, list | None]:
    """(messages, tools) for tokenizer.apply_chat_template(messages, tools=tools, ...)."""
    if not tools and not any("tool_calls" in m or m.get("role") == "tool" for m in messages):
        return messages, None
    if native:
        return [_native_message(m) for m in messages], [t.to_openai() for t in tools] or None
    out = [_text_message(m) for m in messages]
    if tools:
        prompt = tools_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _native_message(m: dict[str, Any]) -> dict[str, Any]:
    if "tool_calls" not in m:
        return m
    calls = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
             for c in m["tool_calls"]]
    return {**m, "tool_calls": calls}


def _text_message(m: dict[str, Any]) -> dict[str, Any]:
    if m.get("role") == "tool":
        return {"role": "tool", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
    if "tool_calls" in m:
        calls = "\n".join(
            f'{CALL_BEGIN}\n{{"name": {json.dumps(c["function"]["name"])}, "arguments": {c["function"]["arguments"]}}}\n{CALL_END}'
            for c in m["tool_calls"]
        )
        text = m.get("content") or ""
        return {"role": "assistant", "content": f"{text}\n{calls}" if text else calls}
    return m


def tools_system_prompt(tools: list[Tool]) -> str:
    listing = "\n".join(json.dumps(t.to_openai(), ensure_ascii=False) for t in tools)
    return (
        "You can call functions. Their signatures, as JSON schemas, are inside <tools></tools>:\n"
        f"<tools>\n{listing}\n</tools>\n"
        "To call one, answer with a JSON object holding the function's name and its arguments, "
        f'inside {CALL_BEGIN}{CALL_END} tags:\n{CALL_BEGIN}\n{{"name": <function-name>, "arguments": '
        f"<arguments-json-object>}}\n{CALL_END}"
    )
