"""parallel_tool_calls=false under tool_choice "auto": the request gets a stop string at the first
call's end marker, and the chat format gives the cut marker back to the parser, so one call comes
out (streamed or whole) with finish_reason "tool_calls". The engine side is the real stop-string
check (StopChecker, what TextStream runs); tests/test_openai_structured.py runs it on a daemon."""

from __future__ import annotations

import json

import pytest

from kvpilot.daemon.async_engine import Submission
from kvpilot.daemon.engine.detokenizer import StopChecker
from kvpilot.daemon.engine.outputs import CompletionOutput
from kvpilot.daemon.engine.sampling_params import SamplingParams
from kvpilot.daemon.protocol import ChatRequest, parse_chat_request
from kvpilot.daemon.response_formats import RequestState
from kvpilot.daemon.tools.chat_format import ToolChatFormat

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
TWO_CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')


def request(**kw) -> ChatRequest:
    body = {"messages": [{"role": "user", "content": "Weather and time in Paris?"}], "tools": [WEATHER, TIME], **kw}
    return parse_chat_request(body, auto_tool_choice=True)


def engine_outputs(text: str, params: SamplingParams, step: int) -> list[CompletionOutput]:
    """The cumulative outputs an engine reports while writing `text` `step` characters at a time,
    its stop strings applied as TextStream applies them (a partial match is held back)."""
    checker = StopChecker(params.stop_list, params.include_stop_str_in_output)
    outs = []
    for end in range(step, len(text) + step, step):
        seen, delta = text[:end], text[end - step : end]
        match = checker.check(seen, delta)
        if match is not None:
            return [*outs, CompletionOutput(0, match.text, [], None, None, "stop", match.stop)]
        last = end >= len(text)
        outs.append(CompletionOutput(0, seen if last else checker.safe_text(seen), [], None, None,
                                     "stop" if last else None))
    return outs


def respond(req: ChatRequest, text: str, step: int) -> tuple[dict, list[dict]]:
    """(the non-streamed body, the streamed chunks) of one choice that writes `text`."""
    job = RequestState("chatcmpl-t", [Submission("t-0", [1], req.params)], 1, [None])
    fmt = ToolChatFormat(None, "m", job, req)  # the tokenizer is only read for logprobs
    chunks = [ch for out in engine_outputs(text, req.params, step) if (ch := fmt.delta(job.choices[(0, 0)], out))]
    return fmt.final(), chunks


def streamed(chunks: list[dict]) -> tuple[str, str | None, list[tuple[str, str]]]:
    content, finish, calls = "", None, {}
    for ch in chunks:
        choice = ch["choices"][0]
        content += choice["delta"].get("content", "")
        finish = choice["finish_reason"] or finish
        for tc in choice["delta"].get("tool_calls", []):
            held = calls.setdefault(tc["index"], ["", ""])
            held[0] += tc.get("function", {}).get("name", "")
            held[1] += tc.get("function", {}).get("arguments", "")
    return content, finish, [tuple(calls[i]) for i in sorted(calls)]


def whole(body: dict) -> tuple[str | None, str, list[tuple[str, str]]]:
    choice = body["choices"][0]
    calls = [(t["function"]["name"], t["function"]["arguments"]) for t in choice["message"].get("tool_calls", [])]
    return choice["message"]["content"], choice["finish_reason"], calls


@pytest.mark.parametrize(("kw", "stop"), [
    ({"tool_choice": "auto", "parallel_tool_calls": False}, ["</tool_call>"]),
    ({"parallel_tool_calls": False}, ["</tool_call>"]),  # auto is the default with tools
    ({"parallel_tool_calls": False, "stop": ["END", "</tool_call>"]}, ["END", "</tool_call>"]),
    ({"parallel_tool_calls": False, "stop": "END"}, ["END", "</tool_call>"]),
    ({"tool_choice": "auto"}, []),
    ({"tool_choice": "auto", "parallel_tool_calls": True}, []),
    ({"tool_choice": "required", "parallel_tool_calls": False}, []),  # the grammar stops after one call
    ({"tool_choice": "none", "parallel_tool_calls": False}, []),
])
def test_stop_string_only_for_auto_without_parallel(kw, stop):
    assert request(**kw).params.stop_list == stop


@pytest.mark.parametrize("include_stop", [False, True])
@pytest.mark.parametrize("step", [1, 4, 9, len(TWO_CALLS)])
def test_one_call_when_not_parallel(step, include_stop):
    req = request(parallel_tool_calls=False, include_stop_str_in_output=include_stop)
    body, chunks = respond(req, TWO_CALLS, step)
    content, finish, calls = whole(body)
    assert (content, finish) == ("Let me check.", "tool_calls")
    assert calls == [("get_weather", '{"city": "Paris"}')]
    s_content, s_finish, s_calls = streamed(chunks)
    assert (s_content.strip(), s_finish, s_calls) == (content, finish, calls)


@pytest.mark.parametrize("step", [1, 4, len(TWO_CALLS)])
def test_both_calls_when_parallel(step):
    body, chunks = respond(request(tool_choice="auto"), TWO_CALLS, step)
    content, finish, calls = whole(body)
    assert (content, finish) == ("Let me check.", "tool_calls")
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    s_content, s_finish, s_calls = streamed(chunks)
    assert (s_content.strip(), s_finish, s_calls) == (content, finish, calls)


def test_a_bad_first_call_is_content_and_ends_the_turn():
    """The stop cannot tell a bad call from a good one: the turn ends at the first end marker, and
    the bad call is content, as it is for any parse."""
    text = "<tool_call>\n{not json}\n</tool_call>\n" + TWO_CALLS
    content, finish, calls = whole(respond(request(parallel_tool_calls=False), text, 5)[0])
    assert (content, finish, calls) == ("<tool_call>\n{not json}\n</tool_call>", "stop", [])
