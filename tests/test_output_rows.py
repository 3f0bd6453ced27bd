"""The last layer computes only the rows that are sampled (models.OutputRows): the logits and every
layer's K/V equal those of the whole forward, in mixed batches, with nothing sampled, and with prompt
logprobs (which need every row, so take the whole forward)."""

from __future__ import annotations

import pytest
import torch

from kvpilot.daemon.engine import LLM
from kvpilot.daemon.engine.runner import SeqBatchEntry
from kvpilot.daemon.engine.sampling_params import SamplingParams

BS = 16


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="builtin://smollm2-135m", dtype="float32", num_kv_blocks=64)


def _batch(seed: int) -> list[SeqBatchEntry]:
    """A prefill chunk that samples, one that does not (a middle chunk), a chunk from position 40 and two
    decodes: every kind of entry a step mixes."""
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(100, 40000, (n,), generator=g).tolist()

    return [
        SeqBatchEntry(ids(37), 0, list(range(0, 3)), True),
        SeqBatchEntry(ids(20), 0, list(range(3, 5)), False),
        SeqBatchEntry(ids(9), 40, list(range(5, 9)), True),
        SeqBatchEntry(ids(1), 60, list(range(9, 13)), True),
        SeqBatchEntry(ids(1), 17, list(range(13, 15)), True),
    ]


def _whole_forward(runner, entries):
    """What execute() computed before OutputRows: every row through every layer, then the sampled rows."""
    input_ids, positions, meta, rows, output_rows, _ = runner._prepare(entries)  # noqa: SLF001
    assert output_rows is not None and output_rows.rows.tolist() == rows.tolist()
    with torch.inference_mode():
        hidden = runner.model(input_ids, positions, meta)
        return runner.model.compute_logits(hidden[torch.from_numpy(rows)])


def _caches(runner) -> list[torch.Tensor]:
    return [c[:15].clone() for c in runner.k_caches + runner.v_caches]


def test_sampled_rows_only_match_the_whole_forward(llm: LLM) -> None:
    runner = llm.engine.runner
    entries = _batch(0)
    # the earlier context of the entries that start past 0 (its values do not matter, only that both runs see it)
    for c in runner.k_caches + runner.v_caches:
        c[:15] = torch.randn(c[:15].shape, generator=torch.Generator().manual_seed(1)) * 0.5
    ref = _whole_forward(runner, entries)
    ref_caches = _caches(runner)
    logits = runner.execute(entries)
    assert logits.shape == (4, runner.vocab_size)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    assert (logits.argmax(-1) == ref.argmax(-1)).all()
    for got, want in zip(_caches(runner), ref_caches, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # the last layer's K/V too


def test_nothing_sampled_still_stores_every_layer(llm: LLM) -> None:
    runner = llm.engine.runner
    entries = [SeqBatchEntry(list(range(200, 230)), 0, [0, 1], False)]
    for c in runner.k_caches + runner.v_caches:
        c[:2].zero_()
    runner.execute(entries)  # a middle chunk: no row is used, the last layer stores its K/V and stops
    stored = _caches(runner)
    for c in runner.k_caches + runner.v_caches:
        c[:2].zero_()
    input_ids, positions, meta, rows, output_rows, _ = runner._prepare(entries)  # noqa: SLF001
    assert rows.size == 0 and output_rows is not None and output_rows.rows.numel() == 0
    with torch.inference_mode():
        runner.model(input_ids, positions, meta)
    for got, want in zip(stored, _caches(runner), strict=True):
        torch.testing.assert_close(got[:2], want[:2], rtol=1e-5, atol=1e-5)
    assert stored[-1][:2].abs().sum() > 0  # the last layer's V was written


def test_engine_greedy_unchanged_and_prompt_logprobs_use_every_row(llm: LLM) -> None:
    """Generation through the engine (chunked prefill, so partial chunks that sample nothing) gives the
    same tokens as one prefill per prompt, and prompt logprobs still score every position."""
    prompts = ["The capital of France is", "List three colours: red,"]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    one_chunk = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    chunked = LLM(model="builtin://smollm2-135m", dtype="float32", num_kv_blocks=64, max_num_seqs=4,
                  max_num_batched_tokens=4)
    assert [o.outputs[0].token_ids for o in chunked.generate(prompts, params, use_tqdm=False)] == one_chunk
    out = chunked.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1),
                           use_tqdm=False)[0]
    ids = out.prompt_token_ids
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    assert all(ids[p] in out.prompt_logprobs[p] for p in range(1, len(ids)))


def test_a_sequence_verifying_drafts_gets_a_row_per_position(llm: LLM) -> None:
    """Speculative decoding: an entry of its last token and 3 drafts returns 4 rows of logits (each a one-token
    query over its own causal context), beside a prefill chunk and a decode, equal to the whole forward's."""
    runner = llm.engine.runner
    g = torch.Generator().manual_seed(3)
    entries = [SeqBatchEntry(torch.randint(100, 40000, (37,), generator=g).tolist(), 0, [0, 1, 2], True),
               SeqBatchEntry(torch.randint(100, 40000, (4,), generator=g).tolist(), 30, [3, 4, 5], True, num_logits=4),
               SeqBatchEntry([555], 17, [6, 7], True)]
    for c in runner.k_caches + runner.v_caches:
        c[:8] = torch.randn(c[:8].shape, generator=torch.Generator().manual_seed(2)) * 0.5
    input_ids, positions, meta, rows, output_rows, _ = runner._prepare(entries)  # noqa: SLF001
    assert rows.tolist() == [36, 37, 38, 39, 40, 41]
    assert output_rows.meta.context_lens.tolist() == [37, 31, 32, 33, 34, 18]
    ref = _whole_forward(runner, entries)
    logits = runner.execute(entries)
    assert logits.shape == (6, runner.vocab_size)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="num_logits"):
        runner.execute([SeqBatchEntry([5, 6], 0, [0], True, num_logits=3)])
