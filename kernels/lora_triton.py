"""The batched LoRA in Triton (CUDA path; tests run it under TRITON_INTERPRET=1): the punica/SGMV shrink and
expand, same contract as ``lora.lora_shrink_expand``.

1. shrink: ``t = x @ lora_a[slot].T`` per segment, a program per (segment, BLOCK_M rows, BLOCK_R ranks), stored
   in x's dtype (rounded there, as the reference's shrink GEMM rounds it);
2. expand: ``y += t @ lora_b[slot].T``, a program per (segment, BLOCK_M rows, BLOCK_N outputs), summed in
   float32 with y's old value and stored once in y's dtype.

Each program reads its segment's slot and bounds from the int32 device copies of the segment table
(``LoRASegments.device_tables``, made once per batch): base segments (slot -1) and row blocks past their segment's
end return at once. The grid is sized on the host from the table (segments x the longest segment's row blocks),
never by a device read. Importing this module imports triton; ``kvpilot.kernels.lora`` does so on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from .triton_dot import INTERPRET, dot_precision

if TYPE_CHECKING:  # lora imports this module on first use
    from .lora import LoRASegments

__all__ = ["lora_shrink_expand"]

# One tile configuration for the GPU and the interpreter, so that the tests cover what the GPU runs. Decode
# segments are a few rows: 16 (tl.dot's least) wastes the least; ranks up to 64 in one tile.
_BLOCK_M, _BLOCK_K, _BLOCK_N, _MAX_BLOCK_R = 16, 64, 64, 64


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, t_ptr, starts_ptr, slots_ptr,
    in_features, rank,
    stride_xm, stride_as, stride_ar, stride_tm,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter only: its tl.dot mishandles bf16, so feed it fp32
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    seg = tl.program_id(0)
    slot = tl.load(slots_ptr + seg)
    if slot < 0:
        return
    row0 = tl.load(starts_ptr + seg) + tl.program_id(1) * BLOCK_M
    end = tl.load(starts_ptr + seg + 1)
    if row0 >= end:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    m_mask = rows < end
    offs_r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    a_base = a_ptr + slot.to(tl.int64) * stride_as + offs_r.to(tl.int64)[None, :] * stride_ar
    x_base = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < in_features
        xt = tl.load(x_base + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        at = tl.load(a_base + offs_k[:, None], mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        if UPCAST:
            xt, at = xt.to(tl.float32), at.to(tl.float32)
        acc = tl.dot(xt, at, acc, input_precision=DOT_PRECISION)
    dst = t_ptr + rows.to(tl.int64)[:, None] * stride_tm + offs_r[None, :]
    tl.store(dst, acc.to(t_ptr.dtype.element_ty), mask=m_mask[:, None] & r_mask[None, :])


@triton.jit
def _expand_kernel(
    t_ptr, b_ptr, y_ptr, starts_ptr, slots_ptr,
    out_features, rank,
    stride_tm, stride_bs, stride_bn, stride_ym,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    seg = tl.program_id(0)
    slot = tl.load(slots_ptr + seg)
    if slot < 0:
        return
    row0 = tl.load(starts_ptr + seg) + tl.program_id(1) * BLOCK_M
    end = tl.load(starts_ptr + seg + 1)
    if row0 >= end:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    m_mask = rows < end
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < out_features
    b_base = b_ptr + slot.to(tl.int64) * stride_bs + offs_n.to(tl.int64)[None, :] * stride_bn
    t_base = t_ptr + rows.to(tl.int64)[:, None] * stride_tm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        tt = tl.load(t_base + offs_r[None, :], mask=m_mask[:, None] & r_mask[None, :], other=0.0)
        bt = tl.load(b_base + offs_r[:, None], mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:
            tt, bt = tt.to(tl.float32), bt.to(tl.float32)
        acc = tl.dot(tt, bt, acc, input_precision=DOT_PRECISION)
    dst = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    old = tl.load(dst, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst, (old + acc).to(y_ptr.dtype.element_ty), mask=mask)




def lora_shrink_expand(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                       segments: LoRASegments) -> None:
    """``lora.lora_shrink_expand`` in two launches; the caller (``lora.lora_shrink_expand``) has checked the
    shapes, dtypes and slots."""
    rows = segments.max_segment_rows
    num_segments = segments.num_segments
    rank, out_features = lora_a.shape[1], lora_b.shape[1]
    if rows == 0 or rank == 0 or out_features == 0:
        return
    lora_a = lora_a if lora_a.stride(2) == 1 else lora_a.contiguous()
    lora_b = lora_b if lora_b.stride(2) == 1 else lora_b.contiguous()
    starts, slots = segments.device_tables(x.device)
    t = torch.empty((x.shape[0], rank), dtype=x.dtype, device=x.device)
    block_r = min(_MAX_BLOCK_R, max(16, triton.next_power_of_2(rank)))
    precision = dot_precision(x)
    upcast = INTERPRET and x.dtype == torch.bfloat16
    row_blocks = triton.cdiv(rows, _BLOCK_M)
    _shrink_kernel[(num_segments, row_blocks, triton.cdiv(rank, block_r))](
        x, lora_a, t, starts, slots,
        x.shape[1], rank,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), t.stride(0),
        DOT_PRECISION=precision, UPCAST=upcast, BLOCK_M=_BLOCK_M, BLOCK_R=block_r, BLOCK_K=_BLOCK_K,
    )
    _expand_kernel[(num_segments, row_blocks, triton.cdiv(out_features, _BLOCK_N))](
        t, lora_b, y, starts, slots,
        out_features, rank,
        t.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0),
        DOT_PRECISION=precision, UPCAST=upcast, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_R=block_r,
    )
