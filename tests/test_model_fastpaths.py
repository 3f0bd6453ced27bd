"""The CPU fast paths of the native model give the plain path's numbers: oneDNN-prepacked GEMM weights,
the small-step GEMM over their panel copies, the complex-multiply RoPE on interleaved q/k rows, and the
malloc settings."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from kvpilot.daemon.engine import LLM, host_malloc
from kvpilot.daemon.engine.models import linear as linear_module
from kvpilot.daemon.engine.models import llama
from kvpilot.daemon.engine.models.linear import (
    keep_panels,
    linear,
    prepack,
    prepack_supported,
    small_batch_rows,
)
from kvpilot.daemon.engine.models.llama import _rotate, interleave_rope_rows, rope_inv_freq
from kvpilot.daemon.engine.runner import SeqBatchEntry
from kvpilot.kernels import cpu_native, ops

MODEL = "builtin://smollm2-135m"
needs_onednn = pytest.mark.skipif(not prepack_supported(torch.device("cpu"), torch.float32),
                                  reason="oneDNN is not in this torch build")
needs_native = pytest.mark.skipif(not cpu_native.available(), reason="no C compiler for the native CPU kernels")


@pytest.fixture(autouse=True)
def restore_kernel_settings() -> Iterator[None]:
    """Engines built here configure the kernels' process-wide settings: leave the next test the defaults."""
    before = ops.current()
    yield
    ops.configure(before)


def switch(**changes: object) -> None:
    """Kernel settings for the calls that follow, as an engine with these config fields would put them."""
    ops.configure(replace(ops.current(), **changes))


@needs_onednn
@pytest.mark.parametrize("rows", [1, 7, 96, 300])
def test_prepacked_linear_matches_f_linear(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(960, 576, generator=g) * 0.05
    b = torch.randn(960, generator=g)
    x = torch.randn(rows, 576, generator=g)
    packed = prepack(w)
    assert packed.is_mkldnn
    torch.testing.assert_close(linear(x, packed, b), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
    # a strided input (a column slice, as the model never passes but a caller might) is made contiguous
    wide = torch.randn(rows, 1152, generator=g)
    torch.testing.assert_close(linear(wide[:, :576], packed), wide[:, :576] @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not prepack_supported(torch.device("cpu"), torch.bfloat16),
                    reason="oneDNN has no bfloat16 kernels for this CPU")
@pytest.mark.parametrize("rows", [1, 96, 300])
def test_prepacked_bfloat16_linear_matches_f_linear(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(960, 576, generator=g) * 0.05).bfloat16()
    x = torch.randn(rows, 576, generator=g).bfloat16()
    residual = torch.randn(rows, 960, generator=g).bfloat16()
    packed = prepack(w)
    assert packed.is_mkldnn
    plain = torch.nn.functional.linear(x, w)
    got = linear(x, packed)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, plain, rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(linear(x, packed, residual=residual), residual + plain, rtol=1.6e-2, atol=2e-2)


def test_prepack_is_off_where_unsupported() -> None:
    # bfloat16 only where oneDNN has bfloat16 kernels for this CPU
    assert prepack_supported(torch.device("cpu"), torch.bfloat16) == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert not prepack_supported(torch.device("cpu"), torch.float16)
    assert not prepack_supported(torch.device("cuda"), torch.float32)
    switch(prepack_weights=False)
    assert not prepack_supported(torch.device("cpu"), torch.float32)


def test_interleaved_rope_keeps_scores_and_values() -> None:
    """The complex RoPE on permuted rows is HF's rotate_half up to that permutation, so q.k is unchanged."""
    t, heads, hd = 37, 5, 64

    class Cfg:
        rope_theta = 10000.0
        max_position_embeddings = 512

    inv_freq, _ = rope_inv_freq(Cfg(), hd, 512)
    pos = torch.randint(0, 512, (t,))
    freqs = pos[:, None].float() * inv_freq[None, :]
    cos, sin = freqs.cos()[:, None], freqs.sin()[:, None]
    cis = torch.polar(torch.ones_like(freqs), freqs)[:, None]

    hf_rows = torch.randn(t, heads * hd)
    hf = _rotate(hf_rows, t, heads, hd, cos, sin)
    perm = interleave_rope_rows(torch.arange(heads * hd), hd)  # what load_weights does to q/k rows
    fast = _rotate(hf_rows[:, perm].contiguous(), t, heads, hd, cis, None)

    torch.testing.assert_close(fast.reshape(t, heads * hd), hf.reshape(t, heads * hd)[:, perm], rtol=1e-5, atol=1e-5)
    scores_hf = torch.einsum("thd,shd->hts", hf, hf)
    scores_fast = torch.einsum("thd,shd->hts", fast, fast)
    torch.testing.assert_close(scores_fast, scores_hf, rtol=1e-4, atol=1e-4)


def test_interleave_rope_rows_is_a_per_head_permutation() -> None:
    rows = interleave_rope_rows(torch.arange(2 * 8), 8)
    assert rows.tolist() == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]
    bias_and_weight = interleave_rope_rows(torch.arange(16 * 3).view(16, 3), 8)
    assert bias_and_weight[:, 0].tolist() == [3 * r for r in rows.tolist()]


@pytest.mark.parametrize("interleaved", [False, True], ids=["two_halves", "interleaved"])
def test_partial_rotation_is_hfs_in_both_layouts(interleaved: bool) -> None:
    """RoPE over the first 12 of 16 dims (Phi-4-mini's 3/4): the model's q/k dim order and its tables padded with
    cos 1, sin 0 rotate whole heads and give HF's partial rotation, the passed dims untouched."""
    from kvpilot.daemon.engine.models.rope import permute_rope_rows, rope_dim_order

    t, heads, hd, rot = 5, 3, 16, 12
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot, 2).float() / rot))
    freqs = torch.randint(0, 300, (t,))[:, None].float() * inv_freq[None, :]
    x = torch.randn(t, heads, hd)
    # HF's apply_rotary_pos_emb with cos/sin of rot dims: rotate_half on x[..., :rot], x[..., rot:] passed
    cos, sin = torch.cat([freqs.cos()] * 2, -1)[:, None], torch.cat([freqs.sin()] * 2, -1)[:, None]
    x_rot = x[..., :rot]
    half = torch.cat([-x_rot[..., rot // 2:], x_rot[..., : rot // 2]], -1)
    hf = torch.cat([x_rot * cos + half * sin, x[..., rot:]], -1)

    order = rope_dim_order(hd, rot, interleaved)
    rows = permute_rope_rows(torch.arange(heads * hd), hd, order)
    kept = x.reshape(t, heads * hd)[:, rows].contiguous()
    passed = torch.zeros(t, (hd - rot) // 2)
    if interleaved:
        cis = torch.cat([torch.polar(torch.ones_like(freqs), freqs), torch.polar(torch.ones_like(passed), passed)], 1)
        ours = _rotate(kept, t, heads, hd, cis[:, None], None)
    else:
        ours = _rotate(kept, t, heads, hd, torch.cat([freqs.cos(), passed + 1], 1)[:, None],
                       torch.cat([freqs.sin(), passed], 1)[:, None])
    torch.testing.assert_close(ours.reshape(t, heads * hd), hf.reshape(t, heads * hd)[:, rows], rtol=1e-5, atol=1e-5)
    assert torch.equal(ours.reshape(t, heads * hd)[:, rows.argsort()].view(t, heads, hd)[..., rot:], x[..., rot:])


def _logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    entry = SeqBatchEntry(token_ids=prompt, start_pos=0, block_table=list(range(-(-len(prompt) // 16))),
                          compute_logits=True)
    return llm.engine.runner.execute([entry])[0]


@needs_onednn
def test_prepacked_model_matches_dense_model() -> None:
    # a step above the panels' row limit: oneDNN's packed weights compute it, with the panels kept beside
    # them (written into the dense weights' memory after oneDNN took its copy, which this checks too)
    prompt = [(31 * i + 7) % 40000 + 100 for i in range(small_batch_rows() + 20)]
    packed = LLM(model=MODEL, dtype="float32", quantization="none", max_model_len=1024, small_batch_gemm=cpu_native.available() or None)
    model = packed.engine.runner.model
    assert model.prepacked and model.lm_head.is_mkldnn and model.layers[0].gate_up_proj.weight.is_mkldnn
    assert (model.layers[0].gate_up_proj.panels is not None) == cpu_native.available()
    fast = _logits(packed, prompt)
    del packed
    dense = LLM(model=MODEL, dtype="float32", quantization="none", max_model_len=1024, prepack_weights=False)
    assert not dense.engine.runner.model.prepacked
    torch.testing.assert_close(fast, _logits(dense, prompt), rtol=1e-4, atol=1e-4)
    with pytest.raises(RuntimeError, match="prepacked"):
        model.load_weights([])


@needs_onednn
@needs_native
def test_small_steps_use_the_panels_and_match_the_dense_model(monkeypatch: pytest.MonkeyPatch) -> None:
    assert small_batch_rows() in (64, 512)  # what the build's instruction set picks (AVX2, AVX-512)
    prompt = [(17 * i + 3) % 40000 + 100 for i in range(11)]  # one step of 11 rows: the panels' range
    both = LLM(model=MODEL, dtype="float32", quantization="none", max_model_len=256, small_batch_gemm=True)
    model = both.engine.runner.model
    layer = model.layers[0]
    assert layer.gate_up_proj.weight.is_mkldnn and layer.gate_up_proj.panels is not None
    assert layer.gate_up_proj.panels.shape == (-(-layer.gate_up_proj.weight.shape[0] // 32), 576, 32)
    assert model.lm_head_panels is not None and model.lm_head_panels.shape[0] == -(-model.vocab_size // 32)
    calls: list[int] = []
    real = ops.panel_gemm

    def counted(x: torch.Tensor, *args: object, **kw: object) -> torch.Tensor | None:
        calls.append(x.shape[0])
        return real(x, *args, **kw)

    monkeypatch.setattr(linear_module.ops, "panel_gemm", counted)
    small = _logits(both, prompt)
    # 4 GEMMs in each of 30 layers at 11 rows, the last layer's after attention and the LM head at the 1 sampled row
    assert calls.count(11) == 4 * 29 + 1 and calls.count(1) == 4
    with_panels = both.engine.runner.weight_bytes
    del both
    monkeypatch.setattr(linear_module.ops, "panel_gemm", real)
    dense = LLM(model=MODEL, dtype="float32", quantization="none", max_model_len=256, prepack_weights=False)
    torch.testing.assert_close(small, _logits(dense, prompt), rtol=1e-4, atol=1e-4)
    del dense
    packed_only = LLM(model=MODEL, dtype="float32", quantization="none", max_model_len=256, small_batch_gemm=False)
    model = packed_only.engine.runner.model
    assert model.layers[0].gate_up_proj.panels is None and model.lm_head_panels is None
    # the panels are counted in the weights the memory budget reports: every GEMM weight and the LM head
    gemm_bytes = sum(layer.gemm_weight_bytes() for layer in model.layers) + model.embed_tokens.numel() * 4
    assert with_panels - packed_only.engine.runner.weight_bytes == pytest.approx(gemm_bytes, rel=0.05)


@needs_native
def test_panels_are_kept_only_within_the_memory_share() -> None:
    switch(small_batch_gemm=None)
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert keep_panels(physical // 20) is True
    assert keep_panels(physical // 5) is False
    switch(small_batch_gemm=True)
    assert keep_panels(physical) is True
    switch(small_batch_gemm=False)
    assert keep_panels(0) is False


def test_malloc_settings_apply_once(monkeypatch: pytest.MonkeyPatch) -> None:
    assert host_malloc.keep_freed_memory() is True  # glibc on every machine this project supports
    assert host_malloc.keep_freed_memory() is True  # idempotent
    monkeypatch.setattr(host_malloc, "_done", False)
    assert host_malloc.keep_freed_memory(enabled=False) is False


def test_large_logits_reuse_one_buffer_and_match_a_plain_lm_head() -> None:
    llm = LLM(model=MODEL, dtype="float32", quantization="none", max_model_len=256, num_kv_blocks=32)
    model = llm.engine.runner.model
    rows_over_32mib = (32 << 20) // (4 * model.vocab_size) + 30  # 200 rows of SmolLM2's 49152 ids
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(rows_over_32mib, model.hidden_size, generator=g)
    first = model.compute_logits(hidden)
    expected = linear(hidden, model.lm_head, None, model.lm_head_panels)
    assert first.shape == (rows_over_32mib, model.vocab_size) and first.dtype == torch.float32
    torch.testing.assert_close(first, expected, rtol=1e-5, atol=1e-5)
    # the next large step writes into the same memory: no fresh 38 MB mapping to fault in
    second = model.compute_logits(hidden[:-10])
    assert second.data_ptr() == first.data_ptr()
    torch.testing.assert_close(second, expected[:-10], rtol=1e-5, atol=1e-5)
    # with the head's panels, one panel GEMM writes the whole buffer: the head's weights are read once, not
    # once per slice
    if model.lm_head_panels is not None:
        calls = []
        plain = ops.panel_gemm
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ops, "panel_gemm", lambda *a, **k: calls.append(k.get("out")) or plain(*a, **k))
            third = model.compute_logits(hidden)
        assert len(calls) == 1 and calls[0] is not None and third.data_ptr() == first.data_ptr()
        torch.testing.assert_close(third, expected, rtol=1e-5, atol=1e-5)
    # small steps stay fresh tensors: a caller may keep those
    small = model.compute_logits(hidden[:4])
    assert small.data_ptr() != first.data_ptr()
    torch.testing.assert_close(small, expected[:4], rtol=1e-5, atol=1e-5)


def test_the_mlp_in_row_slices_gives_the_same_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(model=MODEL, dtype="float32", quantization="none", max_model_len=256, num_kv_blocks=32)
    runner = llm.engine.runner
    lengths = (9, 7, 11)
    entries = [SeqBatchEntry(token_ids=[(13 * i + 7 * s) % 40000 + 100 for i in range(n)], start_pos=0,
                             block_table=[s], compute_logits=True) for s, n in enumerate(lengths)]
    whole = runner.execute(entries).clone()
    calls: list[int] = []
    real_mlp = llama.LlamaDecoderLayer._mlp

    def counted(self: llama.LlamaDecoderLayer, h: torch.Tensor, lora: object = None) -> torch.Tensor:
        calls.append(h.shape[0])
        return real_mlp(self, h, lora)

    monkeypatch.setattr(llama.LlamaDecoderLayer, "_mlp", counted)
    inter = runner.model.layers[0].local_inter
    # "within malloc's reach" shrunk to 5 rows of gate|up output: the 27 rows go in 6 slices of 5 or fewer
    monkeypatch.setattr(host_malloc, "MMAP_THRESHOLD_MAX", 5 * 2 * inter * 4)
    sliced = runner.execute(entries)
    layers = len(runner.model.layers)
    # the last layer runs its MLP on the 3 sampled rows only: one slice there
    assert calls == [5, 5, 5, 5, 5, 2] * (layers - 1) + [3]
    torch.testing.assert_close(sliced, whole, rtol=1e-5, atol=1e-5)
