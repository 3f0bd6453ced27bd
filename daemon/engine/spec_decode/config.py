"""`speculative_config`: vLLM's dict, checked once into a SpeculativeConfig.

Keys (vLLM's names): ``method`` ("ngram" or "draft_model"), ``num_speculative_tokens`` (k),
``prompt_lookup_min`` / ``prompt_lookup_max`` (ngram), ``model`` (draft_model: ``self:N`` for the target's
first N layers, or a model URI) and ``disable_by_batch_size``. Everything that can be judged without the
model is judged here; the draft's layer count and tokenizer are checked when the engine loads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
         "disable_by_batch_size")
# ngram windows when neither bound is given (bench/speculative.py on copy-heavy prompts): a 3-token match
# is rarely a coincidence, where 2-token ones ("of the") proposed drafts that failed (1.64x against 1.39x
# on its quoting prompt)
DEFAULT_LOOKUP_MIN, DEFAULT_LOOKUP_MAX = 3, 5
# Above this many running sequences a step is compute-bound and verifying drafts costs more than it
# saves (bench/results/speculative.json); vLLM leaves it unset, which means never.
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
SELF_DRAFT_PREFIX = "self:"


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_LOOKUP_MIN
    prompt_lookup_max: int = DEFAULT_LOOKUP_MAX
    model: str | None = None
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    @property
    def self_draft_layers(self) -> int | None:
        """N for ``model: "self:N"`` (a layer-skip draft of the target), else None."""
        if self.model is None or not self.model.startswith(SELF_DRAFT_PREFIX):
            return None
        return int(self.model[len(SELF_DRAFT_PREFIX):])


def _field(name: str) -> str:
    return f"speculative_config.{name}"


def _int(raw: dict[str, Any], name: str, default: int | None, minimum: int) -> int | None:
    value = raw.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{_field(name)} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{_field(name)} must be >= {minimum}, got {value}")
    return value


def _method(raw: dict[str, Any]) -> str:
    method = raw.get("method")
    if method is None:  # vLLM infers it: a draft model when one is named
        method = "draft_model" if raw.get("model") else None
    if method is None:
        raise ValueError(f"{_field('method')} is required: one of {', '.join(METHODS)}")
    if method == "eagle" or method == "eagle3":
        raise ValueError(f"{_field('method')}: {method} is not supported (EAGLE heads are out of scope); "
                         f"use one of {', '.join(METHODS)}")
    if method not in METHODS:
        raise ValueError(f"{_field('method')} must be one of {', '.join(METHODS)}, got {method!r}")
    return method


def _draft_model(raw: dict[str, Any], method: str) -> str | None:
    model = raw.get("model")
    if method == "ngram":
        if model is not None:
            raise ValueError(f"{_field('model')} is for method draft_model; ngram drafts from the context")
        return None
    if not isinstance(model, str) or not model:
        raise ValueError(f"{_field('model')} is required for draft_model: 'self:N' (the target's first N "
                         "layers) or a model URI with the target's tokenizer")
    if model.startswith(SELF_DRAFT_PREFIX):
        layers = model[len(SELF_DRAFT_PREFIX):]
        if not layers.isdigit() or int(layers) < 1:
            raise ValueError(f"{_field('model')}: 'self:N' needs a layer count N >= 1, got {model!r}")
    return model


def speculative_config_json(text: str) -> dict[str, Any]:
    """The dict of a ``--speculative-config`` JSON object (vLLM takes the flag as JSON too)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"speculative_config is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {text!r}")
    return value


def parse_speculative_config(raw: dict[str, Any] | str | None) -> SpeculativeConfig | None:
    """The checked config for a ``speculative_config`` dict (or its JSON); None turns speculation off.
    A bad value is a ValueError naming the field."""
    if raw is None:
        return None
    if isinstance(raw, str):
        raw = speculative_config_json(raw)
    if not isinstance(raw, dict):
        raise ValueError(f"speculative_config must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(_KEYS))
    if unknown:
        raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(_KEYS)}")
    method = _method(raw)
    k = _int(raw, "num_speculative_tokens", None, 1)
    if k is None:
        raise ValueError(f"{_field('num_speculative_tokens')} is required (>= 1)")
    lo = _int(raw, "prompt_lookup_min", None, 1)
    hi = _int(raw, "prompt_lookup_max", None, 1)
    if method == "draft_model" and (lo is not None or hi is not None):
        raise ValueError(f"{_field('prompt_lookup_min')}/prompt_lookup_max are for method ngram")
    if lo is None and hi is None:
        lo, hi = DEFAULT_LOOKUP_MIN, DEFAULT_LOOKUP_MAX
    elif lo is None:  # one bound given: the other follows it, as in vLLM
        lo = min(DEFAULT_LOOKUP_MIN, hi)  # type: ignore[type-var]
    elif hi is None:
        hi = max(DEFAULT_LOOKUP_MAX, lo)
    assert lo is not None and hi is not None
    if lo > hi:
        raise ValueError(f"{_field('prompt_lookup_min')} ({lo}) must be <= prompt_lookup_max ({hi})")
    batch = _int(raw, "disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE, 1)
    assert batch is not None
    return SpeculativeConfig(method=method, num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi,
                             model=_draft_model(raw, method), disable_by_batch_size=batch)
