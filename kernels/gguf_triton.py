"""The GGUF dequantize-GEMM in Triton (CUDA path; tests run it under TRITON_INTERPRET=1 on CPU tensors).

Same contract as ``gguf_reference.linear``. Each program owns BLOCK_M rows of x and BLOCK_N output features and
walks K in steps of 32 elements: one block of the 32-element formats, an eighth of a K-quant super-block. Per
step it loads the weight bytes those 32 x BLOCK_N elements live in, decodes them in registers to float32
(``_decode``: the codes, the fp16 scales, the K-quants' 6-bit scales and mins, exactly as the reference
computes them) and accumulates ``x @ w`` in float32 with tl.dot; bias and residual are added in float32 before
the one rounding to x's dtype. Every type of ``GGUF_TYPES`` is decoded here.

Importing this module imports triton; ``kvpilot.kernels.gguf`` does so on first use.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from . import gguf_reference as reference
from .settings import current

__all__ = ["linear", "SUPPORTED"]

SUPPORTED = tuple(reference.GGUF_TYPES)
# @triton.jit reads TRITON_INTERPRET when triton is imported; remember what it saw
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# tl.dot needs 16 or more along each side; 32 along K is one block of the small formats
_BLOCK_M, _BLOCK_N, _BLOCK_K = 16, 32, 32


@triton.jit
def _f16(ptr, mask):
    """The little-endian fp16 at each byte pointer of ``ptr``, as float32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _byte(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _decode(blk, e, mask, QTYPE: tl.constexpr):
    """Float32 weights at element ``e`` (0 .. block elements - 1) of the blocks starting at byte pointers
    ``blk`` (broadcast together; ``mask`` where to read)."""
    if QTYPE == 2:  # Q4_0: d, 16 nibble bytes (low: elements 0-15, high: 16-31); (q - 8) * d
        q = (_byte(blk + 2 + e % 16, mask) >> (4 * (e // 16))) & 15
        w = (q - 8).to(tl.float32) * _f16(blk, mask)
    elif QTYPE == 3:  # Q4_1: d, m, nibbles; q * d + m
        q = (_byte(blk + 4 + e % 16, mask) >> (4 * (e // 16))) & 15
        w = q.to(tl.float32) * _f16(blk, mask) + _f16(blk + 2, mask)
    elif QTYPE == 6:  # Q5_0: d, qh (bit j: element j's fifth bit), nibbles; (q - 16) * d
        q = (_byte(blk + 6 + e % 16, mask) >> (4 * (e // 16))) & 15
        q |= ((_byte(blk + 2 + e // 8, mask) >> (e % 8)) & 1) << 4
        w = (q - 16).to(tl.float32) * _f16(blk, mask)
    elif QTYPE == 7:  # Q5_1: d, m, qh, nibbles; q * d + m
        q = (_byte(blk + 8 + e % 16, mask) >> (4 * (e // 16))) & 15
        q |= ((_byte(blk + 4 + e // 8, mask) >> (e % 8)) & 1) << 4
        w = q.to(tl.float32) * _f16(blk, mask) + _f16(blk + 2, mask)
    elif QTYPE == 8:  # Q8_0: d, 32 int8; q * d
        q = tl.load(blk + 2 + e, mask=mask, other=0).to(tl.int8, bitcast=True)
        w = q.to(tl.float32) * _f16(blk, mask)
    elif QTYPE == 14:  # Q6_K: ql 128, qh 64, int8 scales 16, d; d * sc * (q - 32)
        half = e // 128
        j = (e % 128) // 32
        lane = e % 32
        low = (_byte(blk + 64 * half + 32 * (j % 2) + lane, mask) >> (4 * (j // 2))) & 15
        high = (_byte(blk + 128 + 32 * half + lane, mask) >> (2 * j)) & 3
        sc = tl.load(blk + 192 + e // 16, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w = (_f16(blk + 208, mask) * sc) * ((low | (high << 4)) - 32).to(tl.float32)
    else:  # Q4_K (12) / Q5_K (13): d, dmin, 12 bytes of 6-bit scales and mins, [Q5_K: qh 32], codes 128
        s = e // 32  # sub-block
        lane = e % 32
        b4 = _byte(blk + 4 + s, mask)  # 0-3: their scale; 4-7: the byte with their min's top 2 bits
        b8 = _byte(blk + 8 + s, mask)  # 0-3: their min; 4-7: scale (low nibble) and min (high nibble)
        b0 = _byte(blk + s, mask & (s >= 4))  # 4-7: the byte with their scale's top 2 bits (b4 has the min's)
        sc = tl.where(s < 4, b4 & 63, (b8 & 15) | ((b0 >> 6) << 4))
        mn = tl.where(s < 4, b8 & 63, (b8 >> 4) | ((b4 >> 6) << 4))
        if QTYPE == 12:
            q = (_byte(blk + 16 + 32 * (s // 2) + lane, mask) >> (4 * (s % 2))) & 15
        else:
            q = (_byte(blk + 48 + 32 * (s // 2) + lane, mask) >> (4 * (s % 2))) & 15
            q |= ((_byte(blk + 16 + lane, mask) >> s) & 1) << 4
        w = (_f16(blk, mask) * sc.to(tl.float32)) * q.to(tl.float32) - _f16(blk + 2, mask) * mn.to(tl.float32)
    return w


@triton.jit
def _gemm_kernel(
    x_ptr, w_ptr, b_ptr, r_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_rm, stride_ym,
    QTYPE: tl.constexpr, QK: tl.constexpr, QBYTES: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rows = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn  # [1, BLOCK_N] byte pointers of the weight rows
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K is a multiple of 32: every step lies inside one block
        a = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + (k0 + kk)[None, :], mask=m_mask[:, None],
                    other=0.0).to(tl.float32)
        blk = rows + (k0 // QK) * QBYTES
        w = _decode(blk, (k0 % QK + kk)[:, None], n_mask[None, :], QTYPE)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if HAS_RES:
        acc += tl.load(r_ptr + offs_m.to(tl.int64)[:, None] * stride_rm + offs_n[None, :], mask=mask,
                       other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _precision(t: torch.Tensor) -> str:
    """tl.dot's precision for the float32 operands: exact in the interpreter; on the GPU the configured one
    where there are tf32 tensor cores (the default tf32x3 is float32-accurate), else ieee."""
    if _INTERPRET:
        return "ieee"
    precision = current().triton_fp32_precision
    if precision.startswith("tf32") and _capability(t.device.index or 0) < (8, 0):
        return "ieee"
    return precision


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def linear(x: torch.Tensor, qweight: torch.Tensor, qtype: int, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """``gguf_reference.linear`` in one launch: ``residual + x @ W.T + bias`` in ``x.dtype``, float32 inside."""
    k = x.shape[-1]
    reference.check_weight(qweight, qtype, k)
    elems, nbytes = reference.block_shape(qtype)
    n = qweight.shape[0]
    x2 = _rows(x.reshape(-1, k))
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y.reshape(*x.shape[:-1], n)
    w = _rows(qweight)
    b = None if bias is None else bias.contiguous()
    r = None if residual is None else _rows(residual.reshape(m, n))
    _gemm_kernel[(triton.cdiv(m, _BLOCK_M), triton.cdiv(n, _BLOCK_N))](
        x2, w, b if b is not None else x2, r if r is not None else x2, y,
        m, n, k,
        x2.stride(0), w.stride(0), r.stride(0) if r is not None else 0, y.stride(0),
        QTYPE=qtype, QK=elems, QBYTES=nbytes, HAS_BIAS=b is not None, HAS_RES=r is not None,
        DOT_PRECISION=_precision(x2), BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
    )
    return y.reshape(*x.shape[:-1], n)
