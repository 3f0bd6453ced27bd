"""The admission rules for one prompt, shared by the offline API (LLMEngine) and the HTTP server.

Prompt -> token ids, the vocabulary check, and fitting max_tokens into max_model_len (and, when the
caller knows it, the KV cache). Every refusal is an InputError, a ValueError that names the request
field it is about, so the server can answer a 400 with `param` and the offline API keeps raising
plain ValueErrors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from .sampling_params import SamplingParams


class InputError(ValueError):
    """Bad input. `param` is the request field at fault; `code` an OpenAI-style error code."""

    code = "invalid_value"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EmptyPrompt(InputError):
    pass


class TokenOutOfVocab(InputError):
    pass


class ContextLengthExceeded(InputError):
    code = "context_length_exceeded"


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass(frozen=True)
class InputLimits:
    max_model_len: int
    vocab_size: int
    kv_capacity_tokens: int | None = None  # None: the KV cache is not a tighter bound than max_model_len


@dataclass(frozen=True)
class ProcessedPrompt:
    text: str | None  # None when the caller sent token ids
    token_ids: list[int]


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, limits: InputLimits) -> None:
        self.tokenizer = tokenizer
        self.limits = limits

    def process_prompt(self, prompt: str | Sequence[int] | dict[str, Any], *, param: str = "prompt",
                       add_special_tokens: bool = True) -> ProcessedPrompt:
        """A text prompt, a token id list or a {'prompt'|'prompt_token_ids': ...} dict -> token ids."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt, param = list(prompt["prompt_token_ids"]), "prompt_token_ids"
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InputError("prompt dict needs 'prompt' or 'prompt_token_ids'", param)
        if isinstance(prompt, str):
            if not prompt:
                raise EmptyPrompt(f"{param} must not be empty", param)
            ids = list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
            return ProcessedPrompt(prompt, ids)
        if isinstance(prompt, list | tuple):
            if not prompt:
                raise EmptyPrompt(f"{param} must not be empty", param)
            self.check_token_ids(prompt, param)
            return ProcessedPrompt(None, list(prompt))
        raise InputError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}", param)

    def check_token_ids(self, ids: Sequence[Any], param: str) -> None:
        vocab = self.limits.vocab_size
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise TokenOutOfVocab(f"{param}: {t!r} is not a token id in [0, {vocab}) (the vocabulary)", param)

    def check_params(self, params: SamplingParams) -> None:
        """Sampling fields that depend on the model: stop_token_ids and logit_bias ids must be in the vocabulary."""
        self.check_token_ids(params.stop_token_ids or [], "stop_token_ids")
        self.check_token_ids(list(params.logit_bias or ()), "logit_bias")

    def fit(self, num_prompt_tokens: int, params: SamplingParams, *, param: str = "prompt",
            max_tokens_explicit: bool = True) -> SamplingParams:
        """Params whose max_tokens fits the context; raises when the request cannot fit.

        max_tokens None, or a default the client did not send (max_tokens_explicit False), is shrunk
        to the room left; an explicit max_tokens that does not fit is refused.
        """
        plen, limit = num_prompt_tokens, self.limits.max_model_len
        cap = self.limits.kv_capacity_tokens or limit
        if plen == 0:
            raise EmptyPrompt("the prompt is empty after tokenization", param)
        if plen >= limit:
            raise ContextLengthExceeded(
                f"The prompt is too long: this model's maximum context length is {limit} tokens, but the "
                f"prompt has {plen} tokens, leaving no room for a completion. Please shorten the prompt.", param)
        max_tokens = params.max_tokens
        if not max_tokens_explicit or max_tokens is None:
            room = min(limit, cap) - plen
            if room < 1:
                raise ContextLengthExceeded(
                    f"the prompt ({plen} tokens) does not fit in this server's KV cache ({cap} tokens)", param)
            max_tokens = room if max_tokens is None else min(max_tokens, room)
        if plen + max_tokens > limit:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{plen + max_tokens} tokens ({plen} in the prompt, {max_tokens} for the completion). "
                f"Please reduce the prompt or max_tokens.", "max_tokens")
        if plen + max_tokens > cap:
            raise ContextLengthExceeded(
                f"this request needs {plen + max_tokens} KV cache slots but the server holds only {cap}; "
                f"reduce max_tokens or the prompt", "max_tokens")
        if max_tokens == params.max_tokens:
            return params
        return replace(params, max_tokens=max_tokens, min_tokens=min(params.min_tokens, max_tokens))
