"""Structured outputs and tool calls on a real daemon, through the official openai client: every
constrained output matches its constraint, streamed or not, and bad constraints are 400s naming
the field."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from support.daemon_process import DaemonProcess

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                        "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Describe a person."}]


@pytest.fixture(scope="module")
def daemon():
    d = DaemonProcess("--max-num-seqs", "8", "--kv-cache-memory", "64MiB", "--enable-auto-tool-choice",
                      "--tool-call-parser", "hermes", env={"KVPILOT_NUM_THREADS": "1"})
    with d:
        yield d


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.url("/v1"), api_key="x", max_retries=0, timeout=300)


def chat(client, stream: bool, **kw) -> tuple[str, str | None, list[dict]]:
    """(content, finish_reason, tool calls as dicts) of choice 0, streamed or not."""
    kw = {"model": "smollm2-135m", "messages": ASK, "temperature": 0, "max_tokens": 60, **kw}
    if not stream:
        c = client.chat.completions.create(**kw).choices[0]
        calls = [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
                 for t in c.message.tool_calls or []]
        return c.message.content or "", c.finish_reason, calls
    content, finish, calls = "", None, {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            finish = ch.finish_reason or finish
            for t in ch.delta.tool_calls or []:
                held = calls.setdefault(t.index, {"id": t.id, "name": "", "arguments": ""})
                held["name"] += (t.function.name or "") if t.function else ""
                held["arguments"] += (t.function.arguments or "") if t.function else ""
    return content, finish, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_and_json_object(client, stream):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    text, finish, _ = chat(client, stream, response_format=rf)
    jsonschema.validate(json.loads(text), PERSON)
    assert finish == "stop"
    text, _, _ = chat(client, stream, response_format={"type": "json_object"},
                      messages=[{"role": "user", "content": 'Return a JSON object with the key "city" set to Paris.'}])
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("stream", [False, True])
def test_choice_and_regex(client, stream):
    q = [{"role": "user", "content": "Is the sky green?"}]
    text, _, _ = chat(client, stream, messages=q, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert text in ("yes", "no")
    text, _, _ = chat(client, stream, messages=q, extra_body={"guided_choice": ["maybe", "never"]})
    assert text in ("maybe", "never")
    r = client.completions.create(model="smollm2-135m", prompt="Phone:", max_tokens=12, temperature=0,
                                  stream=stream, extra_body={"guided_regex": r"\d{3}-\d{4}"})
    out = "".join(c.choices[0].text for c in r) if stream else r.choices[0].text
    assert re.fullmatch(r"\d{3}-\d{4}", out), out


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_forced_tool_calls(client, stream, choice):
    msgs = [{"role": "user", "content": "What is the weather in Rome?"}]
    content, finish, calls = chat(client, stream, messages=msgs, tools=[WEATHER, TIME], tool_choice=choice,
                                  parallel_tool_calls=False, max_tokens=80)
    assert finish == "tool_calls" and len(calls) == 1 and not content.strip(), (content, calls)
    call = calls[0]
    assert call["id"].startswith("call_")
    if isinstance(choice, dict):
        assert call["name"] == "get_weather"
    tool = next(t for t in (WEATHER, TIME) if t["function"]["name"] == call["name"])
    jsonschema.validate(json.loads(call["arguments"]), tool["function"]["parameters"])


TWO_CALLS = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}\n'
             '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parallel", [False, True])
def test_auto_tool_calls_follow_parallel_tool_calls(client, stream, parallel):
    """The model is made to write two calls (a choice constraint) under "auto": both come back, or
    with parallel_tool_calls=false only the first, streamed or not."""
    msgs = [{"role": "user", "content": "Weather and time in Rome?"}]
    content, finish, calls = chat(client, stream, messages=msgs, tools=[WEATHER, TIME], tool_choice="auto",
                                  parallel_tool_calls=parallel, max_tokens=150,
                                  extra_body={"structured_outputs": {"choice": [TWO_CALLS]}})
    assert finish == "tool_calls" and content.strip() == "Checking.", (content, finish)
    assert all(c["id"].startswith("call_") for c in calls)
    want = [("get_weather", {"city": "Rome", "unit": "celsius"}), ("get_time", {"zone": "CET"})]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == (want if parallel else want[:1])


def test_single_call_stops_generating_after_the_call(client):
    """parallel_tool_calls=false ends the generation at the first call: the second is never written."""
    kw = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Weather and time in Rome?"}],
          "tools": [WEATHER, TIME], "max_tokens": 150, "temperature": 0,
          "extra_body": {"structured_outputs": {"choice": [TWO_CALLS]}}}
    one = client.chat.completions.create(parallel_tool_calls=False, **kw)
    both = client.chat.completions.create(parallel_tool_calls=True, **kw)
    assert len(one.choices[0].message.tool_calls) == 1 and len(both.choices[0].message.tool_calls) == 2
    assert one.usage.completion_tokens < both.usage.completion_tokens - 10, (one.usage, both.usage)


def test_tool_results_round_trip(client):
    """A call and its result in the history render and generate (auto: the server parses calls)."""
    msgs = [{"role": "user", "content": "Weather in Rome?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Rome", "unit": "celsius"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    _, finish, _ = chat(client, False, messages=msgs, tools=[WEATHER], max_tokens=8)
    assert finish in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(("kw", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "objectx"}}}},
     "response_format.json_schema.schema"),
    ({"extra_body": {"structured_outputs": {"regex": "a(b"}}}, "structured_outputs.regex"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_constraints_are_400s_naming_the_field(client, kw, param):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, False, **kw)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param, info.value.body
