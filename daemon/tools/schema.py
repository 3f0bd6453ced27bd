"""The grammar that forces a tool call (tool_choice "required" or a named function); the tools and
tool_choice themselves are checked in kvpilot.common.tools.

Forced calls are a structural tag for xgrammar: one tag per allowed tool, `<tool_call>\\n{"name":
"<name>", "arguments": ` + the tool's parameters schema + `}\\n</tool_call>`, so the name is exact and
the arguments always validate."""

from __future__ import annotations

import json

from kvpilot.common.tools import CALL_BEGIN, CALL_END, Tool, ToolChoice

from ..engine.structured import StructuredOutputSpec


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
