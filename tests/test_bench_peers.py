"""bench/peers.py: the matmul-limit arithmetic the closing figures rest on."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from peers import (  # noqa: E402
    fma_peak_gflops,
    make_workload,
    markdown,
    matmul_limit,
    warmup_prompts,
    workload_gflop,
)

TINY = {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 4, "vocab_size": 10}


def test_one_token_prompt_one_output_counts_each_matmul_once() -> None:
    # q/k/v 8x(8+4+4), o 8x8, gate/up 8x32, down 16x8 multiply-adds per layer; 1 visible key; LM head 10x8
    per_layer = 8 * 16 + 8 * 8 + 8 * 32 + 16 * 8
    expected = 2 * 2 * per_layer + 4 * 2 * 4 * 2 * 1 + 2 * 10 * 8
    assert workload_gflop([([5], 1)], TINY) * 1e9 == expected


def test_attention_grows_with_every_earlier_token() -> None:
    # 3 prompt tokens + 2 outputs: 4 tokens through the layers, seeing 1+2+3+4 keys; 2 LM-head rows
    per_layer = 8 * 16 + 8 * 8 + 8 * 32 + 16 * 8
    expected = 4 * 2 * 2 * per_layer + 4 * 2 * 4 * 2 * (1 + 2 + 3 + 4) + 2 * 2 * 10 * 8
    assert workload_gflop([([1, 2, 3], 2)], TINY) * 1e9 == expected


def test_limit_uses_the_better_sgemm_rate_and_the_workload_is_fixed() -> None:
    lim = matmul_limit(gflop=6000.0, seconds=100.0, sgemm_before=100.0, sgemm_after=120.0)
    assert lim["limit_s"] == 50.0 and lim["fraction_of_limit"] == 0.5
    assert make_workload("w96") == make_workload("w96") and len(make_workload("w48")) == 48


def test_the_warm_up_fills_one_budget_with_prompts_the_workload_does_not_have() -> None:
    # every engine runs it before its timed run: one full 2048-token step, the same ids on every call, and no
    # prompt shared with the timed workload (a prefix cache could otherwise serve part of it)
    warm = warmup_prompts()
    assert warm == warmup_prompts() and sum(len(p) for p in warm) == 2048
    assert all(100 <= t < 49152 for p in warm for t in p)
    timed = {tuple(p[:16]) for p, _ in make_workload("w96")}
    assert not timed & {tuple(p[:16]) for p in warm}


def test_the_table_compares_kvpilot_only_with_rows_from_its_own_run() -> None:
    def row(tps: float, run: str | None) -> dict:
        r = {"output_tokens_per_s": tps, "seconds": 1.0, "host_isa": "avx2 fma"}
        return r if run is None else {**r, "run_id": run}

    # same vector extensions throughout: only the run tells the machines apart
    table = markdown({"w96": {"peers": {"kvpilot": row(100.0, "2026-12-04T05:46Z"), "vllm": row(80.0, "2026-12-04T05:46Z"),
                                        "hf": row(50.0, "2026-12-01T10:00Z"), "llamacpp": row(40.0, None)}}})
    rows = {line.split(" | ")[1]: line.split(" | ")[5] for line in table.splitlines() if line.startswith("| w96")}
    assert rows == {"kvpilot": "", "vllm": "1.25x", "hf": "", "llamacpp": ""}


def test_the_fma_peak_bounds_the_run_where_the_sgemm_rate_does_not() -> None:
    lim = matmul_limit(gflop=6000.0, seconds=40.0, sgemm_before=140.0, sgemm_after=145.0, fma_peak=240.0)
    assert lim["fraction_of_limit"] > 1  # a library sgemm is no ceiling
    assert lim["fma_limit_s"] == 25.0 and lim["fraction_of_fma_peak"] == 0.625
    table = markdown({"w96": {"peers": {"kvpilot": {"output_tokens_per_s": 150.0, "seconds": 40.0,
                                                    "host_isa": "avx2 fma", "matmul_limit": lim}}}})
    assert "62% of the FMA peak (240 GFLOP/s: 25.0 s at best)" in table


def test_the_fma_peak_is_measured_on_this_host() -> None:
    one, two = fma_peak_gflops(1), fma_peak_gflops(2)
    if one is None:  # no C compiler with OpenMP here: nothing to measure, and the table says nothing
        assert two is None
        return
    # a core does more than one scalar FMA per ns; two threads at most twice one (loosely: a shared host)
    assert one > 2.0 and one * 0.8 < two < one * 2.5
