"""Tool calls in the daemon's answers: the Hermes parser (hermes), OpenAI's response shapes (messages),
chat responses that parse calls (chat_format) and forced-call grammars (schema). Validating tools and
tool_choice, and putting tools into the chat template, is kvpilot.common.tools' (shared with the router)."""

from .hermes import HermesStreamParser, ParsedOutput, ToolCall, parse
from .messages import chat_message, finish_reason
from .schema import forced_call_spec

TOOL_CALL_PARSERS = {"hermes": HermesStreamParser}

__all__ = [
    "TOOL_CALL_PARSERS",
    "HermesStreamParser",
    "ParsedOutput",
    "ToolCall",
    "chat_message",
    "finish_reason",
    "forced_call_spec",
    "parse",
]
