"""Hermes tool-call parser: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in model text.

`parse(text)` reads a finished output; `HermesStreamParser.feed(delta)` reads one as it streams and
returns OpenAI-shaped deltas. Both report `arguments` as the model's own JSON text for the value
(validated by json), so the streamed pieces concatenate to exactly what the full parse returns."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from kvpilot.common.tools import CALL_BEGIN, CALL_END, new_call_id

_DECODER = json.JSONDecoder()
_NAME_KEY = re.compile(r'^\s*\{\s*"name"\s*:\s*')
_ARGS_KEY = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_TRAILING = " \t\r\n}"  # may belong to the call's own closing brace: held back while streaming


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON text, as OpenAI sends it
    id: str = field(default_factory=new_call_id)

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out = {"index": index, **out}
        return out


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall]


def _split_call(body: str) -> tuple[str | None, int | None, int | None]:
    """(name, start, end) of the arguments value in a call body; None parts when not yet readable.
    Only the canonical order (name first) is read incrementally; `_parse_call_json` covers the rest."""
    m = _NAME_KEY.match(body)
    if not m:
        return None, None, None
    try:
        name, pos = _DECODER.raw_decode(body, m.end())
    except ValueError:
        return None, None, None
    if not isinstance(name, str):
        return None, None, None
    a = _ARGS_KEY.match(body, pos)
    if not a:
        return name, None, None
    try:
        _, end = _DECODER.raw_decode(body, a.end())
    except ValueError:
        return name, a.end(), None
    return name, a.end(), end


def _parse_call_json(body: str) -> ToolCall | None:
    """A complete call body -> ToolCall, or None if it is not a call."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    name, start, end = _split_call(body)
    if name == obj["name"] and start is not None and end is not None and not isinstance(args, str):
        return ToolCall(name, body[start:end])  # the model's own text of the value
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def parse(text: str) -> ParsedOutput:
    """All tool calls in a finished output, and the text around them as content (None if blank).
    A call cut off at the end (max_tokens) is kept as content, as is anything that is not valid JSON."""
    calls: list[ToolCall] = []
    content: list[str] = []
    pos = 0
    while (b := text.find(CALL_BEGIN, pos)) != -1:
        e = text.find(CALL_END, b)
        if e == -1:
            break
        call = _parse_call_json(text[b + len(CALL_BEGIN) : e].strip())
        content.append(text[pos:b] if call is not None else text[pos : e + len(CALL_END)])
        if call is not None:
            calls.append(call)
        pos = e + len(CALL_END)
    content.append(text[pos:])
    joined = "".join(content).strip()
    return ParsedOutput(joined or None, calls)


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker (could still become it)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class HermesStreamParser:
    """Incremental parse of one streamed output. feed() returns a list of OpenAI delta dicts:
    {"content": ...} and {"tool_calls": [{"index", "id"?, "type"?, "function": {"name"?, "arguments"}}]}."""

    def __init__(self) -> None:
        self._buf = ""  # text not yet decided on
        self._in_call = False
        self._calls: list[ToolCall] = []
        self._named = False  # the current call's header (id, name) has been sent

    @property
    def tool_calls(self) -> list[ToolCall]:
        return list(self._calls)

    def feed(self, delta: str) -> list[dict[str, Any]]:
        self._buf += delta
        out: list[dict[str, Any]] = []
        while True:
            step = self._call_step(out) if self._in_call else self._content_step(out)
            if not step:
                return out

    def finish(self) -> list[dict[str, Any]]:
        """End of stream: text held back (an unfinished marker or call) goes out as content."""
        out: list[dict[str, Any]] = []
        if self._buf and not self._in_call:
            out.append({"content": self._buf})
        elif self._in_call and not self._named:
            out.append({"content": CALL_BEGIN + self._buf})
        self._buf = ""
        return out

    def _content_step(self, out: list[dict[str, Any]]) -> bool:
        b = self._buf.find(CALL_BEGIN)
        if b == -1:
            keep = _held_prefix(self._buf, CALL_BEGIN)
            self._emit_content(out, self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        self._emit_content(out, self._buf[:b])
        self._buf = self._buf[b + len(CALL_BEGIN) :]
        self._in_call, self._named = True, False
        self._calls.append(ToolCall("", ""))
        return True

    def _emit_content(self, out: list[dict[str, Any]], text: str) -> None:
        # Whitespace between and after calls is layout, not an answer.
        if text and not (self._calls and not text.strip()):
            out.append({"content": text})

    def _call_step(self, out: list[dict[str, Any]]) -> bool:
        call, index = self._calls[-1], len(self._calls) - 1
        e = self._buf.find(CALL_END)
        body = self._buf if e == -1 else self._buf[:e]
        name, start, end = _split_call(body.strip() if e != -1 else body.lstrip())
        if e != -1:  # the call is complete: finish it from the full JSON
            done = _parse_call_json(body.strip())
            if done is None:
                self._calls.pop()
                out.append({"content": CALL_BEGIN + self._buf[: e + len(CALL_END)]})
            else:
                self._send(out, index, call, done.name, done.arguments)
            self._buf, self._in_call = self._buf[e + len(CALL_END) :], False
            return True
        if name is not None and start is not None:
            lead = len(body) - len(body.lstrip())
            args = body[lead + start : lead + end] if end is not None else body[lead + start :].rstrip(_TRAILING)
            if not args.startswith('"'):  # a stringified value only goes out once complete
                self._send(out, index, call, name, args)
        return False

    def _send(self, out: list[dict[str, Any]], index: int, call: ToolCall, name: str, args: str) -> None:
        """Send what is new of this call: the header once, then arguments beyond what was sent."""
        item: dict[str, Any] = {"index": index}
        if not self._named:
            call.name = name
            item.update({"id": call.id, "type": "function", "function": {"name": name, "arguments": ""}})
            self._named = True
        if args.startswith(call.arguments) and len(args) > len(call.arguments):
            item.setdefault("function", {})["arguments"] = args[len(call.arguments) :]
            call.arguments = args
        if len(item) > 1:
            out.append({"tool_calls": [item]})
