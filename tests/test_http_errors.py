"""Domain errors -> HTTP (http_errors.py): the status, OpenAI error type/code and headers each one gets."""

from __future__ import annotations

import pytest

from kvpilot.common.errors import APIError
from kvpilot.daemon.engine.input_processor import ContextLengthExceeded, TokenOutOfVocab
from kvpilot.daemon.errors import EngineDead, EngineNotReady, EngineQueueFull, EngineRejected
from kvpilot.daemon.http_errors import to_api_error


@pytest.mark.parametrize("exc,status,code,headers", [
    (EngineQueueFull("full", retry_after_s=7), 429, "rate_limit_exceeded", {"Retry-After": "7"}),
    (EngineNotReady("loading"), 503, "model_loading", {"Retry-After": "5"}),
    (EngineDead("the engine stopped: boom"), 503, "engine_dead", {}),
    (EngineRejected("bug"), 500, "engine_error", {}),
    (TokenOutOfVocab("bad id", "stop_token_ids"), 400, "invalid_value", {}),
    (ContextLengthExceeded("too long", "max_tokens"), 400, "context_length_exceeded", {}),
])
def test_domain_errors_map_to_openai_errors(exc, status, code, headers):
    err = to_api_error(exc)
    assert err is not None and (err.status, err.code, err.headers) == (status, code, headers)
    assert err.message == str(exc)
    body = err.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}


def test_input_errors_keep_their_field_and_other_errors_are_not_mapped():
    assert to_api_error(TokenOutOfVocab("bad", "prompt")).param == "prompt"
    err = APIError("x", status=404)
    assert to_api_error(err) is err
    assert to_api_error(RuntimeError("a bug")) is None
    assert to_api_error(ValueError("unnamed")) is None


def test_undecodable_bodies_are_400_and_close_the_connection():
    from aiohttp.http_exceptions import ContentEncodingError
    from aiohttp.web_protocol import RequestPayloadError

    for exc in (RequestPayloadError("Can not decode content-encoding: gzip"), ContentEncodingError("gzip")):
        err = to_api_error(exc)
        assert err is not None and err.status == 400 and err.code == "invalid_body"
        assert err.headers == {"Connection": "close"} and "decode" in err.message.lower()
