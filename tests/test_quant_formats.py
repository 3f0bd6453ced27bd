"""The test writers and dequantizers of the published quantized layouts (tests/support/quant_formats.py), apart
from kvpilot's methods: small cases checked by hand against the format descriptions, and round trips of random
weights within each format's rounding."""

from __future__ import annotations

import pytest
import torch

from support import quant_formats as qf

# ------------------------------------------------------------------------------------- hand-checked


def test_awq_nibble_order_by_hand() -> None:
    # output column c holds the value c: nibbles 0..7 hold columns 0, 2, 4, 6, 1, 3, 5, 7
    word = 0x75316420
    assert qf.pack_along_last(torch.arange(8)[None], qf.AWQ_NIBBLE_COLUMNS).item() == word
    qweight = torch.full((32, 1), word, dtype=torch.int32)  # every input row alike
    qzeros = torch.tensor([[0x11111111]], dtype=torch.int32)  # zero point 1 for every column
    scales = torch.full((1, 8), 0.5, dtype=torch.float16)
    w = qf.dequant_awq(qweight, qzeros, scales, 32)
    assert w.shape == (8, 32)
    assert w[:, 0].tolist() == [0.5 * (c - 1) for c in range(8)]


def test_gptq_packing_by_hand() -> None:
    # input rows 0..7 hold 1..8 (nibble i = row i); the classic format stores z - 1 = 7, so z = 8
    qweight = torch.tensor([[0x87654321 - 2**32]], dtype=torch.int32)
    v1_zeros = torch.tensor([[0x77777777]], dtype=torch.int32)
    v2_zeros = torch.tensor([[0x88888888 - 2**32]], dtype=torch.int32)
    scales = torch.full((1, 8), 0.5, dtype=torch.float16)
    qweight8 = qweight.expand(1, 8).contiguous()  # 8 output columns alike
    want = [0.5 * (k + 1 - 8) for k in range(8)]
    g_idx = torch.zeros(8, dtype=torch.int32)
    for zeros, v1 in ((v1_zeros, True), (v2_zeros, False)):
        w = qf.dequant_gptq(qweight8, zeros, scales, g_idx, v1=v1)
        assert w.shape == (8, 8) and w[3].tolist() == want


def test_gptq_writer_stores_zero_minus_one_in_the_classic_format() -> None:
    w = torch.randn(16, 64)
    assert bool((qf.gptq(w, 32, sym=True)["qzeros"] == 0x77777777).all())  # z = 8, stored 7
    assert bool((qf.gptq(w, 32, sym=True, v1=False)["qzeros"] == 0x88888888 - 2**32).all())
    asym = qf.gptq(w, 32, sym=False)  # the classic format cannot hold z = 0: it starts at 1
    z = torch.stack([qf.nibble(asym["qzeros"], i) for i in range(8)], -1) + 1
    assert int(z.min()) >= 1


def test_fp8_by_hand() -> None:
    w = torch.tensor([[0.5, -1.0, 0.25], [2.0, 0.0, -0.5]])
    channel = qf.fp8_channel(w)
    assert torch.equal(channel["weight_scale"], torch.tensor([[1.0], [2.0]]) / 448)
    assert channel["weight"].float().tolist() == [[224.0, -448.0, 112.0], [448.0, 0.0, -112.0]]
    assert torch.equal(qf.dequant_fp8(**channel), w)  # every value is exact in e4m3
    tensor = qf.fp8_tensor(w)
    assert tensor["weight_scale"].shape == (1,) and torch.equal(qf.dequant_fp8(**tensor), w)
    block = qf.fp8_block(w, (1, 2))  # [2, 2] scales: row-blocks of 1, column-blocks of 2 (ragged)
    assert block["weight_scale_inv"].mul(448).tolist() == [[1.0, 0.25], [2.0, 0.5]]
    assert torch.equal(qf.dequant_fp8_block(block["weight"], block["weight_scale_inv"], (1, 2)), w)


# --------------------------------------------------------------------------------------- round trips


def _groups_bound(scales: torch.Tensor, group_of_column: torch.Tensor) -> torch.Tensor:
    """One quantization step per weight ``[out, in]``: min-max 4-bit rounding is within half of one, and
    within one where the extreme value is clipped (the zero point is rounded, and GPTQ's symmetric grid
    reaches -8 steps but +7)."""
    return scales.float()[group_of_column.long()].T


@pytest.mark.parametrize("group", [32, 64])
def test_awq_round_trip(group: int) -> None:
    torch.manual_seed(0)
    w = torch.randn(24, 128) * 0.1
    parts = qf.awq_gemm(w, group)
    assert parts["qweight"].shape == (128, 3) and parts["qzeros"].shape == (128 // group, 3)
    assert parts["scales"].shape == (128 // group, 24) and parts["scales"].dtype == torch.float16
    bound = _groups_bound(parts["scales"], torch.arange(128) // group)
    assert bool(((qf.dequant_awq(**parts, group_size=group) - w).abs() <= bound).all())


@pytest.mark.parametrize(("group", "desc_act", "sym", "v1"), [
    (32, False, True, True), (32, True, False, True), (64, True, True, False), (-1, False, False, False)])
def test_gptq_round_trip(group: int, desc_act: bool, sym: bool, v1: bool) -> None:
    torch.manual_seed(1)
    w = torch.randn(16, 128) * 0.1
    parts = qf.gptq(w, group, desc_act=desc_act, sym=sym, v1=v1, seed=3)
    groups = 1 if group == -1 else 128 // group
    assert parts["qweight"].shape == (16, 16) and parts["qzeros"].shape == (groups, 2)
    g_idx = parts["g_idx"]
    assert torch.bincount(g_idx.long()).tolist() == [128 // groups] * groups  # every group full
    assert desc_act == (not torch.equal(g_idx, (torch.arange(128) // (128 // groups)).int()))
    got = qf.dequant_gptq(parts["qweight"], parts["qzeros"], parts["scales"], g_idx, v1=v1)
    assert bool(((got - w).abs() <= _groups_bound(parts["scales"], g_idx)).all())


@pytest.mark.parametrize("fmt", ["channel", "tensor", "block"])
def test_fp8_round_trip(fmt: str) -> None:
    """e4m3 keeps 3 mantissa bits: within 2^-4 of each value, or half the smallest subnormal (2^-10) times the
    scale near zero; nothing saturates, as each scale is its values' amax / 448."""
    torch.manual_seed(2)
    w = torch.randn(72, 80)
    if fmt == "block":
        parts = qf.fp8_block(w, (32, 32))
        got = qf.dequant_fp8_block(parts["weight"], parts["weight_scale_inv"], (32, 32))
        scale = parts["weight_scale_inv"].repeat_interleave(32, 0).repeat_interleave(32, 1)[:72, :80]
    else:
        parts = qf.fp8_channel(w) if fmt == "channel" else qf.fp8_tensor(w)
        got = qf.dequant_fp8(**parts)
        scale = parts["weight_scale"].reshape(-1, 1).expand(72, 80)
    assert parts["weight"].dtype == torch.float8_e4m3fn
    assert float(parts["weight"].float().abs().max()) == 448  # the largest value reaches the top of the range
    assert bool(((got - w).abs() <= w.abs() * 2**-4 + scale * 2**-10).all())


def test_q4_1_view_is_within_the_fp16_rounding_of_m() -> None:
    """``q4_1=True`` holds ``s*q + fp16(-s*z)``: off ``s*(q - z)`` by at most half an fp16 ulp of ``s*z``, and
    exact where z = 8 (a power of two times an fp16 scale)."""
    torch.manual_seed(4)
    w = torch.randn(32, 64) * 0.1
    asym = qf.awq_gemm(w, 32)
    exact, q4_1 = qf.dequant_awq(**asym, group_size=32), qf.dequant_awq(**asym, group_size=32, q4_1=True)
    sz = -qf.dequant_awq(torch.zeros_like(asym["qweight"]), asym["qzeros"], asym["scales"], 32)
    assert bool(((q4_1 - exact).abs() <= sz.abs() * 2**-11 + 2**-25).all())
    assert not torch.equal(q4_1, exact)  # some m did round
    sym = qf.gptq(w, 32, sym=True)
    assert torch.equal(qf.dequant_gptq(**sym, q4_1=True), qf.dequant_gptq(**sym))
