"""serving.py's generation routes on a real `kvpilot serve` subprocess, via the official openai client and aiohttp.

One daemon (with an API key) serves the whole module; the offline `LLM` runs in this process as the
reference for greedy outputs and token counts.
"""

from __future__ import annotations

import json

import aiohttp
import openai
import pytest

from kvpilot.daemon.engine.sampling_params import SamplingParams
from support.api_daemon import ALIAS, KEY, NAME, PROMPTS, api_daemon

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def daemon():
    with api_daemon() as d:
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
