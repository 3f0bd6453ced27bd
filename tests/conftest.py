"""Fixtures that several test files share."""

from __future__ import annotations

import pytest

from kvpilot.daemon.engine import LLM


@pytest.fixture(scope="module")
def llm() -> LLM:
    """The real small model, once a module (loading it is the slow part); a module that wants other
    settings defines its own `llm`, which wins over this one."""
    return LLM(model="builtin://smollm2-135m", num_kv_blocks=256)
