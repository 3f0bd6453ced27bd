"""server.py against a real `kvpilot serve` subprocess: discovery, probes, auth, error bodies, metrics, logs.

One daemon (with an API key) serves the whole module, spoken to by the official openai client and aiohttp.
"""

from __future__ import annotations

import json

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.api_daemon import ALIAS, KEY, NAME, PROMPTS, api_daemon

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def daemon():
    with api_daemon() as d:
        yield d


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.url("/v1"), api_key=KEY, max_retries=0, timeout=120)


def metric_samples(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


# ---- discovery, probes, auth -------------------------------------------------------------------------


def test_models_and_version(daemon, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME, ALIAS]
    assert models.data[0].owned_by == "kvpilot" and models.data[0].model_extra["max_model_len"] > 0
    status, body = daemon.get("/version", {"Authorization": f"Bearer {KEY}"})
    assert status == 200 and json.loads(body)["version"]


def test_probes_and_metrics_need_no_key(daemon):
    for path in ("/health", "/ready", "/metrics", "/version"):
        status, _ = daemon.get(path)
        assert status == 200, path


def test_auth_401_without_or_with_wrong_key_200_with_it(daemon):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic x"}):
        status, body = daemon.get("/v1/models", headers)
        assert status == 401, headers
        err = json.loads(body)["error"]
        assert err["code"] == "invalid_api_key" and set(err) == {"message", "type", "param", "code"}
    bad = openai.OpenAI(base_url=daemon.url("/v1"), api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=NAME, prompt="hi", max_tokens=1)
    assert daemon.get("/v1/models", {"Authorization": f"Bearer {KEY}"})[0] == 200


# ---- malformed requests ------------------------------------------------------------------------------

J = "application/json"
CORPUS = [
    ("POST", "/v1/completions", b"", J),
    ("POST", "/v1/completions", b"{", J),
    ("POST", "/v1/completions", b"not json at all", "text/plain"),
    ("POST", "/v1/completions", b"[]", J),
    ("POST", "/v1/completions", b'"prompt"', J),
    ("POST", "/v1/completions", b"null", J),
    ("POST", "/v1/completions", b'{"prompt": "x", "max_tokens": NaN}', J),
    ("POST", "/v1/completions", b"\xff\xfe\x00garbage", J),
    ("POST", "/v1/completions", {}, J),
    ("POST", "/v1/completions", {"prompt": 42}, J),
    ("POST", "/v1/completions", {"prompt": None}, J),
    ("POST", "/v1/completions", {"prompt": [[]]}, J),
    ("POST", "/v1/completions", {"prompt": [1, -5]}, J),
    ("POST", "/v1/completions", {"prompt": [10**9]}, J),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": -1}, J),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": "ten"}, J),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 10**9}, J),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": -0.5}, J),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": [1]}, J),
    ("POST", "/v1/completions", {"prompt": "x", "top_p": 1.5}, J),
    ("POST", "/v1/completions", {"prompt": "x", "top_k": -7}, J),
    ("POST", "/v1/completions", {"prompt": "x", "min_p": 2}, J),
    ("POST", "/v1/completions", {"prompt": "x", "n": 0}, J),
    ("POST", "/v1/completions", {"prompt": "x", "n": 1000}, J),
    ("POST", "/v1/completions", {"prompt": "x", "n": 17}, J),  # more than --max-num-seqs
    ("POST", "/v1/completions", {"prompt": "x", "logprobs": 99}, J),
    ("POST", "/v1/completions", {"prompt": "x", "logprobs": True}, J),
    ("POST", "/v1/completions", {"prompt": "x", "stop": {"a": 1}}, J),
    ("POST", "/v1/completions", {"prompt": "x", "presence_penalty": 9}, J),
    ("POST", "/v1/completions", {"prompt": "x", "frequency_penalty": "high"}, J),
    ("POST", "/v1/completions", {"prompt": "x", "repetition_penalty": 0}, J),
    ("POST", "/v1/completions", {"prompt": "x", "seed": "abc"}, J),
    ("POST", "/v1/completions", {"prompt": "x", "stream": "yes"}, J),
    ("POST", "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, J),
    ("POST", "/v1/completions", {"prompt": "x", "stop_token_ids": [10**9]}, J),
    ("POST", "/v1/completions", {"prompt": "x", "min_tokens": 50, "max_tokens": 5}, J),
    ("POST", "/v1/completions", {"prompt": "x", "model": "no-such-model"}, J),
    ("POST", "/v1/completions", {"prompt": "x", "model": ["smollm2"]}, J),
    ("POST", "/v1/completions", {"prompt": "x", "echo": True, "logprobs": 21}, J),
    ("POST", "/v1/completions", {"prompt": "x", "logit_bias": {"1": 500}}, J),
    ("POST", "/v1/completions", b'{"prompt": "\\ud800"}', J),
    ("POST", "/v1/completions", b'{"prompt": "\xed\xa0\x80"}', J),
    ("POST", "/v1/completions", b'{"prompt": "x"}', "text/plain"),
    ("POST", "/tokenize", {"prompt": 5}, J),
    ("POST", "/detokenize", {"tokens": [-1]}, J),
    ("POST", "/v1/chat/completions", {}, J),
    ("POST", "/v1/chat/completions", {"messages": []}, J),
    ("POST", "/v1/chat/completions", {"messages": "hello"}, J),
    ("POST", "/v1/chat/completions", {"messages": [{"content": "no role"}]}, J),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, J),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 30,
                                      "logprobs": True}, J),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                      "response_format": {"type": "json_schema"}}, J),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     J),
    ("GET", "/v1/completions", None, J),
    ("POST", "/v1/models", {}, J),
    ("GET", "/v1/nope", None, J),
    ("GET", "/v1/models/no-such-model", None, J),
]


async def test_malformed_corpus_gets_4xx_error_bodies(daemon, client):
    assert len(CORPUS) >= 30
    headers = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession() as s:
        for method, path, body, ctype in CORPUS:
            data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
            async with s.request(method, daemon.url(path), data=data,
                                 headers={**headers, "Content-Type": ctype}) as r:
                text = await r.text()
                assert 400 <= r.status < 500, (method, path, body, r.status, text)
                err = json.loads(text)["error"]
                assert set(err) == {"message", "type", "param", "code"}, text
                assert isinstance(err["message"], str) and err["message"]
        big = b'{"prompt": "' + b"a" * (33 * 1024 * 1024) + b'"}'
        async with s.post(daemon.url("/v1/completions"), data=big, headers={**headers, "Content-Type": J}) as r:
            assert r.status == 413 and "error" in await r.json()
    assert daemon.get("/health")[0] == 200 and daemon.get("/ready")[0] == 200
    r = client.completions.create(model=NAME, prompt="Still alive?", max_tokens=3)
    assert r.choices[0].text is not None and r.usage.completion_tokens >= 1


# ---- metrics and logs --------------------------------------------------------------------------------


def test_metrics_names_and_labels(daemon, client):
    client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=4, extra_body={"ignore_eos": True})
    status, body = daemon.get("/metrics")
    assert status == 200
    samples = metric_samples(body.decode())
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "kvpilot:kv_cache_token_usage_perc"):
        assert name in samples, name
        assert all(s.labels.get("model_name") == NAME for s in samples[name]), name
    assert samples["vllm:generation_tokens_total"][0].value >= 4
    assert samples["vllm:prompt_tokens_total"][0].value > 0
    assert samples["vllm:e2e_request_latency_seconds_count"][0].value >= 1
    assert samples["vllm:time_to_first_token_seconds_count"][0].value >= 1
    assert samples["vllm:inter_token_latency_seconds_count"][0].value >= 3
    assert samples["vllm:num_requests_running"][0].value == 0
    assert samples["vllm:kv_cache_usage_perc"][0].value == 0


def test_one_structured_log_line_per_request(daemon, client):
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=3, extra_body={"ignore_eos": True})
    recs = [rec for rec in daemon.log_records() if rec.get("event") == "request" and rec.get("request_id") == r.id]
    assert len(recs) == 1
    rec = recs[0]
    assert rec["status"] == 200 and rec["path"] == "/v1/completions"
    assert rec["prompt_tokens"] == r.usage.prompt_tokens and rec["completion_tokens"] == 3
    assert rec["latency_s"] > 0 and rec["ttft_s"] <= rec["latency_s"]
