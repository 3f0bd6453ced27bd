"""The fused mixture-of-experts layer in Triton (CUDA path; tests run it under TRITON_INTERPRET=1).

Same contract as ``moe_reference.fused_moe``. The (token, slot) pairs are sorted by expert with each expert's
run padded to a multiple of BLOCK_M (``moe.moe_align``, sync-free torch), so each program's rows share one
expert and two grouped GEMMs cover the layer:

1. gate|up: rows gathered from ``hidden`` by token, both halves of the expert's ``w13`` accumulated side by
   side, bias and activation applied in registers, the activated ``[pairs, I]`` stored in the hidden dtype
   (rounded there, as the reference rounds before its second GEMM);
2. down: those rows times the expert's ``w2``, plus its bias, times the routing weight, stored in float32
   per pair; the k pairs of a token are summed in float32 by torch afterwards (no atomics: deterministic).

Programs whose block lies past the padded length (the grid is sized by an upper bound, never by a device
read) return at once. Importing this module imports triton; ``kvpilot.kernels.ops`` does so on first use.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .moe import moe_align
from .moe_reference import GPT_OSS_ALPHA, GPT_OSS_LIMIT, check_moe_args
from .triton_dot import INTERPRET, dot_precision

__all__ = ["fused_moe"]

# One tile configuration for the GPU and the interpreter, so that the tests cover what the GPU runs. 64 rows a
# block keeps the padding waste of decode-sized expert runs bounded while filling the tensor cores.
_BLOCK_M, _BLOCK_N, _BLOCK_K = 64, 64, 32


@triton.jit
def _gate_up_kernel(
    x_ptr, w13_ptr, b13_ptr, act_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
    num_pairs, hidden_size, inter, up_offset,
    stride_xt, stride_we, stride_wn, stride_be, stride_at,
    alpha, limit,
    TOP_K: tl.constexpr,
    GATE_STRIDE: tl.constexpr,  # row of gate i = i * GATE_STRIDE, of up i = that + up_offset
    GPT_OSS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter only: its tl.dot mishandles bf16, so feed it fp32
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < num_pairs
    tok = (pair // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    gate_rows = offs_n.to(tl.int64) * GATE_STRIDE
    w_base = w13_ptr + expert * stride_we
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < hidden_size
        a = tl.load(x_ptr + tok[:, None] * stride_xt + offs_k[None, :], mask=valid[:, None] & k_mask[None, :],
                    other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        wg = tl.load(w_base + gate_rows[None, :] * stride_wn + offs_k[:, None], mask=w_mask, other=0.0)
        wu = tl.load(w_base + (gate_rows + up_offset)[None, :] * stride_wn + offs_k[:, None], mask=w_mask,
                     other=0.0)
        if UPCAST:
            a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        acc_g = tl.dot(a, wg, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(a, wu, acc_u, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        b_base = b13_ptr + expert * stride_be
        acc_g += tl.load(b_base + gate_rows, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_base + gate_rows + up_offset, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if GPT_OSS:
        gate = tl.minimum(acc_g, limit)
        up = tl.minimum(tl.maximum(acc_u, -limit), limit)
        out = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    else:
        out = acc_g * tl.sigmoid(acc_g) * acc_u
    dst = act_ptr + pair.to(tl.int64)[:, None] * stride_at + offs_n[None, :]
    tl.store(dst, out.to(act_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(
    act_ptr, w2_ptr, b2_ptr, weights_ptr, out_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
    num_pairs, hidden_size, inter,
    stride_at, stride_we, stride_wn, stride_be, stride_ot,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < num_pairs
    pair64 = pair.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden_size
    w_base = w2_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < inter
        a = tl.load(act_ptr + pair64[:, None] * stride_at + offs_k[None, :], mask=valid[:, None] & k_mask[None, :],
                    other=0.0)
        w = tl.load(w_base + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b2_ptr + expert * stride_be + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    acc *= tl.load(weights_ptr + pair64, mask=valid, other=0.0)[:, None]
    tl.store(out_ptr + pair64[:, None] * stride_ot + offs_n[None, :], acc, mask=valid[:, None] & n_mask[None, :])




def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    swiglu_alpha: float = GPT_OSS_ALPHA,
    swiglu_limit: float = GPT_OSS_LIMIT,
) -> torch.Tensor:
    """``moe_reference.fused_moe`` in two grouped-GEMM launches (see the module docstring). Expert ids are not
    range-checked (that would sync the device): out-of-range ids are the caller's bug."""
    check_moe_args(hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias)
    tokens, hidden_size = hidden.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    k = topk_ids.shape[1]
    pairs = tokens * k
    if pairs == 0:
        return hidden.new_zeros(hidden.shape)
    hidden, w13, w2 = _rows(hidden), w13.contiguous(), w2.contiguous()
    sorted_ids, expert_ids, num_post = moe_align(topk_ids, num_experts, _BLOCK_M)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    act = hidden.new_empty((pairs, inter))
    out_pairs = torch.empty((pairs, hidden_size), dtype=torch.float32, device=hidden.device)
    b13 = w13_bias.contiguous() if w13_bias is not None else None
    b2 = w2_bias.contiguous() if w2_bias is not None else None
    gpt_oss = activation == "gpt_oss"
    precision = dot_precision(hidden)
    upcast = INTERPRET and hidden.dtype == torch.bfloat16
    blocks = expert_ids.shape[0]
    _gate_up_kernel[(blocks, triton.cdiv(inter, _BLOCK_N))](
        hidden, w13, b13 if b13 is not None else w13, act, sorted_ids, expert_ids, num_post,
        pairs, hidden_size, inter, 1 if gpt_oss else inter,
        hidden.stride(0), w13.stride(0), w13.stride(1), b13.stride(0) if b13 is not None else 0, act.stride(0),
        float(swiglu_alpha), float(swiglu_limit),
        TOP_K=k, GATE_STRIDE=2 if gpt_oss else 1, GPT_OSS=gpt_oss, HAS_BIAS=b13 is not None,
        DOT_PRECISION=precision, UPCAST=upcast, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
    )
    _down_kernel[(blocks, triton.cdiv(hidden_size, _BLOCK_N))](
        act, w2, b2 if b2 is not None else w2, weights, out_pairs, sorted_ids, expert_ids, num_post,
        pairs, hidden_size, inter,
        act.stride(0), w2.stride(0), w2.stride(1), b2.stride(0) if b2 is not None else 0, out_pairs.stride(0),
        HAS_BIAS=b2 is not None, DOT_PRECISION=precision, UPCAST=upcast,
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
    )
    return out_pairs.view(tokens, k, hidden_size).sum(dim=1).to(hidden.dtype)
