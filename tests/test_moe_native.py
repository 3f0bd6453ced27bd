"""The native MoE kernel (``cpu_native.moe_panels``, csrc/moe_cpu.c): one call for a layer's routed SiLU experts
over panel-packed stacks, against the torch reference ``moe_reference.fused_moe`` on skewed loads, experts with
no tokens, top-k 1/2/8, more rows per expert than one register tile, sizes off the panel width, with and
without expert biases; the same bits whatever the thread count or token chunking; bad expert ids refused; and
``fused_moe_cpu`` taking it for panel-packed experts."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvpilot.kernels import cpu_native, moe, moe_reference

pytestmark = pytest.mark.skipif(cpu_native.panel_gemm_max_rows() == 0, reason="native panel kernel not built")


def _layer(tokens: int, experts: int, k: int, hidden: int, inter: int, bias: bool, seed: int = 0) -> dict[str, Any]:
    """A random layer; routing skewed to the first experts, two (where k leaves room) without tokens."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g) + torch.linspace(3, 0, experts)
    if experts - k >= 2:
        logits[:, [1, experts - 1]] = float("-inf")
    weights, ids = moe.moe_route(logits, k, renormalize=True)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) * inter**-0.5
    return {"x": torch.randn(tokens, hidden, generator=g), "w13": w13, "w2": w2, "weights": weights, "ids": ids,
            "b13": torch.randn(experts, 2 * inter, generator=g) if bias else None,
            "b2": torch.randn(experts, hidden, generator=g) if bias else None, "inter": inter}


def _native(c: dict[str, Any], x: torch.Tensor | None = None) -> torch.Tensor:
    p13 = moe.PackedExperts.pack(c["w13"].clone(), panels=True).panels
    p2 = moe.PackedExperts.pack(c["w2"].clone(), panels=True).panels
    out = cpu_native.moe_panels(c["x"] if x is None else x, p13, p2, c["inter"], c["ids"], c["weights"], c["b13"],
                                c["b2"])
    assert out is not None
    return out


def _reference(c: dict[str, Any]) -> torch.Tensor:
    return moe_reference.fused_moe(c["x"], c["w13"], c["w2"], c["weights"], c["ids"], w13_bias=c["b13"],
                                   w2_bias=c["b2"])


# (tokens, experts, k, hidden, inter): decode rows, a 16-row step, ragged prefills with over 12 rows (one
# register tile) per expert, top-1/2/8, hidden and 2 * inter off the 32-column panel width (padded panels)
SHAPES = [(1, 8, 2, 64, 48), (16, 8, 2, 64, 96), (37, 16, 8, 96, 40), (200, 8, 2, 64, 48), (5, 4, 1, 70, 33),
          (64, 8, 1, 128, 64)]


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize(("tokens", "experts", "k", "hidden", "inter"), SHAPES)
def test_native_moe_matches_the_reference(tokens: int, experts: int, k: int, hidden: int, inter: int,
                                          bias: bool) -> None:
    c = _layer(tokens, experts, k, hidden, inter, bias)
    ref = _reference(c)
    out = _native(c)
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_native_moe_reads_strided_rows_and_writes_every_token() -> None:
    # rows a larger stride apart (a slice of a wider activation), and tokens whose experts are all idle elsewhere
    c = _layer(9, 8, 2, 64, 48, bias=True)
    wide = torch.randn(9, 100)
    wide[:, 10:74] = c["x"]
    torch.testing.assert_close(_native(c, wide[:, 10:74]), _reference(c), atol=2e-5, rtol=2e-5)


def test_native_moe_bits_do_not_depend_on_threads_or_token_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    # threads split the output columns and chunks the tokens: every row's arithmetic is the same either way
    c = _layer(50, 8, 2, 64, 96, bias=True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _native(c)
        torch.set_num_threads(max(2, threads))
        many = _native(c)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)
    per_token = 2 * 4 * (64 + 3 * 96) + 4 * 2
    monkeypatch.setattr(cpu_native, "_MOE_SCRATCH_BYTES", 7 * per_token)  # chunks of 7 tokens
    kernel, calls = cpu_native._row_kernel("moe_panels_f32"), []  # noqa: SLF001
    counting = lambda *a: calls.append(a[2]) or kernel(*a)  # noqa: E731 - the token count of each call
    monkeypatch.setitem(cpu_native._row_fns, "moe_panels_f32", counting)  # noqa: SLF001
    assert torch.equal(_native(c), many)
    assert calls == [7] * 7 + [1]


def test_native_moe_refuses_bad_expert_ids() -> None:
    c = _layer(4, 8, 2, 64, 48, bias=False)
    c["ids"] = c["ids"].clone()
    c["ids"][2, 1] = 8
    with pytest.raises(ValueError, match="expert ids"):
        _native(c)
    c["ids"][2, 1] = -1
    with pytest.raises(ValueError, match="expert ids"):
        _native(c)


def test_native_moe_declines_what_it_does_not_take() -> None:
    c = _layer(4, 8, 2, 64, 48, bias=False)
    p13 = moe.PackedExperts.pack(c["w13"].clone(), panels=True).panels
    p2 = moe.PackedExperts.pack(c["w2"].clone(), panels=True).panels
    args = (p13, p2, 48, c["ids"], c["weights"])
    assert cpu_native.moe_panels(c["x"].bfloat16(), *args) is None  # float32 rows only
    assert cpu_native.moe_panels(c["x"], p13, p2, 40, c["ids"], c["weights"]) is None  # inter does not fit
    assert cpu_native.moe_panels(c["x"], *args[:3], c["ids"].int(), c["weights"]) is None  # int64 ids
    assert cpu_native.moe_panels(c["x"], *args[:4], c["weights"].double()) is None


def test_fused_moe_cpu_takes_the_native_kernel_for_panel_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    c = _layer(16, 8, 2, 64, 96, bias=True)
    w13 = moe.PackedExperts.pack(c["w13"].clone(), panels=True)
    w2 = moe.PackedExperts.pack(c["w2"].clone(), panels=True)
    calls = []
    real = cpu_native.moe_panels

    def counting(*a: Any, **kw: Any) -> torch.Tensor | None:
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(cpu_native, "moe_panels", counting)
    native = moe.fused_moe_cpu(c["x"], w13, w2, c["weights"], c["ids"], w13_bias=c["b13"], w2_bias=c["b2"])
    assert calls == [1]
    # declined, the per-expert loop over the same panels gives the same result
    monkeypatch.setattr(cpu_native, "moe_panels", lambda *_, **__: None)
    loop = moe.fused_moe_cpu(c["x"], w13, w2, c["weights"], c["ids"], w13_bias=c["b13"], w2_bias=c["b2"])
    torch.testing.assert_close(native, loop, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(native, _reference(c), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize(("renormalize", "topk_first"), [(False, False), (True, False), (False, True)],
                         ids=["softmax-topk", "softmax-topk-renormalized", "topk-softmax"])
def test_native_moe_route_matches_the_torch_routing(k: int, renormalize: bool, topk_first: bool) -> None:
    g = torch.Generator().manual_seed(k)
    logits = torch.randn(33, 16, generator=g) * 3
    logits[5, 3] = float("-inf")  # an expert masked out for one token
    got = cpu_native.moe_route(logits, k, renormalize=renormalize, topk_before_softmax=topk_first)
    assert got is not None
    want = moe.moe_route(logits, k, renormalize=renormalize, topk_before_softmax=topk_first)
    assert torch.equal(got[1], want[1])  # the same experts in the same order (no near-ties in these logits)
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
    assert cpu_native.moe_route(logits, 17) is None and cpu_native.moe_route(logits.double(), k) is None


# ------------------------------------------------------------------------------------ GGUF experts


def _gguf_experts(num: int, hidden: int, inter: int, types: tuple[int, int, int], seed: int = 0) -> Any:
    import numpy as np

    from kvpilot.kernels.gguf_moe import GGUFExperts
    from support.gguf_blocks import quantize

    rng = np.random.default_rng(seed)

    def stack(rows: int, cols: int, qtype: int) -> torch.Tensor:
        return torch.from_numpy(np.stack([quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32),
                                                   qtype, rng) for _ in range(num)]))

    experts = GGUFExperts(stack(inter, hidden, types[0]), stack(inter, hidden, types[1]),
                          stack(hidden, inter, types[2]), *types, hidden=hidden, inter=inter)
    experts.check()
    return experts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(("tokens", "num", "k", "types"), [
    (1, 8, 2, (12, 12, 14)), (4, 8, 1, (8, 8, 8)), (8, 16, 8, (2, 6, 3)), (20, 8, 2, (3, 3, 2)),
], ids=["T1-k2-Q4_K|Q6_K", "T4-k1-Q8_0", "T8-k8-Q4_0|Q5_0|Q4_1", "T20-k2-Q4_1|Q4_0"])
def test_native_gguf_moe_matches_the_per_expert_loop(dtype: torch.dtype, tokens: int, num: int, k: int,
                                                     types: tuple[int, int, int],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The one native call (csrc/moe_cpu.c) against fused_moe_gguf's per-expert GEMMs over the same blocks:
    the same GEMM kernel per row, so only the activation's and the sums' rounding may differ."""
    from kvpilot.kernels import gguf, gguf_moe

    if tokens > gguf.NATIVE_MAX_ROWS[dtype]:
        pytest.skip("more rows than the native GGUF GEMM takes in this dtype")
    experts = _gguf_experts(num, 256, 512, types)
    c = _layer(tokens, num, k, 256, 8, bias=False, seed=tokens)  # the routing (skewed, idle experts) and rows
    wide = torch.randn(tokens, 300).to(dtype)
    wide[:, 20:276] = c["x"].to(dtype)
    x = wide[:, 20:276]  # rows a wider stride apart
    calls = []
    real = gguf_moe._native

    def counting(*a: Any) -> torch.Tensor | None:
        calls.append(1)
        return real(*a)

    monkeypatch.setattr(gguf_moe, "_native", counting)
    native = gguf_moe.fused_moe_gguf(x, experts, c["weights"], c["ids"])
    assert calls == [1] and native.dtype is dtype
    monkeypatch.setattr(gguf_moe, "_native", lambda *_: None)
    loop = gguf_moe.fused_moe_gguf(x, experts, c["weights"], c["ids"])
    tol = 1e-5 if dtype is torch.float32 else 1e-2
    torch.testing.assert_close(native.float(), loop.float(), atol=tol, rtol=tol)


def test_native_gguf_moe_refuses_bad_expert_ids() -> None:
    from kvpilot.kernels import gguf_moe

    experts = _gguf_experts(4, 256, 512, (8, 8, 8))
    with pytest.raises(ValueError, match="topk_ids must lie in"):
        gguf_moe.fused_moe_gguf(torch.zeros(2, 256), experts, torch.ones(2, 1), torch.tensor([[1], [4]]))
