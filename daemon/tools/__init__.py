"""Tool calling: tools/tool_choice validation and forced-call grammars (schema), the Hermes parser
(hermes) and messages/responses (messages)."""

from .hermes import HermesStreamParser, ParsedOutput, ToolCall, new_call_id, parse
from .messages import (
    chat_message,
    finish_reason,
    parse_message_tool_fields,
    template_inputs,
    template_supports_tools,
    tools_system_prompt,
)
from .schema import Tool, ToolChoice, forced_call_spec, parse_tool_choice, parse_tools, single_call_stop

TOOL_CALL_PARSERS = {"hermes": HermesStreamParser}

__all__ = [
    "TOOL_CALL_PARSERS",
    "HermesStreamParser",
    "ParsedOutput",
    "Tool",
    "ToolCall",
    "ToolChoice",
    "chat_message",
    "finish_reason",
    "forced_call_spec",
    "new_call_id",
    "parse",
    "parse_message_tool_fields",
    "parse_tool_choice",
    "parse_tools",
    "single_call_stop",
    "template_inputs",
    "template_supports_tools",
    "tools_system_prompt",
]
