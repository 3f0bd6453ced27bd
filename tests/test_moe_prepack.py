"""Prepacked expert weights on the CPU (``kernels.moe.PackedExperts``, ``MoEBlock.prepack_experts``):
``fused_moe_cpu`` over packed stacks (panels for float32, oneDNN-packed weights otherwise) against the torch
reference ``moe_reference.fused_moe`` on skewed loads, idle experts, top-k 1/2/8, with and without expert
biases (gpt-oss's clamped SwiGLU), in float32 and bfloat16; the packing keeps one copy of the experts; and
the engine with packed experts still matches HF transformers (tests/test_model_moe.py's tiny models)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvpilot.daemon.engine import LLM, SamplingParams
from kvpilot.daemon.engine.models import decoder as decoder_mod
from kvpilot.kernels import cpu_native, moe, moe_reference
from kvpilot.kernels.moe import onednn_pack_supported
from support.hf_parity import ATOL, max_logprob_error, tiny_models, token_prompts

H = 64
# 2 * 96 is a multiple of the panel width (panels go over the dense memory); 2 * 40 is not (padded panels)
INTERS = (96, 40)
LAYOUTS = ("panels", "onednn")
needs_panels = pytest.mark.skipif(cpu_native.panel_gemm_max_rows() == 0, reason="native panel kernel not built")


def _onednn(dtype: torch.dtype) -> bool:
    return moe.onednn_pack_supported(dtype)


def _case(tokens: int, experts: int, k: int, dtype: torch.dtype, act: str, bias: bool, inter: int,
          seed: int = 0) -> dict[str, Any]:
    """A random layer and skewed routing: the first experts draw most tokens, two (where k leaves room) none."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g) + torch.linspace(3, 0, experts)
    if experts - k >= 2:
        logits[:, [1, experts - 1]] = float("-inf")
    weights, ids = moe.moe_route(logits, k, renormalize=True)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    return {"hidden": rnd(tokens, H), "w13": rnd(experts, 2 * inter, H, scale=0.5),
            "w2": rnd(experts, H, inter, scale=inter**-0.5), "weights": weights, "ids": ids, "act": act,
            "b13": rnd(experts, 2 * inter, scale=2.0) if bias else None, "b2": rnd(experts, H) if bias else None}


def _run(fn: Callable[..., torch.Tensor], c: dict[str, Any], w13: Any, w2: Any) -> torch.Tensor:
    return fn(c["hidden"], w13, w2, c["weights"], c["ids"], activation=c["act"], w13_bias=c["b13"], w2_bias=c["b2"])


def _pack(w: torch.Tensor, layout: str) -> moe.PackedExperts:
    packed = moe.PackedExperts.pack(w.clone(), panels=layout == "panels")
    assert (packed.panels is not None) == (layout == "panels")  # the layout asked for is the one tested
    return packed


# (tokens, experts, k): decode, ragged prefill, top-1/2/8, E=8 and 16; 600 x top-8 of 16 puts over 512 rows on
# the busiest experts, more than one panel run (panel_gemm_max_rows is 512 with AVX-512, 64 with AVX2)
SHAPES = [(1, 8, 1), (1, 8, 2), (1, 16, 8), (16, 8, 2), (37, 16, 8), (37, 16, 1), (600, 16, 8)]
VARIANTS = [("silu", False), ("silu", True), ("gpt_oss", True), ("gpt_oss", False)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(("act", "bias"), VARIANTS, ids=[f"{a}{'-bias' if b else ''}" for a, b in VARIANTS])
@pytest.mark.parametrize(("tokens", "experts", "k"), SHAPES, ids=[f"T{t}-E{e}-k{k}" for t, e, k in SHAPES])
@pytest.mark.parametrize("inter", INTERS)
def test_packed_experts_match_the_reference(layout, dtype, act, bias, tokens, experts, k, inter):
    if layout == "panels" and (dtype != torch.float32 or cpu_native.panel_gemm_max_rows() == 0):
        pytest.skip("panels are float32 with the native kernel")
    if layout == "onednn" and not _onednn(dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} on this CPU")
    c = _case(tokens, experts, k, dtype, act, bias, inter)
    loads = torch.bincount(c["ids"].reshape(-1), minlength=experts)
    assert (experts - k < 2 or (loads == 0).sum() >= 2) and (tokens < 16 or loads.max() > loads[loads > 0].min())
    assert tokens < 600 or loads.max() > 512
    want = _run(moe_reference.fused_moe, c, c["w13"], c["w2"]).double()
    got = _run(moe.fused_moe_cpu, c, _pack(c["w13"], layout), _pack(c["w2"], layout))
    assert got.dtype == dtype and got.shape == want.shape
    scale = max(float(want.abs().max()), 1.0)
    # float32: another order of the same products; bfloat16: two roundings of gate|up/activation apart
    tol = (2e-5 if dtype == torch.float32 else 2e-2) * scale
    err = float((got.double() - want).abs().max())
    assert err <= tol, f"max |diff| {err:.3g} > {tol:.3g}"


@needs_panels
def test_panels_go_over_the_dense_stack_and_onednn_replaces_it():
    """One copy of the experts: panels are written into the dense stack's own memory where the sizes allow;
    oneDNN-packed experts are their own tensors (the dense stack is dropped by the block)."""
    w = torch.randn(4, 96, H)
    dense = w.clone()
    packed = moe.PackedExperts.pack(w, panels=True)
    assert packed.panels is not None and packed.panels.data_ptr() == w.data_ptr()
    assert packed.panels.numel() == w.numel() and packed.shape == w.shape and packed.dim() == 3
    for e in range(4):  # each expert's panels are pack_panels of its own weight
        assert torch.equal(packed.panels[e], cpu_native.pack_panels(dense[e]))
    padded = moe.PackedExperts.pack(torch.randn(4, 80, H), panels=True)
    assert padded.panels is not None and padded.panels.shape[1] == 3  # 80 rows in 3 panels of 32
    one = moe.PackedExperts.pack(torch.randn(4, 96, H), panels=False)
    assert one.panels is None and len(one.packed) == 4 and all(t.is_mkldnn for t in one.packed)


def test_bad_input_to_packed_experts_is_refused():
    c = _case(4, 8, 2, torch.float32, "silu", False, 96)
    p13 = moe.PackedExperts.pack(c["w13"].clone(), panels=False)
    p2 = moe.PackedExperts.pack(c["w2"].clone(), panels=False)
    with pytest.raises(ValueError, match="weights do not fit"):
        moe.fused_moe_cpu(c["hidden"][:, :32], p13, p2, c["weights"], c["ids"])
    with pytest.raises(ValueError, match="topk_ids must lie"):
        moe.fused_moe_cpu(c["hidden"], p13, p2, c["weights"], c["ids"] + 8)
    with pytest.raises(ValueError, match="hidden dtype"):
        moe.fused_moe_cpu(c["hidden"].bfloat16(), p13, p2, c["weights"], c["ids"])


# ------------------------------------------------------------------------------------------ the engine

TINY = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "initializer_range": 0.08, "pad_token_id": 0,
        "bos_token_id": 1, "eos_token_id": 2, "num_experts_per_tok": 2}


def _configs() -> dict[str, Callable[[], tuple[Any, type]]]:
    import transformers as tf

    return {
        "mixtral": lambda: (tf.MixtralConfig(**TINY, num_hidden_layers=2, intermediate_size=32, num_local_experts=8),
                            tf.MixtralForCausalLM),
        "qwen3_moe": lambda: (tf.Qwen3MoeConfig(**TINY, num_hidden_layers=2, intermediate_size=48,
                                                moe_intermediate_size=32, num_experts=8, norm_topk_prob=True),
                              tf.Qwen3MoeForCausalLM),
        # expert biases and a SwiGLU limit low enough that the activations are clamped
        "gpt_oss": lambda: (tf.GptOssConfig(**TINY, num_hidden_layers=2, intermediate_size=32, num_local_experts=8,
                                            layer_types=["sliding_attention", "full_attention"], sliding_window=32,
                                            swiglu_limit=0.3), tf.GptOssForCausalLM),
    }


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Any]]:
    return tiny_models(tmp_path_factory.mktemp, _configs, lambda n: n.endswith("bias") or "norm" in n
                       or n.endswith(("sinks", "gate.weight", "router.weight")))


@pytest.fixture
def packing_layers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Decoder layers that also pack float32 experts (the decoder packs bfloat16 ones only)."""
    real = decoder_mod.DecoderLayer.prepack_weights

    def prepack_weights(self: Any, keep_panels: bool = False) -> None:
        real(self, keep_panels=keep_panels)
        if self.moe is not None:
            self.moe.prepack_experts(keep_panels=keep_panels, force_float32=True)

    monkeypatch.setattr(decoder_mod.DecoderLayer, "prepack_weights", prepack_weights)
    yield


@pytest.mark.parametrize("name", list(_configs()))
@pytest.mark.parametrize("panels", [True, False], ids=["panels", "onednn"])
def test_engine_with_packed_experts_matches_hf(name: str, panels: bool, tiny: Callable[[str], tuple[Path, Any]],
                                                packing_layers: None) -> None:
    if panels and cpu_native.panel_gemm_max_rows() == 0:
        pytest.skip("native panel kernel not built")
    folder, hf = tiny(name)
    llm = LLM(model=str(folder), dtype="float32", num_kv_blocks=64, max_model_len=256, small_batch_gemm=panels)
    blocks = [layer.moe for layer in llm.engine.runner.model.layers if layer.moe is not None]
    assert blocks and all(b.experts_packed for b in blocks)
    assert all((b.w13.panels is not None) == panels and (b.w2.panels is not None) == panels for b in blocks)
    assert "w13" not in dict(blocks[0].named_parameters(recurse=False))  # the dense stacks are gone
    gen = torch.Generator().manual_seed(3)
    # decode steps (one token: two experts busy) and batched prefills where some experts get no tokens
    prompts = token_prompts() + [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (2, 60)]
    worst = max_logprob_error(llm, hf, prompts, steps=6)
    print(f"{name} ({'panels' if panels else 'oneDNN'}): max |logprob - HF| = {worst:.2e}")
    assert worst < ATOL


def _ranks(tp: int) -> list[Any]:
    from kvpilot.daemon.engine.models.parallel import ParallelContext

    class NoReduce(ParallelContext):
        def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
            return x

    return [NoReduce(tp_rank=r, tp_size=tp, tp_group="test") for r in range(tp)]


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("panels", [True, False], ids=["panels", "onednn"])
def test_tensor_parallel_slices_pack_and_sum_to_one_rank(name: str, panels: bool,
                                                         tiny: Callable[[str], tuple[Path, Any]]) -> None:
    """Each rank loads its slice of every expert (before packing, as the loader does), packs it, and the ranks'
    partial outputs sum to the one-rank block on the dense reference path (gpt-oss: expert biases, the down
    bias added by rank 0 only)."""
    from kvpilot.daemon.engine.models.archs import gpt_oss_spec, qwen3_moe_spec
    from kvpilot.daemon.engine.models.moe import MoEBlock

    if panels and cpu_native.panel_gemm_max_rows() == 0:
        pytest.skip("native panel kernel not built")
    _, hf = tiny(name)
    spec = (qwen3_moe_spec if name == "qwen3_moe" else gpt_oss_spec)(hf.config)
    prefix = "model.layers.0."
    tensors = {k[len(prefix):]: v for k, v in hf.state_dict().items() if k.startswith(prefix)}

    def block(parallel: Any = None) -> MoEBlock:
        b = MoEBlock(spec, dtype=torch.float32, device=torch.device("cpu"),
                     **({} if parallel is None else {"parallel": parallel}))
        covered = set()
        for rel, w in tensors.items():
            covered |= set(b.load(rel, w))
        assert covered == b.expected_names()
        return b

    one = block()
    x = torch.randn(23, spec.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = moe_reference_block_output(one, x)
        parts = []
        for ctx in _ranks(2):
            b = block(ctx)
            assert b.local_inter == one.local_inter // 2
            assert b.prepack_experts(keep_panels=panels, force_float32=True) and (b.w13.panels is not None) == panels
            with pytest.raises(RuntimeError, match="after prepack_experts"):
                b.load(next(k for k in tensors if ".experts." in k), next(v for k, v in tensors.items()
                                                                         if ".experts." in k))
            parts.append(b(x))
    torch.testing.assert_close(parts[0] + parts[1], want, rtol=1e-5, atol=1e-5)


def moe_reference_block_output(block: Any, x: torch.Tensor) -> torch.Tensor:
    """The block's output with the experts on the torch reference path (dense stacks, no packing)."""
    from kvpilot.kernels import ops

    moe_spec = block.moe
    weights, ids = ops.moe_route(block.router(x), moe_spec.top_k, renormalize=moe_spec.renormalize,
                                 topk_before_softmax=moe_spec.routing == "topk_softmax")
    return moe_reference.fused_moe(x, block.w13, block.w2, weights, ids, activation=moe_spec.activation,
                                   w13_bias=block.w13_bias, w2_bias=block.w2_bias, swiglu_alpha=moe_spec.swiglu_alpha,
                                   swiglu_limit=moe_spec.swiglu_limit)


@pytest.mark.parametrize(("name", "dtype", "small_batch_gemm", "layout"), [
    ("mixtral", "bfloat16", None, "onednn"),
    ("mixtral", "float32", None, "panels"),  # SiLU experts: the native MoE kernel's panels
    ("qwen3_moe", "float32", None, "panels"),
    ("mixtral", "float32", False, "dense"),  # the panel kernels turned off
    ("gpt_oss", "float32", None, "dense"),  # a clamped SwiGLU: the torch path over dense stacks
])
def test_the_decoder_packs_experts_where_a_kernel_gains(name: str, dtype: str, small_batch_gemm: bool | None,
                                                        layout: str, tiny: Callable[[str], tuple[Path, Any]]) -> None:
    if layout == "onednn" and not onednn_pack_supported(torch.bfloat16):
        pytest.skip("oneDNN cannot pack bfloat16 weights on this CPU")
    if layout == "panels" and cpu_native.panel_gemm_max_rows() == 0:
        pytest.skip("native panel kernel not built")
    folder, _ = tiny(name)
    llm = LLM(model=str(folder), dtype=dtype, num_kv_blocks=16, max_model_len=64, small_batch_gemm=small_batch_gemm)
    blocks = [layer.moe for layer in llm.engine.runner.model.layers if layer.moe is not None]
    assert blocks and all(b.experts_packed == (layout != "dense") for b in blocks)
    if layout != "dense":
        assert all((b.w13.panels is not None) == (layout == "panels") for b in blocks)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=3),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
