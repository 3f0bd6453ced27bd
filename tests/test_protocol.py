"""Request validation: OpenAI bodies -> SamplingParams, and the error each bad field gets."""

from __future__ import annotations

import pytest

from kvpilot.common.errors import APIError
from kvpilot.common.protocol import parse_json_body
from kvpilot.daemon.protocol import parse_chat_request, parse_completion_request

MSGS = [{"role": "user", "content": "hi"}]


def test_completion_defaults_follow_openai():
    req = parse_completion_request({"model": "m", "prompt": "Hello"})
    assert req.prompts == ["Hello"]
    assert req.params.max_tokens == 16 and not req.max_tokens_set
    assert req.params.temperature == 1.0 and req.params.n == 1
    assert not req.stream and req.logprobs is None and not req.echo


def test_completion_maps_every_sampling_field():
    req = parse_completion_request({
        "prompt": "x", "n": 2, "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
        "seed": 3, "stop": ["a", "bb"], "presence_penalty": 0.5, "frequency_penalty": -0.5, "logprobs": 3,
        "ignore_eos": True, "min_tokens": 2, "repetition_penalty": 1.2, "stop_token_ids": [1, 2],
        "include_stop_str_in_output": True, "skip_special_tokens": False, "best_of": 3,
    })
    p = req.params
    assert (p.n, p.best_of, p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == \
        (2, 3, 7, 0.5, 0.9, 5, 0.1, 3)
    assert p.stop_list == ["a", "bb"] and p.stop_token_ids == [1, 2]
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert p.logprobs == 3 and p.ignore_eos and p.min_tokens == 2
    assert p.include_stop_str_in_output and not p.skip_special_tokens


@pytest.mark.parametrize("prompt,expected", [
    ("abc", ["abc"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_completion_prompt_shapes(prompt, expected):
    assert parse_completion_request({"prompt": prompt}).prompts == expected


def test_chat_logprobs_and_max_completion_tokens():
    req = parse_chat_request({"messages": MSGS, "logprobs": True, "top_logprobs": 4, "max_tokens": 9,
                              "max_completion_tokens": 5})
    assert req.params.logprobs == 4 and req.logprobs and req.top_logprobs == 4
    assert req.params.max_tokens == 5 and req.max_tokens_set
    plain = parse_chat_request({"messages": MSGS})
    assert plain.params.max_tokens is None and not plain.max_tokens_set and plain.params.logprobs is None


def test_chat_content_parts_are_joined():
    req = parse_chat_request({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                        {"type": "text", "text": "b"}]}]})
    assert req.messages == [{"role": "user", "content": "a\nb"}]


def test_stream_options():
    req = parse_chat_request({"messages": MSGS, "stream": True, "stream_options": {"include_usage": True}})
    assert req.stream and req.stream_options.include_usage


@pytest.mark.parametrize("body,param,code", [
    ({"prompt": "x", "temperature": -1}, "temperature", "decimal_below_min_value"),
    ({"prompt": "x", "temperature": 3}, "temperature", "decimal_above_max_value"),
    ({"prompt": "x", "temperature": "hot"}, "temperature", "invalid_type"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "integer_below_min_value"),
    ({"prompt": "x", "max_tokens": 1.5}, "max_tokens", "invalid_type"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens", "invalid_type"),
    ({"prompt": "x", "n": 0}, "n", "integer_below_min_value"),
    ({"prompt": "x", "top_p": 0}, "top_p", "decimal_below_min_value"),
    ({"prompt": "x", "logprobs": 21}, "logprobs", "integer_above_max_value"),
    ({"prompt": "x", "stop": [""]}, "stop", "invalid_value"),
    ({"prompt": "x", "stop": 5}, "stop", "invalid_type"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids", "invalid_value"),
    ({"prompt": "x", "min_tokens": 5, "max_tokens": 2}, "min_tokens", "invalid_value"),
    ({"prompt": "x", "best_of": 1, "n": 2}, "best_of", "invalid_value"),
    ({"prompt": "x", "suffix": "y"}, "suffix", "unsupported_parameter"),
    ({"prompt": "x", "logit_bias": {"a": 5}}, "logit_bias", "invalid_value"),
    ({"prompt": "x", "logit_bias": {"-1": 5}}, "logit_bias", "invalid_value"),
    ({"prompt": "x", "logit_bias": {"1": 100.5}}, "logit_bias", "invalid_value"),
    ({"prompt": "x", "logit_bias": {"1": "5"}}, "logit_bias", "invalid_type"),
    ({"prompt": "x", "logit_bias": [1]}, "logit_bias", "invalid_type"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs", "integer_above_max_value"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}},
     "stream_options.include_usage", "invalid_type"),
    ({"prompt": ""}, "prompt", "invalid_value"),
    ({"prompt": []}, "prompt", "invalid_value"),
    ({"prompt": [1, "a"]}, "prompt", "invalid_type"),
    ({}, "prompt", "missing_required_parameter"),
    ({"prompt": "x", "model": 3}, "model", "invalid_type"),
    ({"prompt": "x", "seed": 2**70}, "seed", "integer_above_max_value"),
])
def test_completion_errors_name_the_field(body, param, code):
    with pytest.raises(APIError) as ei:
        parse_completion_request(body)
    err = ei.value
    assert err.status == 400 and err.param == param and err.code == code
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("body,param", [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": MSGS, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": MSGS, "response_format": {"type": "yaml"}}, "response_format.type"),
    ({"messages": MSGS, "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": MSGS, "continue_final_message": True}, "continue_final_message"),
])
def test_chat_errors_name_the_field(body, param):
    with pytest.raises(APIError) as ei:
        parse_chat_request(body)
    assert ei.value.status == 400 and ei.value.param == param


def test_logit_bias_echo_and_prompt_logprobs_map_to_sampling_params():
    req = parse_completion_request({"prompt": "x", "logit_bias": {"5": -100, " 7": 2.5, "9": 100}})
    assert req.params.logit_bias == {5: -100.0, 7: 2.5, 9: 100.0} and req.params.prompt_logprobs is None
    req = parse_completion_request({"prompt": "x", "echo": True, "logprobs": 3})
    assert req.echo and req.params.logprobs == 3 and req.params.prompt_logprobs == 3  # echo scores the prompt
    assert parse_completion_request({"prompt": "x", "echo": True}).params.prompt_logprobs is None
    chat = parse_chat_request({"messages": MSGS, "prompt_logprobs": 0, "logit_bias": {}})
    assert chat.params.prompt_logprobs == 0 and chat.params.logit_bias is None


@pytest.mark.parametrize("raw", [b"", b"   ", b"{", b"[1,2]", b'"s"', b'{"a": NaN}', b"\xff\xfe"])
def test_bad_json_bodies(raw):
    with pytest.raises(APIError) as ei:
        parse_json_body(raw)
    assert ei.value.status == 400 and ei.value.code == "invalid_json"
