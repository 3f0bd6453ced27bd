"""The MoE layer on GGUF expert blocks (``kernels.gguf_moe``) against the torch reference on the same weights
dequantized: uneven loads, experts with no tokens, top-k of 1, 2 and 8, mixed block types, float32 and
bfloat16, the native CPU GEMM and the torch reference GEMM (the Triton one under the interpreter is
``test_gguf_kernels``'s)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvpilot.kernels import gguf, moe_reference, ops
from kvpilot.kernels.gguf_moe import GGUFExperts, fused_moe_gguf
from kvpilot.kernels.settings import KernelSettings
from support.gguf_blocks import quantize

H, INTER = 256, 512  # multiples of 256: every type, the K-quants included


@pytest.fixture(params=["cpu", "torch"])
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    before = ops.current()
    ops.configure(KernelSettings(attention_backend=request.param))
    if request.param == "cpu" and gguf.backend_for(torch.empty(1)) != "cpu":
        ops.configure(before)
        pytest.skip("native CPU kernels not built")
    yield request.param
    ops.configure(before)


def _experts(num: int, types: tuple[int, int, int], seed: int = 0) -> GGUFExperts:
    rng = np.random.default_rng(seed)

    def stack(rows: int, cols: int, qtype: int) -> torch.Tensor:
        return torch.from_numpy(np.stack([quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32),
                                                   qtype, rng) for _ in range(num)]))

    return GGUFExperts(stack(INTER, H, types[0]), stack(INTER, H, types[1]), stack(H, INTER, types[2]), *types,
                       hidden=H, inter=INTER)


def _route(tokens: int, num: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, num, generator=gen)
    logits[:, 0] += 3.0  # uneven: expert 0 takes most tokens
    if num > k + 1:
        logits[:, -1] -= 100.0  # and the last none
    return ops.moe_route(logits, k, renormalize=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(("tokens", "num", "k", "types"), [
    (1, 8, 2, (3, 3, 3)), (5, 8, 1, (8, 8, 8)), (37, 8, 2, (12, 12, 14)), (19, 16, 8, (2, 6, 3)),
], ids=["T1-k2-Q4_1", "T5-k1-Q8_0", "T37-k2-Q4_K|Q6_K", "T19-k8-Q4_0|Q5_0|Q4_1"])
def test_matches_the_reference_on_dequantized_weights(backend: str, dtype: torch.dtype, tokens: int, num: int,
                                                      k: int, types: tuple[int, int, int]) -> None:
    experts = _experts(num, types)
    experts.check()
    weights, ids = _route(tokens, num, k, seed=tokens)
    if num > k + 1:
        assert not (ids == num - 1).any()  # an expert with no tokens
    hidden = (torch.randn(tokens, H, generator=torch.Generator().manual_seed(1))).to(dtype)
    w13, w2 = experts.dequantized(dtype)
    want = moe_reference.fused_moe(hidden, w13, w2, weights, ids)
    got = fused_moe_gguf(hidden, experts, weights, ids)
    assert got.dtype is dtype and got.shape == hidden.shape
    # float32: summation order only; bfloat16: gate|up and the activation rounded to bfloat16 on both sides, from
    # products summed in another order (a few bfloat16 ulps of outputs around 1)
    tol = 2e-4 if dtype is torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_bad_blocks_are_named() -> None:
    experts = _experts(2, (3, 3, 3))
    short = GGUFExperts(experts.gate[:, :, :-20], experts.up, experts.down, 3, 3, 3, hidden=H, inter=INTER)
    with pytest.raises(ValueError, match=r"gate experts must be uint8 \[2, 512, 160\]"):
        short.check()
    with pytest.raises(ValueError, match="GGML type 99"):
        GGUFExperts(experts.gate, experts.up, experts.down, 3, 99, 3, hidden=H, inter=INTER).check()
    with pytest.raises(ValueError, match="topk_ids must lie in"):
        fused_moe_gguf(torch.zeros(1, H), experts, torch.ones(1, 1), torch.full((1, 1), 5))
