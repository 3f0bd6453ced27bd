"""LLMEngine on the real model: n>1 sharing, prefix caching, cache salts, abort, priority, bad config."""

from __future__ import annotations

import pytest

from kvpilot.daemon.engine import LLM, EngineConfig, SamplingParams
from kvpilot.daemon.engine.llm_engine import LLMEngine
from support.engine import all_free

BS = 16


def test_n4_shares_prompt_blocks(llm):
    engine: LLMEngine = llm.engine
    prompt_ids = list(range(1000, 1000 + 3 * BS + 5))  # 3 full blocks + a partial one
    engine.add_request("share", prompt_ids, SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8,
                                                           ignore_eos=True))
    engine.step()  # prefill + first token of 4 forked sequences
    seqs = [f"share#{i}" for i in range(1, 4)] + ["share"]
    sched = engine.scheduler
    tables = [sched.kv_manager.block_ids(sched.sequences[s]) for s in seqs]
    assert all(t[:3] == tables[0][:3] for t in tables), "the prompt's full blocks are shared"
    # 4 sequences, but only the 4 prompt blocks are held so far (copy-on-write has not happened yet).
    assert sched.kv_stats().num_used_blocks == 4
    engine.step()  # each sequence writes its own token: the shared partial block is copied 3 times
    assert sched.kv_stats().num_used_blocks == 3 + 4
    outputs = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs = out
    assert outputs is not None and outputs.finished and len(outputs.outputs) == 4
    assert len({tuple(o.token_ids) for o in outputs.outputs}) > 1, "4 samples should not all be identical"
    assert all_free(llm)


def test_repeated_prompt_hits_prefix_cache(llm):
    engine = llm.engine
    engine.reset_prefix_cache()
    prompt_ids = list(range(2000, 2000 + 5 * BS + 3))
    params = SamplingParams(temperature=0, max_tokens=2)
    llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)
    hits_before = engine.get_stats().prefix_cache_hits_total
    out = llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)[0]
    expected = (len(prompt_ids) - 1) // BS
    assert out.num_cached_tokens == expected * BS
    assert engine.get_stats().prefix_cache_hits_total - hits_before == expected * BS


def test_unknown_model_uri():
    with pytest.raises(ValueError, match="nope://"):
        LLMEngine(EngineConfig(model="nope://whatever"))
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="random")


def test_abort_frees_everything(llm):
    engine = llm.engine
    for i in range(4):
        engine.add_request(f"ab{i}", f"Tell me about topic {i}.", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.get_stats().num_running == 4
    engine.abort_request([f"ab{i}" for i in range(4)])
    assert not engine.has_unfinished_requests()
    assert engine.step() == []
    assert all_free(llm)


def test_priority_policy_runs_important_first():
    llm = LLM(model="builtin://smollm2-135m", scheduling_policy="priority", max_num_seqs=1, num_kv_blocks=64)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("low", "a", params, priority=5)
    engine.add_request("high", "b", params, priority=-1)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["high", "low"]


def test_cache_salt_keeps_tenants_apart(llm):
    engine = llm.engine
    engine.reset_prefix_cache()
    prompt_ids = list(range(3000, 3000 + 4 * BS + 1))
    params = SamplingParams(temperature=0, max_tokens=1)

    def cached_tokens(request_id: str, salt: str | None) -> int:
        engine.add_request(request_id, prompt_ids, params, cache_salt=salt)
        final = None
        while engine.has_unfinished_requests():
            final = next((o for o in engine.step() if o.finished), final)
        assert final is not None
        return final.num_cached_tokens

    assert cached_tokens("salt-a1", "tenant-a") == 0
    assert cached_tokens("salt-b", "tenant-b") == 0, "another tenant's salt must never hit"
    assert cached_tokens("salt-none", None) == 0, "an unsalted request must not hit a salted entry"
    assert cached_tokens("salt-a2", "tenant-a") == 4 * BS
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add_request("salt-bad", prompt_ids, params, cache_salt="")
    assert all_free(llm)


@pytest.mark.slow
def test_engine_seed_makes_unseeded_sampling_repeatable():
    def sample(seed: int) -> list[int]:
        run = LLM(model="builtin://smollm2-135m", num_kv_blocks=64, seed=seed)
        params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)  # no per-request seed
        return list(run.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0].token_ids)

    first = sample(1234)
    assert sample(1234) == first
    assert sample(99) != first
