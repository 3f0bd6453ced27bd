"""Chat responses when tool calls can happen: the text is read by a tool-call parser, so calls go
out as `tool_calls` (whole, or streamed as OpenAI's deltas) and finish_reason becomes "tool_calls"."""

from __future__ import annotations

from typing import Any

from kvpilot.common.tools import single_call_stop

from ..engine.outputs import CompletionOutput
from ..protocol import ChatRequest
from ..response_formats import ChatFormat, ChoiceState, Detokenizer, RequestState
from .hermes import HermesStreamParser, parse
from .messages import chat_message, finish_reason


class ToolChatFormat(ChatFormat):
    """ChatFormat with one stream parser per choice (Hermes, the format forced calls use too)."""

    def __init__(self, tokenizer: Detokenizer, model_name: str, job: RequestState, req: ChatRequest,
                 parser: type[HermesStreamParser] = HermesStreamParser) -> None:
        super().__init__(tokenizer, model_name, job, req)
        self.parsers = {c.index: parser() for c in job.choices.values()}
        # parallel_tool_calls=false under "auto": the request stops at the first call's end marker
        self.call_stop = single_call_stop(req.tool_choice, req.parallel_tool_calls)

    def _cut_marker(self, c: ChoiceState) -> str:
        """The end marker a stop at `call_stop` cut off the choice's text (unless the client asked
        for stop strings in the output), to give back to the parser so the call completes."""
        if self.call_stop is None or c.stop_reason != self.call_stop or c.text.endswith(self.call_stop):
            return ""
        return self.call_stop

    def delta(self, c: ChoiceState, out: CompletionOutput) -> dict[str, Any] | None:
        text, toks, lps, done = self._advance(c, out)
        parser = self.parsers[c.index]
        if done:
            text += self._cut_marker(c)
        pieces = parser.feed(text) if text else []
        if done:
            pieces += parser.finish()
            c.finish_reason = finish_reason(c.finish_reason, parser.tool_calls)
        if not pieces and not toks and not done:
            return None
        return self._chunk([{"index": c.index, "delta": merge_deltas(pieces),
                             "logprobs": self._logprobs(toks, lps),
                             "finish_reason": c.finish_reason if done else None,
                             **({"stop_reason": c.stop_reason} if done else {})}])

    def final(self) -> dict[str, Any]:
        body = super().final()
        by_index = {c.index: c for c in self.job.choices.values()}
        for choice in body["choices"]:
            c = by_index[choice["index"]]
            parsed = parse(c.text + self._cut_marker(c))
            choice["message"] = chat_message(parsed.content, parsed.tool_calls)
            choice["finish_reason"] = finish_reason(choice["finish_reason"], parsed.tool_calls)
        return body


def merge_deltas(pieces: list[dict[str, Any]]) -> dict[str, Any]:
    """The parser's deltas of one step as one chunk delta: content joined, each call's pieces
    joined (its id, type and name come with its first piece)."""
    delta: dict[str, Any] = {}
    content = "".join(p["content"] for p in pieces if "content" in p)
    if content:
        delta["content"] = content
    calls: dict[int, dict[str, Any]] = {}
    for p in pieces:
        for item in p.get("tool_calls", []):
            held = calls.get(item["index"])
            if held is None:
                calls[item["index"]] = {**item, "function": dict(item.get("function", {}))}
                continue
            fn = held.setdefault("function", {})
            fn["arguments"] = fn.get("arguments", "") + item.get("function", {}).get("arguments", "")
    if calls:
        delta["tool_calls"] = [calls[i] for i in sorted(calls)]
    return delta
