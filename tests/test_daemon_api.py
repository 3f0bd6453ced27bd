"""The OpenAI API of a real `kvpilot serve` subprocess, spoken to by the official openai client and aiohttp.

One daemon (with an API key) serves the whole module; the offline `LLM` runs in this process as the
reference for greedy outputs and token counts.
"""

from __future__ import annotations

import json

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.daemon.engine.sampling_params import SamplingParams
from kvpilot.daemon.testing import DaemonProcess

KEY = "test-key-123"
NAME = "smollm2"
ALIAS = "smol-alias"
KV = "128MiB"
# One intra-op thread: with two OpenMP threads on a 2-core box, any other busy process (this test client,
# the reference LLM) stalls every GEMM at its barrier; one thread is steady.
ONE_THREAD = {"KVPILOT_NUM_THREADS": "1"}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def daemon():
    d = DaemonProcess("--api-key", KEY, "--served-model-name", NAME, ALIAS, "--max-num-seqs", "16",
                      "--kv-cache-memory", KV, "--max-queued-requests", "64", env=ONE_THREAD)
    with d:
        yield d


@pytest.fixture(scope="module")
def llm():
    from kvpilot.daemon.engine import LLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVPILOT_NUM_THREADS", "1")
        return LLM(kv_cache_memory=128 << 20, max_num_seqs=4)


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.url("/v1"), api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tok(llm):
    return llm.get_tokenizer()


def greedy(llm, prompt, max_tokens=8, **kw):
    return llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw), use_tqdm=False)[0]


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


# ---- completions and chat ----------------------------------------------------------------------------


def test_completion_usage_is_exact(client, tok):
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == NAME and r.id.startswith("cmpl-")
    c = r.choices[0]
    assert c.finish_reason == "length" and c.text
    assert r.usage.prompt_tokens == len(tok(PROMPTS[0])["input_ids"])
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_chat_completion(client, llm):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    r = client.chat.completions.create(model=ALIAS, messages=msgs, max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.model == NAME
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content
    assert c.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(llm.apply_chat_template(msgs))
    ref = llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    assert c.message.content == ref.text and r.usage.completion_tokens == len(ref.token_ids)


def test_greedy_equals_offline_llm(client, llm):
    for p in PROMPTS[1:]:
        ref = greedy(llm, p).outputs[0]
        r = client.completions.create(model=NAME, prompt=p, max_tokens=8, temperature=0)
        assert r.choices[0].text == ref.text, p
        assert r.usage.completion_tokens == len(ref.token_ids)
        assert r.choices[0].finish_reason == ref.finish_reason


def test_token_id_prompts_and_echo(client, tok):
    ids = tok(PROMPTS[1])["input_ids"]
    by_text = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=NAME, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text and by_ids.usage.prompt_tokens == len(ids)
    echoed = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPTS[1] + by_text.choices[0].text


def test_batch_prompts_with_n(client):
    r = client.completions.create(model=NAME, prompt=PROMPTS[:2], n=2, max_tokens=4, temperature=0)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in r.choices}
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]  # greedy: both samples agree
    single = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=4, temperature=0)
    assert by_index[2] == single.choices[0].text
    assert r.usage.prompt_tokens == single.usage.prompt_tokens + \
        client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=1).usage.prompt_tokens


def test_n2_sampling_counts_every_token(client):
    r = client.completions.create(model=NAME, prompt=PROMPTS[2], n=2, max_tokens=6, temperature=1.0, seed=7,
                                  logprobs=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)
    chat = client.chat.completions.create(model=NAME, n=2, max_tokens=4, temperature=1.0, seed=3,
                                          messages=[{"role": "user", "content": "Say something."}])
    assert [c.index for c in chat.choices] == [0, 1] and all(c.message.content is not None for c in chat.choices)


def test_completion_logprobs(client, llm):
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    ref = greedy(llm, PROMPTS[0], max_tokens=6, logprobs=3, ignore_eos=True).outputs[0]
    for i, (tok_s, tlp, top) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True)):
        assert 3 <= len(top) <= 4 and tlp <= 0
        assert tlp == pytest.approx(max(top.values()), abs=1e-5)  # greedy: the sampled token is the best
        assert tok_s in top
        assert tlp == pytest.approx(ref.logprobs[i][ref.token_ids[i]].logprob, abs=1e-4)


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Count: 1, 2,"}],
                                       max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 2 and e.logprob <= 0
        assert e.token == e.top_logprobs[0].token and e.bytes == list(e.token.encode())
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
    none = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert none.choices[0].logprobs is None


def test_stop_strings(client, llm):
    full = greedy(llm, PROMPTS[2], max_tokens=16, ignore_eos=True).outputs[0].text
    words = full.split()
    assert len(words) >= 4, full
    stop = " " + words[2]
    cut = full[: full.index(stop)]
    r = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=16, temperature=0, stop=[stop, "@@@"],
                                  extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.text == cut and c.finish_reason == "stop" and c.model_extra["stop_reason"] == stop
    incl = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=16, temperature=0, stop=stop,
                                     extra_body={"include_stop_str_in_output": True, "ignore_eos": True})
    assert incl.choices[0].text == cut + stop


def test_seed_reproducibility(client):
    def sample(seed):
        return client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=8, temperature=1.0,
                                         seed=seed, extra_body={"ignore_eos": True}).choices[0].text

    a, b = sample(1234), sample(1234)
    assert a == b
    assert any(sample(s) != a for s in (1, 2, 3))


def test_vllm_extra_params(client, llm):
    ref = greedy(llm, PROMPTS[0], max_tokens=8, ignore_eos=True).outputs[0]
    stop_id = ref.token_ids[3]
    first = ref.token_ids.index(stop_id)
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                  extra_body={"stop_token_ids": [stop_id], "ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == stop_id
    assert r.usage.completion_tokens == first + 1
    m = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=5, temperature=0,
                                  extra_body={"min_tokens": 5, "ignore_eos": True, "repetition_penalty": 1.3,
                                              "top_k": 5, "min_p": 0.05})
    assert m.usage.completion_tokens == 5 and m.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as ei:  # fcfs server: priority needs --scheduling-policy priority
        client.completions.create(model=NAME, prompt="x", max_tokens=1, extra_body={"priority": 3})
    assert ei.value.body["param"] == "priority"


def test_context_too_long_and_unknown_model(client, tok):
    max_len = client.models.list().data[0].model_extra["max_model_len"]
    long_prompt = " hello" * (max_len + 10)
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=NAME, prompt=long_prompt, max_tokens=4)
    assert ei.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=NAME, prompt="hi", max_tokens=max_len)
    assert ei.value.body["code"] == "context_length_exceeded" and ei.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError) as ei:
        client.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "hi"}])
    assert ei.value.body["code"] == "model_not_found" and ei.value.body["param"] == "model"


# ---- streaming ---------------------------------------------------------------------------------------


def test_streaming_completion_matches_non_streaming(client):
    ref = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=8, temperature=0)
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [ref.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == ref.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_streaming_chat_n2(client):
    msgs = [{"role": "user", "content": "Write a word."}]
    ref = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=6, temperature=0)
    chunks = list(client.chat.completions.create(model=NAME, messages=msgs, max_tokens=6, temperature=0, n=2,
                                                 stream=True, stream_options={"include_usage": True}))
    texts, roles, finish = {0: "", 1: ""}, set(), {}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
            if c.delta.role:
                roles.add((c.index, c.delta.role))
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert roles == {(0, "assistant"), (1, "assistant")}
    assert texts[0] == texts[1] == ref.choices[0].message.content
    assert finish == {0: ref.choices[0].finish_reason, 1: ref.choices[0].finish_reason}
    assert chunks[-1].usage.completion_tokens == 2 * ref.usage.completion_tokens


async def test_sse_wire_format(daemon):
    headers = {"Authorization": f"Bearer {KEY}", "X-Request-Id": "my-trace-42"}
    async with aiohttp.ClientSession() as s, s.post(daemon.url("/v1/completions"), headers=headers,
                      json={"prompt": "Hi", "max_tokens": 4, "stream": True, "logprobs": 1}) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        assert r.headers["X-Request-Id"] == "my-trace-42"
        raw = (await r.read()).decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    bodies = [json.loads(e[6:]) for e in events[:-1]]
    assert all(b["id"] == "my-trace-42" and b["object"] == "text_completion" for b in bodies)
    assert sum(len(b["choices"][0]["logprobs"]["tokens"]) for b in bodies if b["choices"][0]["logprobs"]) == 4


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
    ("POST", "/v1/completions", {"prompt": "x", "echo": True, "logprobs": 2}, J),
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
        async with s.post(daemon.url("/v1/completions"), data=big, headers=headers) as r:
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
