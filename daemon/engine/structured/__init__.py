"""Structured outputs: constraints (spec), compilation (compiler), per-sequence state (matcher) and
batched masking of logits (bitmask), on xgrammar.

The spec and its request parsing import here at once; the rest (xgrammar, and through it torch) on first
use, so that code which only checks specs (the tool-call schemas, the router's chat rendering) stays light.
"""

from importlib import import_module
from typing import Any

from .params import spec_from_request
from .spec import StructuredOutputError, StructuredOutputSpec

__all__ = [
    "BatchMasker",
    "GrammarCompiler",
    "SequenceMatcher",
    "StructuredOutputError",
    "StructuredOutputSpec",
    "apply_token_bitmask",
    "shared_compiler",
    "spec_from_request",
    "tokenizer_info",
]

_LAZY = {
    "BatchMasker": ".bitmask",
    "apply_token_bitmask": ".bitmask",
    "GrammarCompiler": ".compiler",
    "shared_compiler": ".compiler",
    "tokenizer_info": ".compiler",
    "SequenceMatcher": ".matcher",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(module, __name__), name)
