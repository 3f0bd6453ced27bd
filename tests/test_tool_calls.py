"""Tool calling: the Hermes parser (whole and streamed), tools/tool_choice validation, the prompt
for templates without tool support, and forced calls on the real model (the arguments validate)."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from test_structured_output import GuidedSampler, run

from kvpilot.common.errors import APIError
from kvpilot.common.tools import (
    parse_message_tool_fields,
    parse_tool_choice,
    parse_tools,
    template_inputs,
    template_supports_tools,
)
from kvpilot.daemon.engine import SamplingParams
from kvpilot.daemon.tools import HermesStreamParser, chat_message, finish_reason, forced_call_spec, parse

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}}, "required": ["zone"]}}}
TWO_CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
             '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')


# ----------------------------------------------------------------- parser
def test_parse_complete_output():
    out = parse(TWO_CALLS)
    assert out.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "CET"})]
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in out.tool_calls)
    assert len({c.id for c in out.tool_calls}) == 2


def test_parse_keeps_bad_or_unfinished_calls_as_content():
    assert parse("plain answer").tool_calls == [] and parse("plain answer").content == "plain answer"
    bad = "<tool_call>\n{not json}\n</tool_call>"
    assert parse(bad).content == bad and parse(bad).tool_calls == []
    cut = '<tool_call>\n{"name": "get_weather", "argu'
    assert parse(cut).content == cut and parse(cut).tool_calls == []
    flipped = parse('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>')
    assert flipped.tool_calls[0].name == "f" and json.loads(flipped.tool_calls[0].arguments) == {"a": 1}


def _collect(deltas):
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            c = calls.setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
            if "id" in tc:
                assert c["id"] is None, "the id is sent once, in the first delta of a call"
                c["id"] = tc["id"]
                assert tc["type"] == "function"
            c["name"] += tc.get("function", {}).get("name", "")
            c["arguments"] += tc.get("function", {}).get("arguments", "")
    return content, calls


@pytest.mark.parametrize("seed", range(6))
def test_streamed_deltas_add_up_to_the_complete_parse(seed):
    rng = random.Random(seed)
    parser, deltas, i = HermesStreamParser(), [], 0
    while i < len(TWO_CALLS):
        k = rng.randint(1, 7)
        deltas += parser.feed(TWO_CALLS[i : i + k])
        i += k
    deltas += parser.finish()
    content, calls = _collect(deltas)
    whole = parse(TWO_CALLS)
    assert content.strip() == whole.content
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(c.name, c.arguments) for c in whole.tool_calls]
    assert [c["id"] for c in calls.values()] == [c.id for c in parser.tool_calls]
    # Arguments really stream: the first call's arguments arrive over several deltas.
    assert sum(1 for d in deltas for tc in d.get("tool_calls", []) if tc["index"] == 0
               and tc.get("function", {}).get("arguments")) > 1


def test_stream_without_calls_and_with_a_lone_marker_prefix():
    parser = HermesStreamParser()
    deltas = parser.feed("Use <tool") + parser.feed("s> wisely <") + parser.finish()
    assert "".join(d["content"] for d in deltas) == "Use <tools> wisely <"
    assert parser.tool_calls == []


def test_response_shapes():
    calls = parse(TWO_CALLS).tool_calls
    msg = chat_message(None, calls)
    assert msg["role"] == "assistant" and msg["content"] is None
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": calls[0].arguments}
    assert finish_reason("stop", calls) == "tool_calls"
    assert finish_reason("length", calls) == "length" and finish_reason("stop", []) == "stop"


# ----------------------------------------------------------------- validation
@pytest.mark.parametrize(("tools", "choice", "field"), [
    ([{"type": "function", "function": {"name": "bad name"}}], None, "tools[0].function.name"),
    ([{"type": "retrieval"}], None, "tools[0].type"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}], None, "tools[0].function.parameters"),
    ([WEATHER, WEATHER], None, "tools"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
    ([WEATHER], "auto", "tool_choice"),  # no --enable-auto-tool-choice
    ([], "required", "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
])
def test_bad_tools_name_the_field(tools, choice, field):
    with pytest.raises(APIError) as info:
        parse_tool_choice(choice, parse_tools(tools), auto_enabled=False)
    assert info.value.param == field and info.value.status == 400
    assert str(info.value).startswith(f"{field}: ")


def test_tool_choice_defaults_and_modes():
    tools = parse_tools([WEATHER])
    assert parse_tool_choice(None, tools, auto_enabled=True).mode == "auto"
    assert parse_tool_choice(None, tools, auto_enabled=False).mode == "none"
    assert forced_call_spec(tools, parse_tool_choice("none", tools, auto_enabled=False)) is None
    assert forced_call_spec(tools, parse_tool_choice("auto", tools, auto_enabled=True)) is None
    named = parse_tool_choice({"type": "function", "function": {"name": "get_weather"}}, tools, auto_enabled=False)
    assert named.mode == "named" and named.name == "get_weather"


def test_message_tool_fields():
    assert parse_message_tool_fields(0, {"role": "tool", "tool_call_id": "call_1", "content": "x"}) == {
        "tool_call_id": "call_1"}
    with pytest.raises(APIError, match="tool_call_id"):
        parse_message_tool_fields(2, {"role": "tool", "content": "x"})
    with pytest.raises(APIError, match=r"messages\[1\].tool_calls\[0\].function.arguments"):
        parse_message_tool_fields(1, {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]})


# ----------------------------------------------------------------- the real model
@pytest.fixture
def guided(llm):
    g = GuidedSampler(llm.engine)
    yield g
    g.close()


def _prompt(llm, messages, tools):
    tok = llm.get_tokenizer()
    msgs, native_tools = template_inputs(messages, tools, template_supports_tools(tok))
    return tok.apply_chat_template(msgs, tools=native_tools, tokenize=False, add_generation_prompt=True)


def test_template_fallback_renders_tools_calls_and_results(llm):
    tok = llm.get_tokenizer()
    assert not template_supports_tools(tok)  # SmolLM2's template ignores tools=
    tools = parse_tools([WEATHER])
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", **parse_message_tool_fields(1, {"role": "assistant", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]})},
        {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"},
    ]
    text = _prompt(llm, history, tools)
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in text
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in text


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_time"}}, "required"])
def test_forced_call_arguments_validate(llm, guided, choice):
    tools = parse_tools([WEATHER, TIME])
    spec = forced_call_spec(tools, parse_tool_choice(choice, tools, auto_enabled=False), parallel=False)
    prompt = _prompt(llm, [{"role": "user", "content": "What is the weather like in Rome right now?"}], tools)
    params = guided.constrain(SamplingParams(temperature=0, max_tokens=80), spec)
    out = run(llm, [prompt], params)[0][0]
    parsed = parse(out.text)
    assert len(parsed.tool_calls) == 1, out.text
    call = parsed.tool_calls[0]
    if isinstance(choice, dict):
        assert call.name == "get_time"
    schema = next(t.parameters for t in tools if t.name == call.name)
    jsonschema.validate(json.loads(call.arguments), schema)
    assert finish_reason(out.finish_reason, parsed.tool_calls) == "tool_calls"
    # Streaming the same text gives the same call.
    stream = HermesStreamParser()
    deltas = [d for ch in out.text for d in stream.feed(ch)] + stream.finish()
    _, calls = _collect(deltas)
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(call.name, call.arguments)]


def test_merge_deltas_joins_one_steps_pieces_per_call():
    from kvpilot.daemon.tools.chat_format import merge_deltas

    pieces = [{"content": "Sure. "},
              {"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                               "function": {"name": "get_time", "arguments": ""}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": '{"zone": '}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": '"CET"}'}}]},
              {"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                               "function": {"name": "get_weather", "arguments": "{}"}}]}]
    assert merge_deltas(pieces) == {"content": "Sure. ", "tool_calls": [
        {"index": 0, "id": "call_a", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}},
        {"index": 1, "id": "call_b", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}
    assert merge_deltas([]) == {}
