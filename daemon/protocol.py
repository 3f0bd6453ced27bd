"""The daemon's side of OpenAI request parsing: a checked body (kvpilot.common.protocol, shared with the
router) becomes the engine's SamplingParams, with the output constraint it asks for (response_format &
co., or a forced tool call's grammar). Every problem is an `APIError`; only daemon/http_errors.py and
the server turn errors into HTTP answers. Nothing here runs the engine, so it is cheap to test on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from kvpilot.common.errors import invalid
from kvpilot.common.protocol import ChatBody, CompletionBody, parse_chat_body, parse_completion_body
from kvpilot.common.tools import Tool, ToolChoice

from .engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from .engine.structured import StructuredOutputSpec


@dataclass
class CompletionRequest(CompletionBody):
    params: SamplingParams = field(kw_only=True)  # made from `sampling` and the constraint


@dataclass
class ChatRequest(ChatBody):
    params: SamplingParams = field(kw_only=True)  # made from `sampling` and the constraint


_STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar")


def _structured_spec(body: dict[str, Any]) -> StructuredOutputSpec | None:
    """The output constraint the body asks for (response_format, structured_outputs, guided_*)."""
    if all(body.get(k) is None for k in _STRUCTURED_FIELDS):
        return None  # no xgrammar import for plain requests
    from .engine.structured import StructuredOutputError, spec_from_request

    try:
        return spec_from_request(body)
    except StructuredOutputError as exc:
        raise invalid(exc.field, str(exc)) from None


def _chat_constraint(tools: list[Tool], choice: ToolChoice | None, parallel: bool,
                     body: dict[str, Any]) -> StructuredOutputSpec | None:
    """response_format & co., or the grammar of a forced tool call (never both)."""
    spec = _structured_spec(body)
    if choice is None or choice.mode not in ("named", "required"):
        return spec
    if spec is not None:
        raise invalid("tool_choice", f"tool_choice {choice.mode!r} forces a tool call and cannot be combined "
                                     f"with {spec.field.split('.')[0]}")
    from .tools.schema import forced_call_spec

    return forced_call_spec(tools, choice, parallel=parallel)


def _sampling_params(sampling: dict[str, Any], structured: StructuredOutputSpec | None) -> SamplingParams:
    try:
        return SamplingParams(**sampling, structured_outputs=structured)
    except (ValueError, TypeError) as exc:  # backstop: the engine's own checks
        raise invalid(None, str(exc)) from None


def _fields_of(body: CompletionBody | ChatBody) -> dict[str, Any]:
    return {f.name: getattr(body, f.name) for f in fields(body)}


def parse_completion_request(body: dict[str, Any]) -> CompletionRequest:
    b = parse_completion_body(body)
    return CompletionRequest(**_fields_of(b), params=_sampling_params(b.sampling, _structured_spec(body)))


def parse_chat_request(body: dict[str, Any], *, auto_tool_choice: bool = False) -> ChatRequest:
    """auto_tool_choice: the server parses tool calls out of free text (--enable-auto-tool-choice)."""
    b = parse_chat_body(body, auto_tool_choice=auto_tool_choice)
    structured = _chat_constraint(b.tools, b.tool_choice, b.parallel_tool_calls, body)
    return ChatRequest(**_fields_of(b), params=_sampling_params(b.sampling, structured))
