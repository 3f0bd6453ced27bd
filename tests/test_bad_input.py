"""No input gives a 5xx: the bad-input corpus and a hypothesis fuzz of the request parsers and the live daemon.

The daemon runs without --api-key, the setting where a cross-origin text/plain POST would matter.
"""

from __future__ import annotations

import gzip
import json

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpilot.common.errors import APIError
from kvpilot.common.protocol import parse_json_body
from kvpilot.daemon.protocol import parse_chat_request, parse_completion_request
from kvpilot.daemon.request_body import decode_json_body, find_unpaired_surrogate
from kvpilot.daemon.tokenize_routes import parse_detokenize_request, parse_tokenize_request
from support.daemon_process import DaemonProcess

J = {"Content-Type": "application/json"}
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"


@pytest.fixture(scope="module")
def daemon():
    d = DaemonProcess("--served-model-name", "smollm2", "--max-num-seqs", "8", "--kv-cache-memory", "64MiB",
                      env={"KVPILOT_NUM_THREADS": "1"})
    with d:
        yield d


def _msg(content: str) -> bytes:
    return b'{"messages": [{"role": "user", "content": "' + content.encode() + b'"}], "max_tokens": 1}'


# (path, raw body, headers, expected status, expected param or None)
CORPUS = [
    (CMPL, b'{"prompt": "\\ud800", "max_tokens": 1}', J, 400, "prompt"),
    (CMPL, b'{"prompt": ["ok", "a\\udfffb"], "max_tokens": 1}', J, 400, "prompt[1]"),
    (CHAT, _msg("\\ud800"), J, 400, "messages[0].content"),
    (CHAT, _msg("\\udfff"), J, 400, "messages[0].content"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "stop": ["\\ud83d"]}', J, 400, "stop[0]"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "\\ud800": 1}', J, 400, "body"),
    # CESU-8: a surrogate encoded as three UTF-8-looking bytes, which json.loads(bytes) lets through
    (CMPL, b'{"prompt": "\xed\xa0\x80", "max_tokens": 1}', J, 400, None),
    (CHAT, b'{"messages": [{"role": "user", "content": "\xed\xb3\xbf"}]}', J, 400, None),
    (CMPL, b'{"prompt": "\xc0\xaf"}', J, 400, None),  # overlong encoding
    (CMPL, '{"prompt": "x"}'.encode("utf-16"), J, 400, None),
    (CMPL, b'{"prompt": "x"}', {**J, "Content-Encoding": "gzip"}, 400, None),  # not gzip
    (CMPL, gzip.compress(b'{"prompt": "x"}')[:12], {**J, "Content-Encoding": "gzip"}, 400, None),
    (CMPL, b'{"prompt": "x"}', {**J, "Content-Encoding": "deflate"}, 400, None),
    (CMPL, b'{"prompt": "x", "max_tokens": 1}', {"Content-Type": "text/plain"}, 415, "Content-Type"),
    (CHAT, _msg("hi"), {"Content-Type": "text/plain;charset=UTF-8"}, 415, "Content-Type"),
    (CMPL, b'{"prompt": "x"}', {"Content-Type": "application/x-www-form-urlencoded"}, 415, "Content-Type"),
    (CMPL, b'{"prompt": "x"}', {"Content-Type": "multipart/form-data; boundary=x"}, 415, "Content-Type"),
    (CMPL, b'{"prompt": "x"}', {"Content-Type": "application/json; charset=latin-1"}, 415, "Content-Type"),
    (CMPL, b'{"prompt": "x"}', {}, 415, "Content-Type"),
    ("/tokenize", b'{"prompt": "x"}', {"Content-Type": "text/plain"}, 415, "Content-Type"),
    ("/tokenize", b'{"prompt": "\\ud800"}', J, 400, "prompt"),
    ("/detokenize", b'{"tokens": [1, 10000000]}', J, 400, "tokens"),
    ("/detokenize", b'{"tokens": "abc"}', J, 400, "tokens"),
    (CMPL, b'{"prompt": "x", "logit_bias": {"abc": 1}}', J, 400, "logit_bias"),
    (CMPL, b'{"prompt": "x", "logit_bias": {"5": 101}}', J, 400, "logit_bias"),
    (CMPL, b'{"prompt": "x", "logit_bias": {"5": "high"}}', J, 400, "logit_bias"),
    (CMPL, b'{"prompt": "x", "logit_bias": {"99999999": 5}}', J, 400, "logit_bias"),
    (CMPL, b'{"prompt": "x", "logit_bias": [1]}', J, 400, "logit_bias"),
    (CMPL, b'{"prompt": "x", "prompt_logprobs": 21}', J, 400, "prompt_logprobs"),
    (CMPL, b"[" * 100_000 + b"]" * 100_000, J, 400, None),
]


async def test_bad_input_corpus_gets_4xx_openai_errors(daemon):
    async with aiohttp.ClientSession(auto_decompress=False) as s:
        for path, raw, headers, status, param in CORPUS:
            # skip_auto_headers: the client must not add its own Content-Type
            async with s.post(daemon.url(path), data=raw, headers=headers,
                              skip_auto_headers=["Content-Type"]) as r:
                text = await r.text()
                assert r.status == status, (path, raw[:60], headers, r.status, text)
                err = json.loads(text)["error"]
                assert set(err) == {"message", "type", "param", "code"}, text
                assert err["message"] and err["type"] == "invalid_request_error", text
                if param is not None:
                    assert err["param"] == param, (raw[:60], text)
    # a real gzip body is fine, and the daemon is still healthy
    body = gzip.compress(b'{"prompt": "Hello", "max_tokens": 2}')
    async with aiohttp.ClientSession() as s, s.post(daemon.url(CMPL), data=body,
                                                    headers={**J, "Content-Encoding": "gzip"}) as r:
        assert r.status == 200, await r.text()
        assert (await r.json())["usage"]["completion_tokens"] >= 1
    assert daemon.get("/health")[0] == 200


def test_valid_surrogate_pairs_pass():
    body = parse_json_body(b'{"prompt": "\\ud83d\\ude00"}')
    assert body["prompt"] == "\U0001F600" and find_unpaired_surrogate(body) is None
    assert find_unpaired_surrogate({"a": [{"b": "x\ud800"}]}) == "a[0].b"


# ---- hypothesis: every input is either a request or an APIError --------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
    max_leaves=12,
)
_small = st.integers(-3, 40)
_FIELD_VALUES = {
    "model": st.just("smollm2") | st.text(max_size=6) | _json,
    "prompt": st.text(max_size=20) | st.lists(st.integers(-2, 60000), max_size=5)
    | st.lists(st.text(max_size=5), max_size=3) | st.lists(st.lists(st.integers(0, 100), max_size=3), max_size=2)
    | _json,
    "messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", "bogus"]) | _json,
         "content": st.text(max_size=12) | st.lists(st.fixed_dictionaries(
             {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=5) | _json}), max_size=2)
         | _json}), max_size=3) | _json,
    "max_tokens": st.integers(-2, 3) | _json,
    "max_completion_tokens": st.integers(-2, 3) | _json,
    "n": _small | _json,
    "best_of": _small | _json,
    "temperature": st.floats(-1, 3) | _json,
    "top_p": st.floats(-0.5, 1.5) | _json,
    "top_k": _small | _json,
    "min_p": st.floats(-0.5, 1.5) | _json,
    "seed": st.integers(-(2**65), 2**65) | _json,
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=3), max_size=3) | _json,
    "stop_token_ids": st.lists(st.integers(-1, 70000), max_size=3) | _json,
    "logprobs": _small | st.booleans() | _json,
    "top_logprobs": _small | _json,
    "prompt_logprobs": _small | _json,
    "echo": st.booleans() | _json,
    "stream": st.booleans() | _json,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | _json,
                                                          "continuous_usage_stats": st.booleans() | _json}) | _json,
    "logit_bias": st.dictionaries(st.text("0123456789-x ", max_size=6), st.floats(-150, 150) | _json,
                                  max_size=3) | _json,
    "presence_penalty": st.floats(-3, 3) | _json,
    "frequency_penalty": st.floats(-3, 3) | _json,
    "repetition_penalty": st.floats(-1, 3) | _json,
    "min_tokens": _small | _json,
    "add_generation_prompt": st.booleans() | _json,
    "continue_final_message": st.booleans() | _json,
    "tokens": st.lists(st.integers(-5, 70000), max_size=4) | _json,
}
requests = st.fixed_dictionaries({}, optional=_FIELD_VALUES)


def _parse_all(body: dict) -> None:
    for parse in (parse_completion_request, parse_chat_request, parse_tokenize_request, parse_detokenize_request):
        try:
            parse(body)
        except APIError as exc:
            assert 400 <= exc.status < 500 and exc.message


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests)
def test_parsers_raise_only_api_errors(body):
    _parse_all(body)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64) | _json.map(lambda v: json.dumps(v).encode()))
def test_json_body_parser_raises_only_api_errors(raw):
    try:
        body = parse_json_body(raw)
    except APIError as exc:
        assert exc.status == 400
    else:
        assert isinstance(body, dict)


# any code point, lone surrogates included, in keys and values
_unicode = st.text(st.characters(codec=None, categories=None), max_size=6)
_any_text_json = st.recursive(st.none() | st.integers() | _unicode,
                              lambda kids: st.lists(kids, max_size=3) | st.dictionaries(_unicode, kids, max_size=3),
                              max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_unicode, _any_text_json, max_size=4))
def test_lone_surrogates_anywhere_are_a_400_naming_where(body):
    raw = json.dumps(body).encode()  # ensure_ascii: a lone surrogate goes out as a \udXXX escape
    expected = json.loads(raw)  # an adjacent high + low pair is joined into one character here
    has_lone = find_unpaired_surrogate(expected) is not None
    try:
        assert decode_json_body(raw) == expected and not has_lone
    except APIError as exc:
        assert has_lone and exc.status == 400 and exc.code == "invalid_unicode" and exc.param


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(body=requests, path=st.sampled_from([CMPL, CHAT, "/tokenize", "/detokenize"]))
async def test_fuzzed_requests_never_5xx(daemon, body, path):
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 2:
        body["max_tokens"] = 2
    body.pop("max_completion_tokens", None)
    body.setdefault("max_tokens", 1)  # keep the generation cheap; the parsing is what is under test
    body.pop("stream", None)
    async with aiohttp.ClientSession() as s, s.post(daemon.url(path), data=json.dumps(body), headers=J) as r:
        text = await r.text()
        assert r.status < 500, (path, body, r.status, text)
        if r.status >= 400:
            assert set(json.loads(text)["error"]) == {"message", "type", "param", "code"}


def test_a_surrogate_under_an_empty_key_is_still_named():
    assert find_unpaired_surrogate({"": {"\ud800": None}}) == 'body[""]'
    assert find_unpaired_surrogate({"": {"x": "\udfff"}}) == 'body[""].x'
