"""FP8 weights times 16/32-bit activations in Triton (W8A16, CUDA path; tests run it under TRITON_INTERPRET=1).

Same contract as ``fp8_reference.block_linear``: each program loads a tile of e4m3 weight rows, scales it by
the rows' scale for that column block (``scale[scale_row[n], k // block_k]``) in float32, and multiplies it
with the activations in their dtype, summing in float32. The weight stays 1 byte an element in memory, which
is what a decode step reads. Bias and residual are added by torch after (the product is rounded to the
activation dtype first, as the reference does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_dot import INTERPRET, dot_precision

__all__ = ["block_linear", "tile_k"]

# one tile configuration for the GPU and the interpreter, so that the tests cover what the GPU runs
_BLOCK_N = 64


def tile_k(block_k: int) -> int | None:
    """The K tile: the largest of 64, 32, 16 that divides the scale blocks' width, so one scale column
    covers a whole tile; None where none does (the caller falls back)."""
    return next((t for t in (64, 32, 16) if block_k % t == 0), None)


@triton.jit
def _w8a16_kernel(
    x_ptr, w_ptr, s_ptr, srow_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_sm, stride_ym,
    QBLOCK_K: tl.constexpr,  # columns per scale column; a multiple of BLOCK_K
    HAS_SROW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter only: its tl.dot mishandles bf16, so feed it fp32
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    if HAS_SROW:  # noqa: SIM108 - a constexpr branch, which Triton compiles away
        srow = tl.load(srow_ptr + rn, mask=n_mask, other=0).to(tl.int64)
    else:
        srow = rn.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_mask = kk < K
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + kk[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + kk[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        s = tl.load(s_ptr + srow * stride_sm + k0 // QBLOCK_K, mask=n_mask, other=0.0)
        wd = w.to(tl.float32) * s[:, None]
        if UPCAST:
            x = x.to(tl.float32)
        else:
            wd = wd.to(x.dtype)
        acc = tl.dot(x, tl.trans(wd), acc, input_precision=DOT_PRECISION)
    tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])




def block_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scale_row: torch.Tensor | None,
                 block_k: int, bias: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """``fp8_reference.block_linear`` in one launch; ``block_k`` must have a ``tile_k``."""
    bk = tile_k(block_k)
    if bk is None:
        raise ValueError(f"scale blocks of {block_k} columns are not a multiple of 16")
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], weight.shape[0]
    weight, scale = weight.contiguous(), scale.float().contiguous()
    srow = scale_row.to(torch.int32).contiguous() if scale_row is not None else None
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 64  # decode steps: few rows, a narrow tile wastes less
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, _BLOCK_N))
    _w8a16_kernel[grid](
        x2, weight, scale, srow if srow is not None else scale, y,
        m, n, k,
        x2.stride(0), weight.stride(0), scale.stride(0), y.stride(0),
        QBLOCK_K=block_k, HAS_SROW=srow is not None, DOT_PRECISION=dot_precision(x2),
        UPCAST=INTERPRET and x.dtype == torch.bfloat16,
        BLOCK_M=block_m, BLOCK_N=_BLOCK_N, BLOCK_K=bk,
    )
    y = y.reshape(*x.shape[:-1], n)
    if bias is not None:
        y = y + bias
    return y if residual is None else residual + y
