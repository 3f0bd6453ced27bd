"""kv_cache_dtype: the setting and its flag, the runner's cache allocation and sizing, and what the engine
generates with a float16 cache under a float32 model (the native CPU kernel's float16 variant)."""

from __future__ import annotations

import logging

import pytest
import torch

from kvpilot.daemon.args import parse_serve_args
from kvpilot.daemon.engine import LLM, SamplingParams
from kvpilot.daemon.engine.config import KV_CACHE_DTYPES, EngineConfig
from kvpilot.daemon.engine.loader import load_model
from kvpilot.daemon.engine.runner import ModelRunner, resolve_kv_cache_dtype
from kvpilot.kernels import cpu_native
from support.engine import all_free

MODEL = "builtin://smollm2-135m"


def test_config_takes_the_kv_cache_dtypes_and_names_the_field_otherwise():
    assert EngineConfig().kv_cache_dtype == "auto"
    for name in KV_CACHE_DTYPES:
        assert EngineConfig(kv_cache_dtype=name).kv_cache_dtype == name
    for bad in ("fp8", "half", "", "Float16"):
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            EngineConfig(kv_cache_dtype=bad)
    with pytest.raises(ValueError, match="kv_cache_dtype"):  # the offline API: before any model loads
        LLM(MODEL, kv_cache_dtype="int8")


def test_serve_flag_and_env_var():
    assert parse_serve_args(["--kv-cache-dtype", "float16"], environ={}).engine_config().kv_cache_dtype == "float16"
    env = {"KVPILOT_KV_CACHE_DTYPE": "bfloat16"}
    assert parse_serve_args([], environ=env).engine_config().kv_cache_dtype == "bfloat16"
    assert parse_serve_args(["--kv-cache-dtype", "auto"], environ=env).engine_config().kv_cache_dtype == "auto"
    for argv, environ in ((["--kv-cache-dtype", "fp8"], {}), ([], {"KVPILOT_KV_CACHE_DTYPE": "fp8"})):
        with pytest.raises(SystemExit) as ei:
            parse_serve_args(argv, environ=environ)
        assert ei.value.code == 2


def test_resolve_kv_cache_dtype():
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert resolve_kv_cache_dtype("auto", torch.float32) is torch.float32
    assert resolve_kv_cache_dtype("float16", torch.float32) is torch.float16
    assert resolve_kv_cache_dtype("bfloat16", torch.float32) is torch.bfloat16
    assert resolve_kv_cache_dtype("float32", torch.bfloat16) is torch.float32
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        resolve_kv_cache_dtype("fp8", torch.float32)


@pytest.fixture(scope="module")
def loaded():
    return load_model(EngineConfig(model=MODEL, dtype="float32", max_model_len=512))


def _runner(loaded, **kwargs) -> ModelRunner:
    return ModelRunner(EngineConfig(model=MODEL, dtype="float32", max_model_len=512, **kwargs), loaded)


def test_a_float16_cache_holds_twice_the_blocks_of_a_budget(loaded, caplog):
    budget = 50 << 20  # not a multiple of a block: floor(2x) is 2 floor(x) or one more
    r32 = _runner(loaded, kv_cache_memory=budget)
    r16 = _runner(loaded, kv_cache_memory=budget, kv_cache_dtype="float16")
    assert (r32.kv_dtype, r16.kv_dtype) == (torch.float32, torch.float16)
    assert r32.kv_bytes_per_block == 2 * r16.kv_bytes_per_block
    n32 = r32.num_blocks_for_budget()
    with caplog.at_level(logging.INFO, logger="kvpilot.daemon.engine.runner"):
        n16 = r16.num_blocks_for_budget()
    assert n16 // 2 == n32 and n32 > 0
    assert "KV cache float16 (float32 model)" in caplog.text
    assert _runner(loaded, kv_cache_memory=budget, kv_cache_dtype="auto").kv_dtype == torch.float32


def test_caches_and_swap_pool_are_allocated_in_the_kv_dtype(loaded):
    runner = _runner(loaded, kv_cache_dtype="float16", preemption_mode="swap")
    runner.init_kv_cache(6, num_cpu_blocks=3)
    assert len(runner.k_caches) == len(runner.v_caches) == runner.num_layers
    for c in runner.k_caches + runner.v_caches:
        assert c.dtype == torch.float16 and c.shape[0] == 6
    for c in runner.cpu_k_caches + runner.cpu_v_caches:
        assert c.dtype == torch.float16 and c.shape[0] == 3
    # swapping moves the float16 blocks as they are, and they come back the same
    runner.k_caches[3][1].normal_()
    runner.swap_out([(1, 2)])
    runner.swap_in([(2, 4)])
    assert runner.k_caches[3][1].any() and torch.equal(runner.k_caches[3][4], runner.k_caches[3][1])


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "SELECT name FROM users WHERE",
]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.mark.slow
def test_a_float16_cache_generates_what_float32_does(monkeypatch):
    # the same memory budget for both: float16 holds twice the tokens
    kwargs = {"dtype": "float32", "kv_cache_memory": 48 << 20, "max_model_len": 512}
    llm32 = LLM(MODEL, **kwargs)
    want = [o.outputs[0].token_ids for o in llm32.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert all_free(llm32)
    del llm32
    llm16 = LLM(MODEL, kv_cache_dtype="float16", **kwargs)
    assert llm16.engine.runner.k_caches[0].dtype == torch.float16
    calls = []
    if torch.float16 in cpu_native.cache_dtypes():  # decode must run the C kernel's float16 variant
        real = cpu_native._fns[torch.float16]
        monkeypatch.setitem(cpu_native._fns, torch.float16, lambda *a: calls.append(a[2]) or real(*a))
    got = [o.outputs[0].token_ids for o in llm16.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert all_free(llm16)
    if cpu_native.cache_dtypes():
        cache_ptrs = {c.data_ptr() for c in llm16.engine.runner.k_caches}
        assert calls and set(calls) <= cache_ptrs
    # float16 rounds each cached K/V value by at most 2^-11 relative: on this model greedy decoding did not
    # change a single token in 16 prompts x 32 tokens; the first 8 must agree, and nearly all of the rest
    for a, b in zip(want, got, strict=True):
        assert a[:8] == b[:8], (a, b)
    agree = sum(x == y for a, b in zip(want, got, strict=True) for x, y in zip(a, b, strict=True))
    assert agree >= 0.9 * sum(map(len, want)), (want, got)
