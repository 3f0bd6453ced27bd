"""The shared admission rules (engine/input_processor.py): prompt -> token ids, vocabulary, max_tokens fitting."""

from __future__ import annotations

import pytest

from kvpilot.daemon.engine.input_processor import (
    ContextLengthExceeded,
    EmptyPrompt,
    InputError,
    InputLimits,
    InputProcessor,
    TokenOutOfVocab,
)
from kvpilot.daemon.engine.sampling_params import SamplingParams


class WordTokenizer:
    """One token per word, plus a BOS when asked for special tokens."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [len(w) for w in text.split()]
        return [0, *ids] if add_special_tokens else ids


def processor(max_model_len: int = 32, vocab_size: int = 100, kv: int | None = None) -> InputProcessor:
    return InputProcessor(WordTokenizer(), InputLimits(max_model_len, vocab_size, kv))


def test_prompt_shapes_become_token_ids():
    p = processor()
    assert p.process_prompt("ab cde").token_ids == [0, 2, 3]
    assert p.process_prompt("ab cde", add_special_tokens=False).token_ids == [2, 3]
    got = p.process_prompt({"prompt_token_ids": [5, 6]})
    assert (got.text, got.token_ids) == (None, [5, 6])
    assert p.process_prompt({"prompt": "x"}).text == "x"


@pytest.mark.parametrize("prompt,error,param", [
    ("", EmptyPrompt, "prompt"), ([], EmptyPrompt, "prompt"), ([1, 100], TokenOutOfVocab, "prompt"),
    ([1, -1], TokenOutOfVocab, "prompt"), ([True], TokenOutOfVocab, "prompt"),
    ({"prompt_token_ids": [-3]}, TokenOutOfVocab, "prompt_token_ids"), ({}, InputError, "prompt"), (3.5, InputError, "prompt"),
])
def test_bad_prompts_name_the_field(prompt, error, param):
    with pytest.raises(error) as ei:
        processor().process_prompt(prompt)
    assert isinstance(ei.value, ValueError) and ei.value.param == param


def test_stop_token_ids_must_be_in_the_vocabulary():
    processor().check_params(SamplingParams(stop_token_ids=[99]))
    with pytest.raises(TokenOutOfVocab) as ei:
        processor().check_params(SamplingParams(stop_token_ids=[100]))
    assert ei.value.param == "stop_token_ids"


def test_fit_fills_or_shrinks_max_tokens_to_the_room_left():
    p = processor(max_model_len=32)
    assert p.fit(10, SamplingParams(max_tokens=None)).max_tokens == 22
    assert p.fit(10, SamplingParams(max_tokens=5)).max_tokens == 5
    # a default the client did not send shrinks to fit instead of failing
    assert p.fit(30, SamplingParams(max_tokens=16), max_tokens_explicit=False).max_tokens == 2
    assert p.fit(30, SamplingParams(max_tokens=16, min_tokens=8), max_tokens_explicit=False).min_tokens == 2
    params = SamplingParams(max_tokens=5)
    assert p.fit(10, params) is params


def test_fit_refuses_what_cannot_fit():
    p = processor(max_model_len=32)
    with pytest.raises(ContextLengthExceeded, match="too long") as ei:
        p.fit(32, SamplingParams(max_tokens=1), param="messages")
    assert ei.value.param == "messages" and ei.value.code == "context_length_exceeded"
    with pytest.raises(ContextLengthExceeded, match="maximum context length") as ei:
        p.fit(10, SamplingParams(max_tokens=23))
    assert ei.value.param == "max_tokens"
    with pytest.raises(EmptyPrompt):
        p.fit(0, SamplingParams())


def test_fit_respects_a_smaller_kv_cache():
    p = processor(max_model_len=32, kv=20)
    assert p.fit(10, SamplingParams(max_tokens=None)).max_tokens == 10
    with pytest.raises(ContextLengthExceeded, match="KV cache") as ei:
        p.fit(10, SamplingParams(max_tokens=15))
    assert ei.value.param == "max_tokens"
    with pytest.raises(ContextLengthExceeded, match="KV cache"):
        p.fit(25, SamplingParams(max_tokens=None))
