"""Where the router encodes prompts: inline for short texts, on worker threads for long ones, and the fast
path of a Hugging Face tokenizer, which must give the tokenizer's own ids."""

from __future__ import annotations

import random
import threading

import pytest

from kvpilot.router.prompt import ByteTokenizer, PromptHasher, fast_encoder, load_tokenizer
from kvpilot.router.tokenize_pool import TokenizePool
from support.router_fakes import SlowTokenizer

CHAT = "/v1/chat/completions"


def body(text: str) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": text}]}


async def test_short_prompts_inline_long_ones_on_a_worker_thread():
    tok = SlowTokenizer(delay=0.0, slow_chars=2000)
    pool = TokenizePool(PromptHasher(tok), threads=2, inline_chars=2000)
    try:
        short, long = await pool.token_ids(CHAT, body("hi")), await pool.token_ids(CHAT, body("x" * 3000))
        assert short.where == "inline" and tok.inline_threads == [threading.current_thread().name]
        assert long.where == "pool" and tok.slow_threads[0].startswith("kvpilot-tokenize")
        # the same ids either way
        assert long.ids == PromptHasher(ByteTokenizer()).token_ids(CHAT, body("x" * 3000))
        ids = await pool.token_ids("/v1/completions", {"prompt": [5, 6, 7]})
        assert (ids.ids, ids.where) == ([5, 6, 7], "none")
        assert (await pool.token_ids(CHAT, {"messages": "nope"})).ids is None
    finally:
        pool.close()


async def test_a_tokenizer_that_holds_the_gil_is_never_offloaded():
    # ByteTokenizer is Python: a thread would not free the event loop, only add the hand-off
    pool = TokenizePool(PromptHasher(ByteTokenizer()), threads=2, inline_chars=10)
    assert not pool.offloads
    assert (await pool.token_ids(CHAT, body("x" * 5000))).where == "inline"
    assert not TokenizePool(PromptHasher(SlowTokenizer(0.0, 1)), threads=0).offloads


def test_bad_pool_settings_are_refused():
    with pytest.raises(ValueError):
        TokenizePool(PromptHasher(ByteTokenizer()), threads=-1)


class _Encoding:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids


class _OffByOneBackend:
    """A backend whose batch encode disagrees with its tokenizer: the fast path must not be used."""

    def encode_batch_fast(self, texts: list[str], add_special_tokens: bool) -> list[_Encoding]:
        return [_Encoding([b + 1 for b in ByteTokenizer().encode(t, add_special_tokens)]) for t in texts]


class _DisagreeingTokenizer(ByteTokenizer):
    backend_tokenizer = _OffByOneBackend()


def test_a_fast_path_that_disagrees_is_not_used():
    assert fast_encoder(_DisagreeingTokenizer()) is None
    assert fast_encoder(ByteTokenizer()) is None
    hasher = PromptHasher(_DisagreeingTokenizer())
    assert not hasher.fast and hasher.encode("ab", False) == [97, 98]


@pytest.mark.slow  # loads transformers and the builtin model's tokenizer
def test_the_fast_path_gives_the_tokenizers_own_ids():
    tok = load_tokenizer("builtin://smollm2-135m")
    hasher = PromptHasher(tok)
    assert hasher.fast and hasher.releases_gil
    rng = random.Random(3)
    texts = [tok.decode([rng.randrange(len(tok)) for _ in range(rng.randint(1, 700))]) for _ in range(100)]
    for text in texts:
        for special in (False, True):
            assert hasher.encode(text, special) == list(tok.encode(text, add_special_tokens=special))
    msgs = [{"role": "system", "content": texts[0]}, {"role": "user", "content": "hi <|im_end|> there"}]
    want = tok.encode(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)
    assert hasher.token_ids(CHAT, {"messages": msgs}) == list(want)
