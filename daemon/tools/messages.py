"""OpenAI's response shapes for tool calls: the assistant message and finish_reason. (Tool calls and
results in request messages, and in the template's inputs, are kvpilot.common.tools'.)"""

from __future__ import annotations

from typing import Any

from .hermes import ToolCall


def chat_message(content: str | None, calls: list[ToolCall]) -> dict[str, Any]:
    """The assistant `message` of a non-streamed choice."""
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [c.to_openai() for c in calls]
    return msg


def finish_reason(engine_reason: str | None, calls: list[ToolCall]) -> str | None:
    """OpenAI's finish_reason: "tool_calls" when the output stopped normally after calls."""
    return "tool_calls" if calls and engine_reason == "stop" else engine_reason
