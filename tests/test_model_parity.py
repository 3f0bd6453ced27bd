"""Model-level parity: the native Llama model driven through ModelRunner (paged KV cache, flattened
varlen batches, shuffled block tables) against HF transformers on the same GGUF weights, in float32.

HF loads the folder ``resolve_model_path`` caches for the builtin GGUF: transformers' own GGUF loader
gives bitwise the same weights and logits (checked when this was written), but parses the file for
30-90 s on a small CPU, so the plain dequantized copy keeps this file fast."""

from __future__ import annotations

import random

import pytest
import torch
from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.loader import load_model, resolve_model_path
from kvpilot.daemon.engine.runner import ModelRunner, SeqBatchEntry

BLOCK = 16
NUM_BLOCKS = 64
DECODE_STEPS = 6
ATOL = 2e-3  # float32 logits are O(10); fused matmuls and another attention order differ by ~1e-4

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
            for _ in range(DECODE_STEPS):
                logits = hf_model(torch.tensor([ids])).logits[0]
                ids.append(int(logits[-1].argmax()))
            logits = hf_model(torch.tensor([ids[:-1]])).logits[0].float()
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
    assert _close(last[0], one_shot) < 1e-3
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
