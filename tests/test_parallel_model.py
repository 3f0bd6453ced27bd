"""Tensor and pipeline parallelism of the model and the runner: tiny random Llama models run as 2-4 real
ranks (spawned processes over gloo, tests/support/parallel_ranks.py) give the logits and prompt logprobs of
one process; and, in this process, a rank's shard: the vocabulary rows it holds, the checkpoint tensors a
pipeline stage reads, the micro-batches a step is cut into."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from kvpilot.daemon.engine.loader import load_model
from kvpilot.daemon.engine.models.parallel import ParallelContext
from kvpilot.daemon.engine.runner import ModelRunner, SeqBatchEntry
from support.hf_parity import save_tiny
from support.parallel_ranks import NUM_BLOCKS, StepResult, engine_config, run_ranks, run_single

VOCAB = 300  # not a multiple of 64 * tp: every split pads, and tp 4's last rank holds padding only
ATOL = 1e-4


def _save(folder: Path, *, kv_heads: int, tied: bool, layers: int = 3) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=8,
                      num_key_value_heads=kv_heads, head_dim=16, vocab_size=VOCAB, max_position_embeddings=256,
                      rms_norm_eps=1e-6, tie_word_embeddings=tied, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    folder.mkdir()
    save_tiny(cfg, LlamaForCausalLM, folder, lambda name: "norm" in name)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """8 query heads over 4 KV heads, untied; 8 over 2, tied (at tp 4 each rank replicates a KV head)."""
    root = tmp_path_factory.mktemp("parallel_models")
    return {"untied_kv4": _save(root / "untied_kv4", kv_heads=4, tied=False),
            "tied_kv2": _save(root / "tied_kv2", kv_heads=2, tied=True)}


def _steps() -> list[list[SeqBatchEntry]]:
    """A first prefill chunk without logits, a second chunk beside a prompt that scores its targets, a prefill
    with two logits rows (as a draft verification has) beside two decodes, then decodes of three sequences."""
    gen = torch.Generator().manual_seed(3)
    ids = lambda n: torch.randint(0, VOCAB, (n,), generator=gen).tolist()  # noqa: E731
    a, b, c = ids(40), ids(12), ids(20)
    steps = [
        [SeqBatchEntry(a[:16], 0, [0, 1, 2], False)],
        [SeqBatchEntry(a[16:30], 16, [0, 1, 2], True),
         SeqBatchEntry(b[:11], 0, [3], True, prompt_targets=b[1:12], prompt_top_k=3)],
        [SeqBatchEntry(a[30:31], 30, [0, 1, 2], True), SeqBatchEntry(b[11:12], 11, [3], True),
         SeqBatchEntry(c, 0, [4, 5], True, num_logits=2)],
    ]
    lens = {0: 31, 3: 12, 4: 20}
    for _ in range(3):
        step = []
        for blocks in ([0, 1, 2], [3], [4, 5]):
            step.append(SeqBatchEntry(ids(1), lens[blocks[0]], blocks, True))
            lens[blocks[0]] += 1
        steps.append(step)
    return steps


def _assert_same(ref: list[StepResult], got: list[StepResult]) -> None:
    assert len(ref) == len(got)
    for i, (r, g) in enumerate(zip(ref, got, strict=True)):
        assert r.logits is not None and g.logits is not None, f"step {i}: the driver got no logits"
        assert g.logits.shape == r.logits.shape, f"step {i}"
        if r.logits.numel():
            diff = (g.logits - r.logits).abs().max().item()
            assert diff < ATOL, f"step {i}: logits differ by {diff}"
            assert torch.equal(g.logits.argmax(-1), r.logits.argmax(-1)), f"step {i}"
        assert sorted(g.prompt_logprobs) == sorted(r.prompt_logprobs), f"step {i}: prompt logprobs' entries"
        for j, want in r.prompt_logprobs.items():
            have = g.prompt_logprobs[j]
            assert have.ranks == want.ranks
            assert max(abs(x - y) for x, y in zip(have.logprobs, want.logprobs, strict=True)) < ATOL
            assert [[t for t, _ in row] for row in have.top] == [[t for t, _ in row] for row in want.top]


@pytest.mark.parametrize(("tp", "pp", "micro_batches"), [(2, 1, None), (4, 1, None), (1, 2, 3), (2, 2, None)],
                         ids=["tp2", "tp4", "pp2_3micro", "tp2xpp2"])
def test_ranks_give_one_process_logits(models: dict[str, Path], tp: int, pp: int, micro_batches: int | None) -> None:
    steps = _steps()
    runs = run_ranks(list(models.values()), steps, tp=tp, pp=pp, micro_batches=micro_batches)
    for name, run in zip(models, runs, strict=True):
        _assert_same(run_single(models[name], steps), run.steps)
        # the logits and the prompt logprobs come back on the driver only
        assert not run.returned_none[0] and all(run.returned_none[r] for r in range(1, tp * pp)), name
        assert not any(run.any_prompt_logprobs[r] for r in range(1, tp * pp)), name
        if pp > 1:  # every rank ran every step through the stages, in as many micro-batches as entries allow
            cuts = sum(min(micro_batches or pp, len(step)) for step in steps)
            for rank, stats in run.stats.items():
                assert stats.steps == len(steps) and stats.micro_batches == cuts, (name, rank)
                assert stats.compute_s > 0 and 0 <= stats.bubble < 1


def _ctx(**kw: Any) -> ParallelContext:
    """A rank's context without a process group: enough to build and load its shard, which sends nothing."""
    return ParallelContext(tp_group=object() if kw.get("tp_size", 1) > 1 else None, **kw)


def test_heads_that_do_not_divide_name_both_numbers(models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=r"num_attention_heads \(8\).*tensor_parallel_size \(3\)"):
        load_model(engine_config(models["untied_kv4"]), parallel=_ctx(tp_rank=0, tp_size=3))


@pytest.mark.parametrize("tp_rank", [0, 2, 3])
def test_vocabulary_rows_of_a_rank(models: dict[str, Path], tp_rank: int) -> None:
    """300 rows padded to 512 over 4 ranks: 128 each; rank 2 holds 256-299 then padding, rank 3 padding only."""
    from safetensors import safe_open

    folder = models["untied_kv4"]
    model = load_model(engine_config(folder), parallel=_ctx(tp_rank=tp_rank, tp_size=4)).model
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        embed, head = f.get_tensor("model.embed_tokens.weight"), f.get_tensor("lm_head.weight")
    assert model.vocab_size == VOCAB and model.embed_tokens.shape == (128, 64)
    start, real = 128 * tp_rank, max(0, min(128, VOCAB - 128 * tp_rank))
    for table, full in ((model.embed_tokens, embed), (model.lm_head, head)):
        rows = table.detach() if not table.is_mkldnn else table.to_dense()
        assert torch.equal(rows[:real], full[start:start + real])
        assert not rows[real:].any()


@pytest.mark.parametrize(("name", "pp_rank"), [("untied_kv4", 0), ("untied_kv4", 1), ("tied_kv2", 1)])
def test_a_stage_reads_only_its_tensors(models: dict[str, Path], name: str, pp_rank: int,
                                        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """3 layers over 2 stages: layer 0 on the first, 1-2 on the second, which also holds the final norm and
    the head (the embedding's rows for a tied head); no other tensor is even read."""
    import safetensors

    real_open, read = safetensors.safe_open, []

    class Recording:
        def __init__(self, *args: Any, **kw: Any) -> None:
            self.inner = real_open(*args, **kw)

        def __enter__(self) -> Recording:
            self.inner.__enter__()
            return self

        def __exit__(self, *exc: Any) -> None:
            self.inner.__exit__(*exc)

        def keys(self) -> list[str]:
            return list(self.inner.keys())

        def get_tensor(self, key: str) -> torch.Tensor:
            read.append(key)
            return self.inner.get_tensor(key)

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    with caplog.at_level(logging.WARNING):
        model = load_model(engine_config(models[name]), parallel=_ctx(pp_rank=pp_rank, pp_size=2)).model
    assert not [r for r in caplog.records if "unknown" in r.getMessage()]
    layers = {name.split(".")[2] for name in read if name.startswith("model.layers.")}
    others = sorted(name for name in read if not name.startswith("model.layers."))
    assert model.num_layers == 3
    if pp_rank == 0:
        assert model.num_local_layers == 1 and layers == {"0"}
        assert others == ["model.embed_tokens.weight"] and model.norm is None and model.lm_head is None
    else:
        assert model.num_local_layers == 2 and layers == {"1", "2"} and model.embed_tokens is None
        head = "model.embed_tokens.weight" if name == "tied_kv2" else "lm_head.weight"
        assert others == sorted([head, "model.norm.weight"])


def test_micro_batches_are_contiguous_and_even_in_tokens(models: dict[str, Path]) -> None:
    runner = ModelRunner(engine_config(models["untied_kv4"]), load_model(engine_config(models["untied_kv4"])))
    runner.init_kv_cache(NUM_BLOCKS)

    def cut(lens: list[int], k: int) -> list[tuple[int, int]]:
        runner.micro_batches = k
        return runner._micro_batch_ranges([SeqBatchEntry([0] * n, 0, [0], True) for n in lens])  # noqa: SLF001

    assert cut([5, 5, 5, 5], 2) == [(0, 2), (2, 4)]
    assert cut([30, 1, 1, 1, 1], 2) == [(0, 1), (1, 5)]
    assert cut([1, 1, 1, 30], 2) == [(0, 3), (3, 4)]
    assert cut([6, 10, 4], 2) == [(0, 1), (1, 3)]  # 6 | 14 is closer to even than 16 | 4
    assert cut([1, 1], 4) == [(0, 1), (1, 2)]  # at most one micro-batch per entry
    assert cut([8, 8, 8, 8, 8, 8], 3) == [(0, 2), (2, 4), (4, 6)]
    assert cut([3], 2) == [(0, 1)]


@pytest.mark.parametrize(("name", "kw", "layers", "kv_heads"), [
    ("untied_kv4", {"tp_rank": 1, "tp_size": 4}, 3, 1),  # 4 KV heads over 4 ranks
    ("tied_kv2", {"tp_rank": 3, "tp_size": 4}, 3, 1),  # 2 KV heads replicated over 4 ranks
    ("untied_kv4", {"tp_rank": 1, "tp_size": 2, "pp_rank": 1, "pp_size": 2}, 2, 2),
])
def test_a_rank_sizes_its_own_cache(models: dict[str, Path], name: str, kw: dict[str, int], layers: int,
                                    kv_heads: int, caplog: pytest.LogCaptureFixture) -> None:
    config = engine_config(models[name])
    ctx = _ctx(**kw)
    runner = ModelRunner(config, load_model(config, parallel=ctx))
    assert (runner.num_layers, runner.num_kv_heads) == (layers, kv_heads)
    assert runner.kv_bytes_per_block == 2 * layers * config.block_size * kv_heads * 16 * 4
    assert runner._local_inter(4) == 128 // ctx.tp_size  # noqa: SLF001 - the GPU budget's activation width
    with caplog.at_level(logging.INFO, logger="kvpilot.daemon.engine.runner"):
        runner.init_kv_cache(runner.num_blocks_for_budget())
    assert f"rank {ctx.rank} (tp {ctx.tp_rank}/{ctx.tp_size}, pp {ctx.pp_rank}/{ctx.pp_size}) memory budget" \
        in caplog.text
    assert len(runner.k_caches) == len(runner.model.k_caches) == layers
    assert runner.k_caches[0].shape == (NUM_BLOCKS, config.block_size, kv_heads, 16)
