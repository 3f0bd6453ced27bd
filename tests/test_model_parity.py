"""Model-level parity: the native Llama model driven through ModelRunner (paged KV cache, flattened
varlen batches, shuffled block tables) against HF transformers on the same GGUF weights, in float32.

HF loads the folder ``resolve_model_path`` caches for the builtin GGUF: transformers' own GGUF loader
gives bitwise the same weights and logits (checked when this was written), but parses the file for
30-90 s on a small CPU, so the plain dequantized copy keeps this file fast."""

from __future__ import annotations

import random

import pytest
import torch

from kvpilot.common.model_source import resolve_model_path
from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.loader import load_model
from kvpilot.daemon.engine.runner import ModelRunner, SeqBatchEntry

BLOCK = 16
NUM_BLOCKS = 64
DECODE_STEPS = 6
ATOL = 5e-4  # float32 logits are O(10); fused matmuls and another attention order give ~6e-5

PROMPTS = [
    "Hi",
    "The capital of France is",
    "Write a short poem about the sea, the wind and the long grey waves that roll onto the shore at night.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, computed iteratively so that large n "
    "do not overflow the stack.\"\"\"\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n",
]


@pytest.fixture(scope="module")
def native():
    cfg = EngineConfig(model="builtin://smollm2-135m", dtype="float32", num_kv_blocks=NUM_BLOCKS, block_size=BLOCK)
    loaded = load_model(cfg)
    assert loaded.dtype == torch.float32
    runner = ModelRunner(cfg, loaded)
    runner.init_kv_cache(runner.num_blocks_for_budget())
    return loaded, runner


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    folder = resolve_model_path("builtin://smollm2-135m")
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def reference(native, hf_model):
    """Per prompt: ids = prompt + HF's greedy continuation, and HF's logits at every position."""
    tok = native[0].tokenizer
    out = []
    with torch.inference_mode():
        for text in PROMPTS:
            ids = list(tok(text)["input_ids"])
            n_prompt = len(ids)
            # plain greedy with HF's own KV cache, no EOS stop: every step gets compared
            step = hf_model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
            for _ in range(DECODE_STEPS):
                ids.append(int(step.logits[0, -1].argmax()))
                step = hf_model(torch.tensor([ids[-1:]]), cache=step.cache, use_cache=True)
            logits = hf_model(torch.tensor([ids[:-1]])).logits[0].float()
            assert logits[n_prompt - 1 :].argmax(-1).tolist() == ids[n_prompt:]
            out.append((ids, n_prompt, logits))
    return out


def _shuffled_tables(lengths: list[int], seed: int) -> list[list[int]]:
    """Disjoint block tables drawn in random order from the whole pool."""
    pool = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(pool)
    tables = []
    for n in lengths:
        k = -(-n // BLOCK)
        tables.append(pool[:k])
        pool = pool[k:]
    return tables


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def test_batched_prefill_and_decode_match_hf(native, reference):
    """Sequences of different lengths in one flattened batch; the longest prompt is prefilled in two
    chunks, its second chunk sharing a step with the others' decodes (a mixed batch)."""
    _, runner = native
    lengths = [len(ids) for ids, _, _ in reference]
    assert len(set(lengths)) == len(lengths) and max(lengths) > 3 * BLOCK
    tables = _shuffled_tables(lengths, seed=1)
    long_i = max(range(len(reference)), key=lambda i: reference[i][1])
    pos = [0] * len(reference)  # tokens of each sequence already in the cache
    split = reference[long_i][1] // 2

    # step 0: prefill every prompt, except only the first half of the longest one
    entries, order = [], []
    for i, (ids, n_prompt, _) in enumerate(reference):
        n = split if i == long_i else n_prompt
        entries.append(SeqBatchEntry(ids[:n], 0, tables[i], compute_logits=i != long_i))
        order += [] if i == long_i else [i]
        pos[i] = n
    logits = runner.execute(entries)
    assert logits.dtype == torch.float32 and logits.shape == (len(order), runner.vocab_size)
    worst = 0.0
    for row, i in zip(logits, order, strict=True):
        ids, n_prompt, ref = reference[i]
        worst = max(worst, _close(row, ref[n_prompt - 1]))
        assert int(row.argmax()) == ids[n_prompt]

    # then decode steps; the long sequence finishes its prompt in the first of them
    for _ in range(DECODE_STEPS):
        entries, order = [], []
        for i, (ids, n_prompt, _) in enumerate(reference):
            end = n_prompt if pos[i] < n_prompt else pos[i] + 1
            if end > len(ids) - 1:
                continue
            entries.append(SeqBatchEntry(ids[pos[i] : end], pos[i], tables[i], compute_logits=True))
            order.append(i)
            pos[i] = end
        random_order = list(range(len(entries)))
        random.Random(len(entries)).shuffle(random_order)  # batch order must not matter
        entries = [entries[j] for j in random_order]
        order = [order[j] for j in random_order]
        logits = runner.execute(entries)
        assert logits.shape[0] == len(order)
        for row, i in zip(logits, order, strict=True):
            ids, _, ref = reference[i]
            p = pos[i] - 1
            worst = max(worst, _close(row, ref[p]))
            assert int(row.argmax()) == ids[p + 1], f"prompt {i}: greedy token differs at position {p + 1}"
    assert worst < ATOL, f"max |logit diff| vs HF = {worst:.2e}"
    assert all(pos[i] == len(ids) - 1 for i, (ids, _, _) in enumerate(reference))


def test_chunked_prefill_matches_one_shot(native, reference):
    _, runner = native
    ids, n_prompt, ref = max(reference, key=lambda r: r[1])
    prompt = ids[:n_prompt]
    one_table, chunk_table = _shuffled_tables([n_prompt, n_prompt], seed=7)
    one_shot = runner.execute([SeqBatchEntry(prompt, 0, one_table, True)])[0]

    cuts = [0, 13, 13 + 17, n_prompt]  # 3 chunks, not aligned to blocks
    last = None
    for a, b in zip(cuts, cuts[1:], strict=False):
        out = runner.execute([SeqBatchEntry(prompt[a:b], a, chunk_table, compute_logits=b == n_prompt)])
        assert out.shape[0] == (1 if b == n_prompt else 0)
        last = out
    assert last is not None
    assert _close(last[0], one_shot) < ATOL
    assert _close(last[0], ref[n_prompt - 1]) < ATOL
    assert int(last[0].argmax()) == int(one_shot.argmax()) == ids[n_prompt]


def test_wrong_block_table_is_detected(native, reference):
    """Negative control: decoding against a block table that points at another sequence's KV
    must not match HF, so the checks above can fail."""
    _, runner = native
    (ids_a, n_a, ref_a), (ids_b, n_b, _) = reference[2], reference[3]
    table_a, table_b = _shuffled_tables([n_a + 1, n_b], seed=11)
    runner.execute([SeqBatchEntry(ids_a[:n_a], 0, table_a, False), SeqBatchEntry(ids_b[:n_b], 0, table_b, False)])
    bad = [table_b[0], *table_a[1:]]  # first block now holds sequence b's keys and values
    out = runner.execute([SeqBatchEntry([ids_a[n_a]], n_a, bad, True)])[0]
    assert _close(out, ref_a[n_a]) > 10 * ATOL


# ------------------------------------------------------------------ other architectures and RoPE types
# Tiny random models in the HF format: each exercises what SmolLM2 does not (q/k/v bias, sliding
# window, RoPE scaling, an untied lm_head), loaded through the same local-folder source.

TINY = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256, "rms_norm_eps": 1e-6}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def _tiny_configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    return {
        "qwen2_bias": Qwen2Config(**TINY, tie_word_embeddings=True),
        "mistral_window": MistralConfig(**TINY, sliding_window=8, tie_word_embeddings=False),
        "llama3_rope": LlamaConfig(**TINY, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False),
        "linear_rope_bias": LlamaConfig(
            **TINY, attention_bias=True, mlp_bias=True, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                                          "factor": 4.0}
        ),
    }


@pytest.mark.parametrize("name", list(_tiny_configs()))
def test_tiny_architectures_match_hf(name, tmp_path, native):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf_cfg = _tiny_configs()[name]
    hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # HF zero-inits biases; random ones make the bias paths count
        for n, p in hf.named_parameters():
            if n.endswith(".bias") or "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path)
    native[0].tokenizer.save_pretrained(tmp_path)  # any tokenizer does: the test feeds ids

    cfg = EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=16, block_size=8)
    loaded = load_model(cfg)
    runner = ModelRunner(cfg, loaded)
    runner.init_kv_cache(runner.num_blocks_for_budget())
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist() for n in (5, 21, 40)]
    with torch.inference_mode():
        ref = [hf(torch.tensor([s])).logits[0] for s in seqs]
    tables = [[15 - j for j in range(6)], [0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
    prompt = [len(s) - 3 for s in seqs]  # prefill all but 3 tokens, then decode them one at a time
    out = runner.execute([SeqBatchEntry(s[:p], 0, t, True) for s, p, t in zip(seqs, prompt, tables, strict=True)])
    for i in range(3):
        worst = max(_close(out[j], ref[j][prompt[j] - 1 + i]) for j in range(3))
        assert worst < 1e-4, f"{name}: step {i}: max |logit diff| {worst:.2e}"
        out = runner.execute(
            [SeqBatchEntry([s[p + i]], p + i, t, True) for s, p, t in zip(seqs, prompt, tables, strict=True)]
        )
    worst = max(_close(out[j], ref[j][-1]) for j in range(3))
    assert worst < 1e-4, f"{name}: last step: max |logit diff| {worst:.2e}"
