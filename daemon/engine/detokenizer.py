"""Incremental detokenization and stop strings.

`IncrementalDetokenizer` turns one token at a time into text deltas without re-decoding the whole
sequence: it decodes a small window of recent tokens twice (the window without and with the new
tokens) and emits the difference, as vLLM does with its prefix and read offsets. The window starts a
few tokens back so that tokenizers whose decode depends on context (SentencePiece's leading
space) get it right. While the window's text ends in U+FFFD the new token is only part of a UTF-8
character (byte-level BPE or byte-fallback tokens), so the text is held back until the character
is complete: a stream never splits a multi-byte character.

`StopChecker` finds stop strings in the tail of the cumulative text and, for streaming, holds back
any trailing text that could still turn into a stop string, so that no streamed delta ever holds a
piece of one. `TextStream` puts the two together for one output sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .sampling_params import RequestOutputKind, SamplingParams

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as left context for the first output tokens (vLLM uses 5 as well).
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Decodes one output sequence incrementally; `append` costs two decodes of a few tokens."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # a fast (Rust-backed) tokenizer is called directly: transformers' decode wrapper adds nothing with
        # cleanup off and cost 2.5 us a call against 0.8 (SmolLM2's, a few tokens), two calls per token
        self._backend_decode = getattr(getattr(tokenizer, "backend_tokenizer", None), "decode", None)
        # _ids: a few prompt tokens (context only) followed by every output token.
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._num_context = len(self._ids)
        self._prefix_offset = 0  # window start: context for the decode
        self._read_offset = len(self._ids)  # tokens before this are already in the text
        self._prefix_text: str | None = None  # decode of _ids[prefix:read], computed once per window
        self.text = ""

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids[self._num_context :]

    def _decode(self, ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def append(self, token_id: int) -> str:
        """Add one token; return the new text ("" while a character is incomplete)."""
        self._ids.append(token_id)
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        prefix_text = self._prefix_text
        new_text = self._decode(self._ids[self._prefix_offset :])
        if new_text.endswith(REPLACEMENT_CHAR):
            return ""  # part of a multi-byte character: wait for the rest
        if len(new_text) <= len(prefix_text):
            # Nothing visible (a skipped special token): these tokens are read, the window's
            # start stays so that the next token still has its left context.
            self._read_offset = len(self._ids)
            self._prefix_text = new_text
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = None
        self.text += delta
        return delta

    def append_deferred(self, token_id: int) -> None:
        """Add one token without decoding it: ``flush`` decodes all such tokens in one call (the same text as
        appending them one by one, since each window is decoded with its left context)."""
        self._ids.append(token_id)

    def flush(self) -> str:
        """At the end of generation: release text held back for an incomplete character, decoded
        with U+FFFD as a full decode would show it. Afterwards `.text` equals a full decode."""
        if self._read_offset == len(self._ids):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        delta = new_text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = None
        self.text += delta
        return delta


@dataclass(frozen=True)
class StopMatch:
    stop: str  # the stop string that matched
    text: str  # the text to return: cut before the stop string, or after it when it is included


def find_stop_string(
    text: str, new_len: int, stop: Sequence[str], include_stop_str_in_output: bool = False
) -> StopMatch | None:
    """Look for a stop string that ends inside the last `new_len` characters of `text` (matches that
    end earlier were found on earlier calls). The earliest match wins; among stop strings matching
    at the same place, the first listed."""
    if not stop or new_len <= 0:
        return None
    best: tuple[int, str] | None = None
    for s in stop:
        start = max(0, len(text) - new_len - len(s) + 1)
        idx = text.find(s, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, s)
    if best is None:
        return None
    idx, s = best
    return StopMatch(stop=s, text=text[: idx + len(s)] if include_stop_str_in_output else text[:idx])


def partial_stop_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string: text that
    the next tokens could still turn into a stop string."""
    best = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class StopChecker:
    """Stop strings for one sequence: `check` after each delta, `safe_text` for what may be streamed."""

    def __init__(self, stop: Sequence[str] | str | None, include_stop_str_in_output: bool = False) -> None:
        self.stop = [stop] if isinstance(stop, str) else list(stop or ())
        self.include_stop_str_in_output = include_stop_str_in_output

    def check(self, text: str, delta: str) -> StopMatch | None:
        """`text` is the cumulative text, ending with the new `delta`."""
        return find_stop_string(text, len(delta), self.stop, self.include_stop_str_in_output)

    def safe_text(self, text: str) -> str:
        """The part of an unfinished text that can be streamed now. A partial stop string at the end
        is held back, unless stop strings are included in the output anyway."""
        if self.include_stop_str_in_output or not self.stop:
            return text
        hold = partial_stop_len(text, self.stop)
        return text[: len(text) - hold]


class TextStream:
    """The text of one output sequence: incremental detokenization plus stop strings.

    `append(token_id)` returns the delta that may be streamed now. `text` is the whole text so far
    (cut at the stop string once one matched); `emitted_text` is what has been streamed. Call
    `finish()` when the sequence ends for another reason (eos, stop token, length, abort): it
    releases what was held back and returns it.

    A request that wants only its final output (``RequestOutputKind.FINAL_ONLY``) and has no stop string
    to look for is decoded once, at ``finish()``: nothing reads its text before, and one decode of the
    whole output costs less than two small decodes per token.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self.checker = StopChecker(params.stop_list, params.include_stop_str_in_output)
        self.text = ""
        self.stop_reason: str | None = None  # the stop string that ended the sequence
        self._emitted = 0
        self._finished = False
        self._deferred = params.output_kind == RequestOutputKind.FINAL_ONLY and not params.stop_list

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    @property
    def emitted_text(self) -> str:
        return self.text[: self._emitted]

    def append(self, token_id: int) -> str:
        if self._finished:
            return ""
        if self._deferred:
            self.detokenizer.append_deferred(token_id)
            return ""
        return self._add(self.detokenizer.append(token_id), final=False)

    def finish(self) -> str:
        if self._finished:
            return ""
        return self._add(self.detokenizer.flush(), final=True)

    def _add(self, delta: str, final: bool) -> str:
        if delta:
            self.text += delta
            match = self.checker.check(self.text, delta)
            if match is not None:
                self.text = match.text
                self.stop_reason = match.stop
                final = True
        if final:
            self._finished = True
            safe = len(self.text)
        else:
            safe = len(self.checker.safe_text(self.text))
        if safe <= self._emitted:
            return ""
        out = self.text[self._emitted : safe]
        self._emitted = safe
        return out
