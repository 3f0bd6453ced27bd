"""bench/step_profile.py: the profiler runs the real engine's forward pass and leaves it as it found it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kvpilot.daemon.engine import LLM
from kvpilot.daemon.engine.models import decoder

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from step_profile import RUN_CATEGORIES, decode_entries, prefill_entries, profile_run, profile_shape  # noqa: E402


@pytest.fixture(scope="module")
def llm() -> LLM:
    """The float model the profiler times (its GEMM kinds are the float layers' weights)."""
    return LLM(model="builtin://smollm2-135m", dtype="float32", num_kv_blocks=256, quantization="none")


def test_profiles_decode_and_prefill_and_restores_the_model(llm: LLM) -> None:
    runner = llm.engine.runner
    plain_linear = decoder.linear
    entries = decode_entries(batch=3, context=20, block_size=runner.block_size)
    before = runner.execute(entries).clone()

    decode = profile_shape(llm, entries, repeat=1, sched_ms=0.0)
    # the same step after profiling: same logits (the profile rewrote the same cache slots with the same rows)
    torch.testing.assert_close(runner.execute(entries), before)
    prefill = profile_shape(llm, prefill_entries(num_seqs=2, length=40, block_size=runner.block_size),
                            repeat=1, sched_ms=0.0)

    for shape, tokens in ((decode, 3), (prefill, 80)):
        assert shape["tokens"] == tokens
        assert shape["step_ms"] > 0
        # every GEMM family was seen by the timers (a wrapper that dropped an argument raises instead)
        for kind in ("gemm_qkv", "gemm_o", "gemm_gate_up", "gemm_down", "lm_head"):
            assert shape["ms"][kind] > 0, kind
    assert decode["ms"]["decode_attention"] > 0
    assert prefill["ms"]["prefill_attention"] > 0
    assert decoder.linear is plain_linear
    assert "forward" not in vars(runner.model)


def test_profiles_a_whole_run_and_restores_the_runner(llm: LLM) -> None:
    runner = llm.engine.runner
    plain_linear = decoder.linear
    work = [([100 + i for i in range(40)], 3), ([7 * i + 11 for i in range(25)], 2)]
    run = profile_run(llm, work)

    assert run["requests"] == 2
    assert run["output_tokens"] == 5  # EOS ignored: every request runs to its max_tokens
    assert run["plain_s"] > 0 and run["profiled_s"] > 0
    for kind in ("gemm_qkv", "gemm_o", "gemm_gate_up", "gemm_down", "lm_head", "prefill_attention",
                 "decode_attention", "engine"):
        assert run["seconds"][kind] > 0, kind
    # the categories partition the timed run: nothing counted twice, nothing left out
    assert abs(sum(run["seconds"][k] for k in RUN_CATEGORIES) - run["profiled_s"]) <= 0.01 * run["profiled_s"]
    assert set(run["gemm_gflops"]) == {"gemm_qkv", "gemm_o", "gemm_gate_up", "gemm_down", "lm_head"}
    assert "execute" not in vars(runner) and "forward" not in vars(runner.model)
    assert decoder.linear is plain_linear
