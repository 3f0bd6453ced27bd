"""The request surface vLLM users rely on, on a real daemon via the official openai client: logit_bias,
echo (with prompt logprobs), prompt_logprobs, continuous usage stats, max_completion_tokens, /tokenize,
/detokenize and the gateway metrics.
"""

from __future__ import annotations

import urllib.request

import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.daemon.engine.loader import resolve_dtype
from support.daemon_process import DaemonProcess

KEY = "surface-key"
NAME = "smollm2"
PROMPT = "The capital of France is"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def daemon():
    d = DaemonProcess("--api-key", KEY, "--served-model-name", NAME, "--max-num-seqs", "8",
                      "--kv-cache-memory", "64MiB", env={"KVPILOT_NUM_THREADS": "1"})
    with d:
        yield d


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.url("/v1"), api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def root(daemon):
    """The openai client at the server root, for vLLM's /tokenize and /detokenize."""
    return openai.OpenAI(base_url=daemon.base_url, api_key=KEY, max_retries=0, timeout=60)


def tokenize(root, **body) -> dict:
    return root.post("/tokenize", body={"model": NAME, **body}, cast_to=object)


def detokenize(root, tokens: list[int]) -> str:
    return root.post("/detokenize", body={"model": NAME, "tokens": tokens}, cast_to=object)["prompt"]


def greedy(client, **kw):
    return client.completions.create(model=NAME, prompt=PROMPT, **{"temperature": 0.0, **kw})


def first_token_id(root, text: str) -> int:
    """The id of the first generated token: the prompt's tokens are a prefix of prompt + text's."""
    p = tokenize(root, prompt=PROMPT)["tokens"]
    full = tokenize(root, prompt=PROMPT + text)["tokens"]
    assert full[: len(p)] == p, "tokenization of the prompt must be a prefix here"
    return full[len(p)]


# ---- tokenize / detokenize -----------------------------------------------------------------------------


def test_tokenize_detokenize_round_trip(root, client):
    out = tokenize(root, prompt="Hello world, this is kvpilot.")
    assert out["count"] == len(out["tokens"]) > 3 and out["max_model_len"] > 0
    assert detokenize(root, out["tokens"]) == "Hello world, this is kvpilot."
    strs = tokenize(root, prompt="Hello world", return_token_strs=True)["token_strs"]
    assert len(strs) == 2 and strs[0] == "Hello"
    # messages: the count is exactly what a chat completion bills as prompt tokens
    msgs = [{"role": "user", "content": "Say hi."}]
    chat = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=1)
    assert tokenize(root, messages=msgs)["count"] == chat.usage.prompt_tokens
    no_gen = tokenize(root, messages=msgs, add_generation_prompt=False)["count"]
    assert no_gen < chat.usage.prompt_tokens


def test_tokenize_with_tools_counts_what_a_chat_request_with_them_is_billed(root, client):
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    chat = client.chat.completions.create(model=NAME, messages=msgs, tools=[weather], max_tokens=1,
                                          tool_choice={"type": "function", "function": {"name": "get_weather"}})
    with_tools = tokenize(root, messages=msgs, tools=[weather])["count"]
    assert with_tools == chat.usage.prompt_tokens
    assert with_tools > tokenize(root, messages=msgs)["count"]  # the tools are in the prompt
    with pytest.raises(openai.BadRequestError) as e:
        tokenize(root, messages=msgs, tools=[{"type": "function"}])
    assert e.value.body["param"].startswith("tools")


def test_tokenize_errors_and_auth(daemon, root):
    for body, param in (({"prompt": 5}, "prompt"), ({}, "prompt"), ({"prompt": "x", "model": "nope"}, "model")):
        with pytest.raises(openai.APIStatusError) as e:
            root.post("/tokenize", body=body, cast_to=object)
        assert 400 <= e.value.status_code < 500 and e.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as e:
        root.post("/detokenize", body={"tokens": [10**8]}, cast_to=object)
    assert e.value.body["param"] == "tokens"
    req = urllib.request.Request(daemon.url("/tokenize"), data=b'{"prompt": "x"}',
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 401  # the tokenizer routes need the key like /v1


# ---- logit_bias ------------------------------------------------------------------------------------------


def test_logit_bias_minus_100_removes_the_greedy_token(client, root):
    base = greedy(client, max_tokens=1)
    tid = first_token_id(root, base.choices[0].text)
    banned = greedy(client, max_tokens=1, logit_bias={str(tid): -100})
    assert banned.choices[0].text != base.choices[0].text
    assert first_token_id(root, banned.choices[0].text) != tid


def test_logit_bias_plus_100_forces_a_token(client, root):
    tid = tokenize(root, prompt=" banana", add_special_tokens=False)["tokens"][0]
    word = detokenize(root, [tid])
    out = greedy(client, max_tokens=3, logit_bias={str(tid): 100})
    assert out.choices[0].text == word * 3
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}],
                                          max_completion_tokens=2, temperature=0.0, logit_bias={str(tid): 100})
    assert chat.choices[0].message.content == word * 2 and chat.usage.completion_tokens == 2
    # sampled rows see the bias too: +100 leaves the other tokens no mass
    hot = greedy(client, max_tokens=2, logit_bias={str(tid): 100}, temperature=1.0, seed=3)
    assert hot.choices[0].text == word * 2


def test_logit_bias_bad_values_are_400(client):
    for lb, in (({"x": 1},), ({"5": 100.5},), ({"10000000": 1},)):
        with pytest.raises(openai.BadRequestError) as e:
            greedy(client, max_tokens=1, logit_bias=lb)
        assert e.value.body["param"] == "logit_bias"


# ---- echo and prompt logprobs ---------------------------------------------------------------------------


def test_echo_returns_the_prompt(client):
    plain = greedy(client, max_tokens=3)
    out = greedy(client, max_tokens=3, echo=True)
    assert out.choices[0].text == PROMPT + plain.choices[0].text
    stream = greedy(client, max_tokens=3, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == out.choices[0].text


def test_echo_with_logprobs_scores_the_prompt(client, root):
    prompt_ids = tokenize(root, prompt=PROMPT)["tokens"]
    out = greedy(client, max_tokens=2, echo=True, logprobs=2)
    lp = out.choices[0].logprobs
    n = len(prompt_ids)
    assert len(lp.tokens) == n + 2 and "".join(lp.tokens) == out.choices[0].text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert all(v <= 0.0 for v in lp.token_logprobs[1:])
    assert all(1 <= len(d) <= 3 for d in lp.top_logprobs[1:])  # the top 2 plus the actual token
    assert lp.text_offset[0] == 0 and lp.text_offset[n] == len(PROMPT)
    # streamed: the echoed prompt and its scores lead the first chunk
    chunks = [c.choices[0] for c in greedy(client, max_tokens=2, echo=True, logprobs=2, stream=True) if c.choices]
    assert "".join(c.text for c in chunks) == out.choices[0].text
    streamed = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)
    # the generated part is scored as without echo. The first generated token's row runs through the prefill
    # kernel with echo (every prompt row is kept) and the decode kernel without; in bfloat16 (what "auto" picks
    # on CPUs with bfloat16 dot products) these round differently, the prefill kernel's softmax weights to
    # bfloat16 as torch's SDPA does (1.6e-3 apart on an AVX512-BF16 CPU)
    plain = greedy(client, max_tokens=2, logprobs=2).choices[0].logprobs
    bf16 = resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16
    assert lp.token_logprobs[n:] == pytest.approx(plain.token_logprobs, abs=1e-2 if bf16 else 1e-3)


def test_prompt_logprobs_extra(client, root):
    prompt_ids = tokenize(root, prompt=PROMPT)["tokens"]
    out = greedy(client, max_tokens=1, extra_body={"prompt_logprobs": 1})
    plp = out.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == len(prompt_ids) and plp[0] is None
    for tid, entry in zip(prompt_ids[1:], plp[1:], strict=True):
        assert str(tid) in entry and entry[str(tid)]["logprob"] <= 0.0 and entry[str(tid)]["rank"] >= 1
    # the same prompt again (its prefix cached) scores the same
    again = greedy(client, max_tokens=1, extra_body={"prompt_logprobs": 1}).choices[0].model_extra
    assert [None if e is None else sorted(e) for e in again["prompt_logprobs"]] == \
        [None if e is None else sorted(e) for e in plp]
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens


# ---- streaming usage, max_completion_tokens --------------------------------------------------------------


def test_continuous_usage_stats(client):
    chunks = list(client.completions.create(
        model=NAME, prompt=PROMPT, max_tokens=4, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    usages = [c.usage for c in chunks if c.usage is not None]
    assert len(usages) >= 4
    assert [u.completion_tokens for u in usages] == sorted(u.completion_tokens for u in usages)
    assert usages[-1].completion_tokens == 4


def test_max_completion_tokens_on_chat(client):
    out = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Count to 50"}],
                                         max_completion_tokens=3, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"


# ---- gateway metrics ------------------------------------------------------------------------------------


def test_gateway_metrics(daemon, client):
    client.completions.create(model=NAME, prompt=[PROMPT, "Hello"], max_tokens=2, n=2,
                              extra_body={"ignore_eos": True})
    status, body = daemon.get("/metrics")
    assert status == 200
    fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
    cache = fams["vllm:cache_config_info"].samples[0]
    assert cache.labels["block_size"] == "16" and int(cache.labels["num_gpu_blocks"]) > 0
    lora = fams["vllm:lora_requests_info"].samples[0]
    assert lora.labels == {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    samples = {s.name: s for f in fams.values() for s in f.samples if s.labels.get("le") is None}
    assert samples["vllm:request_prompt_tokens_count"].value >= 2
    assert samples["vllm:request_generation_tokens_sum"].value >= 8
    assert samples["vllm:request_params_n_sum"].value >= 4
    for name in ("vllm:request_prompt_tokens_count", "vllm:request_params_n_count"):
        assert samples[name].labels == {"model_name": NAME}
    n_buckets = [s for s in fams["vllm:request_params_n"].samples if s.name.endswith("_bucket")]
    assert [s.labels["le"] for s in n_buckets] == ["1.0", "2.0", "5.0", "10.0", "20.0", "+Inf"]


def _prefix_hits(daemon) -> float:
    _, body = daemon.get("/metrics")
    return sum(s.value for f in text_string_to_metric_families(body.decode()) for s in f.samples
               if s.name == "vllm:prefix_cache_hits_total")


def test_cache_salt_keeps_tenants_apart(daemon, client):
    prompt = "Tenant report: " + " ".join(f"item{i}" for i in range(60))  # several full KV blocks
    ask = lambda salt: client.completions.create(  # noqa: E731
        model=NAME, prompt=prompt, max_tokens=1, extra_body={"cache_salt": salt})
    ask("tenant-a")
    before = _prefix_hits(daemon)
    ask("tenant-a")  # same tenant: its blocks are reused
    reused = _prefix_hits(daemon) - before
    assert reused >= 16
    before = _prefix_hits(daemon)
    ask("tenant-b")  # another tenant: nothing of tenant-a's cache is visible
    assert _prefix_hits(daemon) - before == 0
    with pytest.raises(openai.BadRequestError) as err:
        ask("")
    assert err.value.body["param"] == "cache_salt"
