"""Per-request sampling parameters, with vLLM's field names."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .structured.spec import StructuredOutputSpec


class RequestOutputKind(IntEnum):
    """Which outputs ``LLMEngine.step`` returns for a request (vLLM's names and values)."""

    CUMULATIVE = 0  # every step that touched it, with the text and tokens so far (servers stream these)
    FINAL_ONLY = 2  # only the finished output: no per-step output, and its text is decoded once at the end


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # top-k logprobs per generated token
    length_penalty: float = 1.0  # beam search only
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> additive bias in [-100, 100] (OpenAI)
    prompt_logprobs: int | None = None  # top-k logprobs per prompt token (vLLM extra); echo uses it
    # A grammar the output must match: a StructuredOutputSpec, or vLLM's dict form
    # ({"json": schema} | {"regex": ...} | {"choice": [...]} | {"grammar": ...} | {"json_object": True}).
    structured_outputs: StructuredOutputSpec | dict[str, Any] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # LLM.generate asks for FINAL_ONLY
    stop_list: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop_list = [self.stop]
        elif self.stop is None:
            self.stop_list = []
        else:
            self.stop_list = list(self.stop)
        if any(not isinstance(s, str) or not s for s in self.stop_list):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        for name in ("n", "top_k", "min_tokens"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of must be >= n, got best_of={self.best_of}, n={self.n}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and (
            isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens, got {self.min_tokens} > {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        if not _is_int(self.output_kind) or self.output_kind not in set(RequestOutputKind):
            kinds = ", ".join(f"{k.name} ({k.value})" for k in RequestOutputKind)
            raise ValueError(f"output_kind must be one of {kinds}, got {self.output_kind!r}")
        self.output_kind = RequestOutputKind(self.output_kind)
        self._validate_logit_bias()
        self._validate_structured_outputs()
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= 20):
            raise ValueError(f"prompt_logprobs must be an integer in [0, 20], got {self.prompt_logprobs!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.use_beam_search:
            if self.temperature != 0.0 and self.temperature != 1.0:
                raise ValueError("temperature is not used with beam search; leave it at 0 or 1")
            if self.n < 2 and (self.best_of or 1) < 2:
                raise ValueError("beam search needs n (beam width) >= 2")

    def _validate_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
        for tid, bias in self.logit_bias.items():
            if not _is_int(tid) or tid < 0:
                raise ValueError(f"logit_bias: keys must be token ids (integers >= 0), got {tid!r}")
            if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias: values must be numbers in [-100, 100], got {bias!r} for token {tid}")

    def _validate_structured_outputs(self) -> None:
        so = self.structured_outputs
        if so is None:
            return
        # imported here: xgrammar loads only for constrained requests
        from .structured import StructuredOutputSpec, spec_from_request

        if isinstance(so, dict):
            self.structured_outputs = spec_from_request({"structured_outputs": so})
        elif not isinstance(so, StructuredOutputSpec):
            raise ValueError(f"structured_outputs must be a StructuredOutputSpec or a dict, got {type(so).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 and not self.use_beam_search

    @property
    def num_sequences(self) -> int:
        """How many sequences run for this request (best_of candidates when set)."""
        return max(self.n, self.best_of or 0)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class BeamSearchParams:
    """Beam search options, as in vLLM's LLM.beam_search."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
