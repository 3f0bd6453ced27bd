"""Speculative decoding in the engine, on tiny random models: speculation on and off give the same tokens
(greedy, seeded, with logprobs, stops, limits, grammars, preemption), draft models load and check their
tokenizer, and the counters reach /metrics. The copy-heavy runs on the real model are marked slow."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvpilot.daemon.engine import LLM, SamplingParams
from kvpilot.daemon.engine.spec_decode.draft import layer_skip_view
from kvpilot.daemon.engine.spec_decode.speculator import make_speculator
from kvpilot.daemon.engine.structured import StructuredOutputSpec
from kvpilot.daemon.metrics import DaemonMetrics
from support.engine import all_free
from support.hf_parity import save_tiny

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SELF_DRAFT = {"method": "draft_model", "model": "self:2", "num_speculative_tokens": 3}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True}
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def tiny_folder(folder: Path, seed_offset: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    # perturbed norms make the random model's choices depend on the context (attention matters)
    save_tiny(LlamaConfig(**TINY), LlamaForCausalLM, folder, lambda n: "norm" in n)
    if seed_offset:  # another draft: the same shapes, other weights
        from safetensors.torch import load_file, save_file

        weights = load_file(folder / "model.safetensors")
        gen = torch.Generator().manual_seed(seed_offset)
        save_file({k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in weights.items()},
                  folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return tiny_folder(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def llm(tiny_dir: Path) -> LLM:
    return LLM(model=str(tiny_dir), dtype="float32", num_kv_blocks=128, block_size=8, max_num_seqs=16)


@contextmanager
def speculating(llm: LLM, raw: dict[str, Any] | None) -> Iterator[None]:
    """The engine with another speculative_config (None: off) for the duration: one model load for all tests."""
    engine = llm.engine
    saved = engine.speculator
    config = replace(engine.config, speculative_config=raw)
    engine.speculator = None if raw is None else make_speculator(config, engine.loaded, engine.runner,
                                                                 engine.max_model_len)
    try:
        yield
    finally:
        engine.speculator = saved


def run(llm: LLM, raw: dict[str, Any] | None, prompts: list[Any], params: SamplingParams | list[SamplingParams]):
    with speculating(llm, raw):
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.speculator.stats if llm.engine.speculator is not None else None
    assert all_free(llm)
    return [o.outputs[0] for o in outs], stats


def prompts_mixed(n: int) -> list[dict[str, list[int]]]:
    """Token prompts: copy-heavy ones (a passage, then its start again) and free-running ones."""
    import torch

    gen = torch.Generator().manual_seed(5)
    out = []
    for i in range(n):
        passage = torch.randint(3, 500, (24 + i,), generator=gen).tolist()
        ids = passage + passage[: 6 + i % 5] if i % 2 == 0 else torch.randint(3, 500, (10 + i,), generator=gen).tolist()
        out.append({"prompt_token_ids": ids})
    return out


# --- greedy: token for token ---------------------------------------------------------------------------------

@pytest.mark.parametrize("raw", [NGRAM, SELF_DRAFT], ids=["ngram", "self-draft"])
@pytest.mark.parametrize("batch", [1, 12])
def test_greedy_tokens_equal_with_and_without_speculation(llm, raw, batch):
    prompts = prompts_mixed(batch)
    base, _ = run(llm, None, prompts, GREEDY)
    spec, stats = run(llm, {**raw, "disable_by_batch_size": 16}, prompts, GREEDY)
    assert [o.token_ids for o in spec] == [o.token_ids for o in base]
    assert stats.num_draft_tokens > 0
    if raw is NGRAM:
        assert stats.num_accepted_tokens > 0
    if raw is NGRAM and batch > 1:  # both paths of the walk ran: some drafts accepted, some rejected
        assert stats.num_accepted_tokens < stats.num_draft_tokens, stats


def test_logprobs_stop_strings_and_limits_stay_exact(llm):
    prompts = prompts_mixed(6)
    text = run(llm, None, prompts[:1], GREEDY)[0][0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # a string inside the run: it ends the request there
    params = [SamplingParams(temperature=0.0, max_tokens=40, logprobs=3, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=40, stop=[stop], ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),  # not a multiple of 1 + k
              SamplingParams(temperature=0.0, max_tokens=30, min_tokens=20),
              # a penalty on the output (small: the model still loops, so drafts get accepted); row j must
              # count the j drafts before it as output, or its logprobs drift
              SamplingParams(temperature=0.0, max_tokens=30, frequency_penalty=0.02, logprobs=0,
                             ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[7, 11], ignore_eos=True)]
    base, _ = run(llm, None, prompts, params)
    spec, stats = run(llm, NGRAM, prompts, params)
    assert stats.num_accepted_tokens > 0
    for b, s in zip(base, spec, strict=True):
        assert (s.token_ids, s.text, s.finish_reason, s.stop_reason) == (b.token_ids, b.text, b.finish_reason,
                                                                          b.stop_reason)
    assert spec[1].finish_reason == "stop" and spec[1].stop_reason == stop
    assert len(spec[2].token_ids) == 7
    for b, s in [(base[0], spec[0]), (base[4], spec[4])]:  # logprobs of the processed logits, penalties included
        for b_entry, s_entry in zip(b.logprobs, s.logprobs, strict=True):
            assert b_entry.keys() == s_entry.keys()
            for tid, lp in b_entry.items():
                assert abs(lp.logprob - s_entry[tid].logprob) < 1e-4 and lp.rank == s_entry[tid].rank
        assert abs(b.cumulative_logprob - s.cumulative_logprob) < 1e-3


# --- sampling: seeds ---------------------------------------------------------------------------------------------

def test_seeded_sampling_with_speculation(llm):
    prompts = prompts_mixed(4)
    seeded = [SamplingParams(temperature=t, top_k=k, seed=11 + i, max_tokens=40, ignore_eos=True)
              for i, (t, k) in enumerate([(0.7, 5), (0.7, 5), (0.9, 0), (0.2, 0)])]
    base, _ = run(llm, None, prompts, seeded)
    spec, stats = run(llm, NGRAM, prompts, seeded)
    assert stats.num_accepted_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens
    # one uniform per emitted token, the rejected rows' given back: the same tokens as without speculation
    assert [o.token_ids for o in spec] == [o.token_ids for o in base]
    nucleus = SamplingParams(temperature=0.9, top_p=0.8, seed=11, max_tokens=40, ignore_eos=True)
    alone, _ = run(llm, NGRAM, prompts[:1], nucleus)
    batched, _ = run(llm, NGRAM, prompts, [nucleus] + [SamplingParams(temperature=1.0, max_tokens=40)] * 3)
    assert alone[0].token_ids == batched[0].token_ids  # reproducible for its seed, alone or in a batch


# --- structured outputs ------------------------------------------------------------------------------------------

def test_structured_output_stays_valid_under_speculation(llm):
    # strings of single-letter tokens, which the tiny model's 512-token vocabulary has (a, b, c are 81-83)
    choices = ["abcabcabcabc", "abcabcbcabca", "cbacbacbaabc"]
    spec_ = StructuredOutputSpec.choice(choices)
    tok = llm.get_tokenizer()
    # the prompt holds the choices (ngram finds them) and the model's own tokens pick between them
    prompt = {"prompt_token_ids": tok.convert_tokens_to_ids(list("".join(choices) * 2))}
    params = [SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=spec_),
              SamplingParams(temperature=1.0, seed=3, max_tokens=20, structured_outputs=spec_)]
    base, _ = run(llm, None, [prompt, prompt], params)
    spec, stats = run(llm, NGRAM, [prompt, prompt], params)
    assert stats.num_accepted_tokens > 0
    for b, s in zip(base, spec, strict=True):
        assert s.text in choices and s.token_ids == b.token_ids


# --- preemption, KV books ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_preemption_mid_speculation_keeps_the_tokens(tiny_dir):
    """A cache too small for the batch: sequences holding draft slots are preempted (recompute and swap)."""
    prompts = prompts_mixed(12)
    for mode in ("recompute", "swap"):
        tight = LLM(model=str(tiny_dir), dtype="float32", num_kv_blocks=40, block_size=8, preemption_mode=mode,
                    swap_space=0.01, speculative_config={**NGRAM, "disable_by_batch_size": 16})
        base, _ = run(tight, None, prompts, GREEDY)
        before = tight.engine.scheduler.num_preemptions_total
        spec, stats = run(tight, {**NGRAM, "disable_by_batch_size": 16}, prompts, GREEDY)
        assert tight.engine.scheduler.num_preemptions_total > before and stats.num_accepted_tokens > 0
        assert [o.token_ids for o in spec] == [o.token_ids for o in base], mode
        tight.engine.scheduler.kv_manager.check_invariants()


# --- draft models -------------------------------------------------------------------------------------------

def test_self_draft_shares_the_target(llm):
    target = llm.engine.loaded.model
    view = layer_skip_view(target, 2)
    assert view.num_layers == 2 and target.num_layers == 4 and len(target.layers) == 4
    assert view.layers[1] is target.layers[1] and view.norm is target.norm
    with pytest.raises(ValueError, match=r"speculative_config.model: self:4 must keep 1 to 3"):
        layer_skip_view(target, 4)


@pytest.mark.slow
def test_separate_draft_model(tiny_dir, tmp_path):
    """A draft with the target's weights agrees with it almost always (its own cache is kept right); one
    with other weights agrees less, and the tokens stay the target's either way."""
    import shutil

    same = tmp_path / "same"
    shutil.copytree(tiny_dir, same)
    other = tiny_folder(tmp_path / "other", seed_offset=9)
    prompts = prompts_mixed(6)
    llm = LLM(model=str(tiny_dir), dtype="float32", num_kv_blocks=128, block_size=8,
              speculative_config={"method": "draft_model", "model": str(same), "num_speculative_tokens": 3})
    base, _ = run(llm, None, prompts, GREEDY)
    spec, stats = run(llm, llm.engine.config.speculative_config, prompts, GREEDY)
    assert [o.token_ids for o in spec] == [o.token_ids for o in base]
    assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens > 0, stats
    spec, stats = run(llm, {"method": "draft_model", "model": str(other), "num_speculative_tokens": 3}, prompts,
                      GREEDY)
    assert [o.token_ids for o in spec] == [o.token_ids for o in base]
    assert stats.num_draft_tokens > 0


def test_draft_with_another_tokenizer_is_refused(tiny_dir, tmp_path):
    import shutil

    draft = tmp_path / "draft"
    shutil.copytree(tiny_dir, draft)
    tokenizer = json.loads((draft / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = (next(t for t, i in vocab.items() if i == n) for n in (300, 301))
    vocab[first], vocab[second] = 301, 300  # two ids swapped: another vocabulary, the same merges
    (draft / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="speculative_config.model: .*another tokenizer vocabulary"):
        LLM(model=str(tiny_dir), dtype="float32", num_kv_blocks=32, block_size=8,
            speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2})


def test_bad_configs_fail_before_loading():
    for raw, field in [({"method": "eagle", "num_speculative_tokens": 2}, "EAGLE"),
                       ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3,
                         "prompt_lookup_max": 2}, "prompt_lookup_min")]:
        with pytest.raises(ValueError, match=field):
            LLM(model="/nonexistent/model", speculative_config=raw)


# --- metrics -------------------------------------------------------------------------------------------------

def _metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{{model_name=\"m\"{re.escape(labels)}}} (\S+)$", text, re.M)
    assert m, f"{name}{labels} not in /metrics"
    return float(m.group(1))


def test_counters_reach_metrics(llm):
    metrics = DaemonMetrics("m", stats_fn=llm.engine.get_stats)
    empty = metrics.render().decode()
    assert "vllm:spec_decode_num_drafts_total" not in empty or _metric(empty, "vllm:spec_decode_num_drafts_total") == 0
    with speculating(llm, NGRAM):
        llm.generate(prompts_mixed(2), GREEDY, use_tqdm=False)
        text = metrics.render().decode()
        stats = llm.engine.speculator.stats
    assert _metric(text, "vllm:spec_decode_num_drafts_total") == stats.num_drafts > 0
    assert _metric(text, "vllm:spec_decode_num_draft_tokens_total") == stats.num_draft_tokens
    assert _metric(text, "vllm:spec_decode_num_accepted_tokens_total") == stats.num_accepted_tokens > 0
    per_pos = [_metric(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", f',position="{j}"') for j in range(4)]
    assert per_pos == stats.accepted_per_pos and sum(per_pos) == stats.num_accepted_tokens
    assert per_pos == sorted(per_pos, reverse=True)  # a draft is accepted only after the ones before it


# --- the real model on copy-heavy prompts -------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm() -> LLM:
    return LLM(model="builtin://smollm2-135m", dtype="float32", quantization="none", num_kv_blocks=256)


@pytest.mark.slow
@pytest.mark.parametrize("raw", [NGRAM, {**SELF_DRAFT, "model": "self:24", "num_speculative_tokens": 2}],
                         ids=["ngram", "self-draft"])
def test_real_model_copy_heavy_greedy_is_exact(smollm, raw):
    """bench/speculative.py's prompts (a passage to copy, a file to edit, quotes) beside free-running ones,
    alone and in a batch of 12: the same tokens with speculation on and off, and (ngram) most drafts accepted."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from speculative import copy_heavy_prompts

    copy = list(copy_heavy_prompts().values())
    free = ["Once upon a time", "The three most important inventions are", "def fibonacci(n):",
            "Dear hiring manager,", "The weather today is", "In 1492,", "List of fruits:", "Q: What is 2+2?\nA:",
            "The mitochondria", "Roses are red,"]
    batch = [copy[i % 3] if i % 4 == 0 or i == 1 else free[i % len(free)] for i in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=32 if raw is NGRAM else 20)
    # the self-draft's 24 layers per draft make a batch of 12 slow here; the tiny model's tests batch it
    for prompts in ([copy[1]], batch) if raw is NGRAM else ([copy[1]],):
        base, _ = run(smollm, None, prompts, params)
        spec, stats = run(smollm, {**raw, "disable_by_batch_size": 16}, prompts, params)
        assert [o.token_ids for o in spec] == [o.token_ids for o in base]
        assert stats.num_accepted_tokens > 0
        if raw is NGRAM and len(prompts) == 1:
            assert stats.num_accepted_tokens > 0.6 * stats.num_draft_tokens, stats
