"""bench/gpu_engine.py's CPU side: a GPU session compares its greedy tokens with gpu_reference_tokens.json,
so that file must hold what the CPU engine produces now."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import gpu_engine  # noqa: E402


def test_reference_tokens_are_the_cpu_engines_own(llm):
    ref = json.loads(gpu_engine.REFERENCE.read_text())
    assert ref["device"] == "cpu" and ref["dtype"] == "float32" and len(ref["prompts"]) == 8
    got = gpu_engine.greedy(llm, ref["prompts"], ref["max_tokens"])
    # a change to the model's numerics shows here first: regenerate with --make-reference
    assert got == ref["tokens"]


def test_common_prefix():
    assert gpu_engine.common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert gpu_engine.common_prefix([], [1]) == 0
    assert gpu_engine.common_prefix([5, 6], [5, 6]) == 2
