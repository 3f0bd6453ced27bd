"""Structured outputs: constraints (spec), compilation (compiler), per-sequence state (matcher) and
batched masking of logits (bitmask), on xgrammar."""

from .bitmask import BatchMasker, apply_token_bitmask
from .compiler import GrammarCompiler, shared_compiler, tokenizer_info
from .matcher import SequenceMatcher
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
