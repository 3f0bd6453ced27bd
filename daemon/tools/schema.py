"""OpenAI `tools` / `tool_choice` validation, and the grammar that forces a call.

Forced calls (tool_choice "required" or a named function) are a structural tag for xgrammar: one
tag per allowed tool, `<tool_call>\\n{"name": "<name>", "arguments": ` + the tool's parameters
schema + `}\\n</tool_call>`, so the name is exact and the arguments always validate."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema

from ..engine.structured import StructuredOutputError, StructuredOutputSpec

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# Hermes (NousResearch) format, as Qwen2.5 and many fine-tunes print it.
CALL_BEGIN = "<tool_call>"
CALL_END = "</tool_call>"
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

Mode = Literal["none", "auto", "required", "named"]


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
    """`tools` of a chat request; raises StructuredOutputError naming the bad field."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise StructuredOutputError("tools", "must be an array of tools")
    tools = [_parse_tool(i, t) for i, t in enumerate(value)]
    names = [t.name for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise StructuredOutputError("tools", f"function name {dup!r} appears more than once")
    return tools


def _parse_tool(i: int, t: Any) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type", "function") != "function":
        raise StructuredOutputError(f"{where}.type", "only tools of type 'function' are supported")
    fn = t.get("function")
    if not isinstance(fn, dict):
        raise StructuredOutputError(f"{where}.function", "is required and must be an object")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise StructuredOutputError(f"{where}.function.name", "must be 1-64 characters of a-z, A-Z, 0-9, _ and -")
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise StructuredOutputError(f"{where}.function.description", "must be a string")
    params = fn.get("parameters", _EMPTY_PARAMETERS)
    if not isinstance(params, dict):
        raise StructuredOutputError(f"{where}.function.parameters", "must be a JSON schema object")
    try:
        jsonschema.validators.validator_for(params).check_schema(params)
    except jsonschema.SchemaError as exc:
        at = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise StructuredOutputError(f"{where}.function.parameters", f"invalid JSON schema at {at}: {exc.message}") from None
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise StructuredOutputError(f"{where}.function.strict", "must be a boolean")
    return Tool(name=name, description=desc, parameters=params, strict=strict)


def parse_tool_choice(value: Any, tools: list[Tool], *, auto_enabled: bool) -> ToolChoice:
    """tool_choice, checked against the tools. Absent: "auto" when the server parses tool calls,
    else "none". "auto" needs --enable-auto-tool-choice (a parser must read the free text)."""
    if value is None:
        return ToolChoice("auto" if tools and auto_enabled else "none")
    if value in ("none", "auto", "required"):
        if value != "none" and not tools:
            raise StructuredOutputError("tool_choice", f"{value!r} needs a non-empty 'tools'")
        if value == "auto" and not auto_enabled:
            raise StructuredOutputError("tool_choice", '"auto" tool choice needs the server started with '
                                        "--enable-auto-tool-choice and --tool-call-parser")
        return ToolChoice(value)
    if isinstance(value, dict) and value.get("type") == "function":
        fn = value.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise StructuredOutputError("tool_choice.function.name", "is required")
        if name not in {t.name for t in tools}:
            raise StructuredOutputError("tool_choice.function.name", f"{name!r} is not one of the given tools")
        return ToolChoice("named", name)
    raise StructuredOutputError("tool_choice", "must be 'none', 'auto', 'required' or "
                                '{"type": "function", "function": {"name": ...}}')


def single_call_stop(choice: ToolChoice | None, parallel: bool) -> str | None:
    """The stop string that enforces parallel_tool_calls=false for "auto": generation ends at the
    first call's end marker, so a second call is never written (nor paid for). Forced calls need
    none: their grammar already stops after one call."""
    return CALL_END if choice is not None and choice.mode == "auto" and not parallel else None


def forced_call_spec(tools: list[Tool], choice: ToolChoice, *, parallel: bool = True) -> StructuredOutputSpec | None:
    """The constraint for "required" (any tool, one or more calls; one when not parallel) or a named
    tool (exactly one call); None for "none" and "auto"."""
    if choice.mode == "named":
        allowed = [t for t in tools if t.name == choice.name]
        parallel = False
    elif choice.mode == "required":
        allowed = tools
    else:
        return None
    tags = [
        {
            "type": "tag",
            "begin": f'{CALL_BEGIN}\n{{"name": {json.dumps(t.name)}, "arguments": ',
            "content": {"type": "json_schema", "json_schema": t.parameters},
            "end": f"}}\n{CALL_END}",
        }
        for t in allowed
    ]
    fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
           "stop_after_first": not parallel}
    return StructuredOutputSpec.structural_tag({"type": "structural_tag", "format": fmt}, "tool_choice").validate()
