"""Chat messages with tool calls, in and out: the template side and OpenAI's response shapes.

Templates that know tools (their source mentions `tools`) get `tools=` and the messages as HF
templates expect them (assistant `tool_calls[].function.arguments` as a dict). Templates that do
not (SmolLM2's) get a Hermes system prompt listing the tools, and tool calls / tool results
written into message text, so any model can still be prompted for calls."""

from __future__ import annotations

import json
from typing import Any

from ..engine.structured import StructuredOutputError
from .hermes import ToolCall, new_call_id
from .schema import CALL_BEGIN, CALL_END, Tool


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
            raise StructuredOutputError(f"messages[{i}].tool_call_id", "a tool message needs 'tool_call_id'")
        extra["tool_call_id"] = tcid
    calls = msg.get("tool_calls")
    if calls is not None:
        if msg.get("role") != "assistant" or not isinstance(calls, list):
            raise StructuredOutputError(f"messages[{i}].tool_calls", "only assistant messages have tool_calls (an array)")
        extra["tool_calls"] = [_message_call(f"messages[{i}].tool_calls[{j}]", c) for j, c in enumerate(calls)]
    return extra


def _message_call(where: str, c: Any) -> dict[str, Any]:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise StructuredOutputError(f"{where}.function.name", "is required")
    args = fn.get("arguments", "{}")
    if not isinstance(args, str):
        raise StructuredOutputError(f"{where}.function.arguments", "must be a JSON string")
    try:
        json.loads(args)
    except ValueError:
        raise StructuredOutputError(f"{where}.function.arguments", "is not valid JSON") from None
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


def chat_message(content: str | None, calls: list[ToolCall]) -> dict[str, Any]:
    """The assistant `message` of a non-streamed choice."""
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [c.to_openai() for c in calls]
    return msg


def finish_reason(engine_reason: str | None, calls: list[ToolCall]) -> str | None:
    """OpenAI's finish_reason: "tool_calls" when the output stopped normally after calls."""
    return "tool_calls" if calls and engine_reason == "stop" else engine_reason
