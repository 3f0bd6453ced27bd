"""Checks on an engine that several test files share."""

from __future__ import annotations

from kvpilot.daemon.engine import LLM


def all_free(llm: LLM) -> bool:
    """Nothing left running or waiting, and every KV block back in the pool: no request leaked."""
    stats = llm.engine.get_stats()
    return stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0 and stats.num_waiting == 0
