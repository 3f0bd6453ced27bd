"""Triton kernels for the paged KV cache (CUDA path; tests run them under TRITON_INTERPRET=1).

Importing this module imports triton; ``kvpilot.kernels.ops`` only does so on first use.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .reference import check_features
from .settings import current

__all__ = ["store_kv", "paged_attention", "copy_blocks", "swap_blocks"]

_LOG2E = 1.4426950408889634
# @triton.jit reads TRITON_INTERPRET when this module is imported; remember what it saw
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# float32 queries: how tl.dot multiplies and the rows a prefill program takes come from KernelSettings
# (triton_fp32_precision, triton_fp32_prefill_block_m), read at each call. "ieee" products run on CUDA cores
# and 64 float32 rows a program spill registers; "tf32x3" (three tf32 products on tensor cores) with 32 rows
# is as accurate and far faster: bench/results/kernels_gpu_fp32_variants_h200.json.


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# ----------------------------------------------------------------------------------------- store_kv


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_D: tl.constexpr,
    KVH_P2: tl.constexpr,
    D_P2: tl.constexpr,
    SATURATE: tl.constexpr,  # float16 cache, wider-ranged key/value: clamp to +-65504, never inf
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:  # padding token
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, KVH_P2)[:, None]
    d = tl.arange(0, D_P2)[None, :]
    m = (h < NUM_KV_HEADS) & (d < HEAD_D)
    tok64 = tok.to(tl.int64)
    k = tl.load(key_ptr + tok64 * stride_kt + h * stride_kh + d, mask=m)
    v = tl.load(value_ptr + tok64 * stride_vt + h * stride_vh + d, mask=m)
    if SATURATE:  # in float32, as reference.to_cache_dtype does (bf16 cannot hold 65504)
        k = tl.minimum(tl.maximum(k.to(tl.float32), -65504.0), 65504.0)
        v = tl.minimum(tl.maximum(v.to(tl.float32), -65504.0), 65504.0)
    dst = blk * stride_cb + off * stride_cs + h * stride_ch + d
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=m)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=m)


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if k_cache.stride(3) != 1:
        raise ValueError("cache head_dim must be contiguous")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """The kernels need the last dim contiguous; the other strides are passed through."""
    return t if t.stride(-1) == 1 else t.contiguous()


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    _check_cache(k_cache, v_cache)
    n = slot_mapping.shape[0]
    if n == 0:
        return
    key, value = _rows(key), _rows(value)
    _, bs, kvh, d = k_cache.shape
    _store_kv_kernel[(n,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        BLOCK_SIZE=bs,
        NUM_KV_HEADS=kvh,
        HEAD_D=d,
        KVH_P2=_next_pow2(kvh),
        D_P2=_next_pow2(d),
        SATURATE=k_cache.dtype == torch.float16 and key.dtype in (torch.float32, torch.bfloat16),
    )


# ---------------------------------------------------------------------------------- paged_attention


@triton.jit
def _paged_attn_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    bt_ptr,
    ctx_ptr,
    qsl_ptr,
    out_ptr,
    part_acc_ptr,  # [T, H, NUM_SPLITS, D_P2] fp32, only with NUM_SPLITS > 1
    part_ml_ptr,  # [T, H, NUM_SPLITS, 2] fp32 (running max in log2 units, sum)
    qk_scale,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    window,  # sliding window in tokens, read only with HAS_WINDOW
    sinks_ptr,  # [NUM_HEADS] fp32 sink logits, read only with HAS_SINKS
    cap_in,  # softmax scale / soft cap, read only with HAS_SOFTCAP
    cap_out,  # soft cap * log2(e), read only with HAS_SOFTCAP
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per kv head
    HEAD_D: tl.constexpr,
    D_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # cache block (page) size
    TILE_N: tl.constexpr,  # keys per inner step (any multiple or divisor of pages)
    BLOCK_M: tl.constexpr,  # rows per program = BLOCK_Q query tokens x GROUP heads (padded)
    BLOCK_Q: tl.constexpr,
    NUM_SPLITS: tl.constexpr,  # > 1: split the keys across programs (decode), reduce after
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,  # Gemma 2: scores s become cap * tanh(s / cap)
    HAS_SINKS: tl.constexpr,  # gpt-oss: one more logit per head in the softmax, with no value
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter only: its tl.dot mishandles bf16, so feed it fp32
):
    seq = tl.program_id(0)
    kvh = tl.program_id(2)
    if NUM_SPLITS > 1:
        q_blk = 0
        split = tl.program_id(1)
    else:
        q_blk = tl.program_id(1)
        split = 0

    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if q_blk * BLOCK_Q >= q_len:
        return
    ctx = tl.load(ctx_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    q_in = q_blk * BLOCK_Q + rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_in < q_len)
    q_pos = ctx - q_len + q_in  # absolute position of each row's query token
    d = tl.arange(0, D_P2)
    d_ok = d < HEAD_D

    tok = (q_start + q_in).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )

    # key range this program can see: causal end of its last row, window start of its first row
    first_pos = ctx - q_len + q_blk * BLOCK_Q
    kv_end = tl.minimum(ctx, first_pos + BLOCK_Q)
    if HAS_WINDOW:  # noqa: SIM108 (a constexpr branch: the statement form is what triton compiles away)
        tile_lo = tl.maximum(first_pos - window + 1, 0) // TILE_N
    else:
        tile_lo = 0
    tile_hi = tl.cdiv(kv_end, TILE_N)
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(tile_hi - tile_lo, NUM_SPLITS)
        tile_lo = tile_lo + split * per_split
        tile_hi = tl.minimum(tile_hi, tile_lo + per_split)

    if HAS_SINKS:
        # the online softmax starts from the sink (max = sink, sum = e^0 = 1) instead of from nothing; with split
        # keys only split 0 counts it, so the reduce adds it once
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        if NUM_SPLITS > 1:
            m_i = tl.where(split == 0, sink, float("-inf"))
            l_i = tl.where(split == 0, 1.0, 0.0) + tl.zeros([BLOCK_M], dtype=tl.float32)
        else:
            m_i = sink
            l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_P2], dtype=tl.float32)
    offs_n = tl.arange(0, TILE_N)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    head_off = kvh * stride_ch

    for t in range(tile_lo, tile_hi):
        pos = t * TILE_N + offs_n
        pos_ok = pos < kv_end
        page = tl.load(bt_row + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        kv_off = page * stride_cb + (pos % BLOCK_SIZE) * stride_cs + head_off
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        # a cache of another dtype (kv_cache_dtype) is upcast/cast to the query's as it is read
        k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)

        if UPCAST:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=DOT_PRECISION)
        else:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if HAS_SOFTCAP:
            # tanh from exp2 of -2|x| (no overflow, no libdevice needed), in log2 units afterwards
            x = s * cap_in
            t = tl.exp2(tl.abs(x) * -2.8853900817779268)
            th = (1.0 - t) / (1.0 + t)
            s = tl.where(x < 0.0, -th, th) * cap_out
        else:
            s = s * qk_scale
        diff = q_pos[:, None] - pos[None, :]
        ok = (diff >= 0) & pos_ok[None, :]
        if HAS_WINDOW:
            ok = ok & (diff < window)
        s = tl.where(ok, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        p_lo = p.to(v.dtype)  # tensor-core input precision, as in flash attention
        if UPCAST:
            pv = tl.dot(p_lo.to(tl.float32), v.to(tl.float32), input_precision=DOT_PRECISION)
        else:
            pv = tl.dot(p_lo, v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if NUM_SPLITS > 1:
        # unnormalised partials; the reduce kernel rescales them by their maxima
        base = (tok * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(part_acc_ptr + base[:, None] * D_P2 + d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + base * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + base * 2 + 1, l_i, mask=row_ok)
    else:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit
def _reduce_splits_kernel(
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    qsl_ptr,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_D: tl.constexpr,
    D_P2: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(qsl_ptr + seq)
    if tl.load(qsl_ptr + seq + 1) == q_start:
        return
    tok = q_start.to(tl.int64)
    sp = tl.arange(0, NUM_SPLITS)
    base = (tok * NUM_HEADS + head) * NUM_SPLITS + sp
    m = tl.load(part_ml_ptr + base * 2)
    lsum = tl.load(part_ml_ptr + base * 2 + 1)
    m_max = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))  # empty splits weigh nothing
    d = tl.arange(0, D_P2)
    acc = tl.load(part_acc_ptr + base[:, None] * D_P2 + d[None, :])
    o = tl.sum(acc * w[:, None], 0) / tl.sum(lsum * w, 0)
    tl.store(
        out_ptr + tok * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_D
    )


def _fp32_precision(device: torch.device) -> str:
    """The configured float32 precision where the GPU has tf32 tensor cores (compute capability 8.0 on), else
    exact products."""
    precision = current().triton_fp32_precision
    if precision.startswith("tf32") and _capability(device.index or 0) < (8, 0):
        return "ieee"
    return precision


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _decode_splits(device: torch.device, batch: int, kvh: int, max_ctx: int, tile_n: int) -> int:
    """Split long decode contexts so that the GPU has ~4 programs per SM, each with >= 4 tiles."""
    if device.type != "cuda":
        return 1 if max_ctx < 4 * tile_n else 2  # interpreter: exercise the split path on long cases
    target = 4 * _num_sms(device.index or 0)
    want = triton.cdiv(target, max(1, batch * kvh))
    most = max(1, triton.cdiv(max_ctx, 4 * tile_n))
    return min(_next_pow2(want), _next_pow2(most), 64) if want > 1 else 1


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    max_context_len: int | None = None,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    _check_cache(k_cache, v_cache)
    num_tokens, num_heads, d = query.shape
    _, bs, kvh, _ = k_cache.shape
    if num_heads % kvh:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {kvh}")
    soft_cap = check_features(soft_cap, sinks, num_heads, query.device)
    query = _rows(query)
    if out is None:
        out = torch.empty_like(query)
    if out.stride(-1) != 1:
        raise ValueError("out must have a contiguous last dim")
    b = context_lens.shape[0]
    if num_tokens == 0 or b == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    group = num_heads // kvh
    d_p2 = _next_pow2(d)
    # one configuration for GPU and interpreter, so that the tests cover what the GPU runs
    tile_n = max(bs, 64 if d_p2 <= 128 else 32)
    # float32 queries want float32-accurate products (plain tf32 would lose ~3 digits): see _fp32_precision;
    # ignored for 16-bit inputs. The interpreter multiplies exactly.
    fp32 = query.dtype == torch.float32
    precision = "ieee" if _INTERPRET else _fp32_precision(query.device) if fp32 else "tf32"

    if max_query_len == 1:
        if max_context_len is None:
            max_context_len = int(context_lens.max())
        # the reduce kernel wants a power of two; extra splits just come out empty
        splits = _next_pow2(num_splits or _decode_splits(query.device, b, kvh, max_context_len, tile_n))
        block_q = 1
        block_m = max(16, _next_pow2(group))
        grid = (b, splits, kvh)
    else:
        splits = 1
        block_m = max(current().triton_fp32_prefill_block_m if fp32 else 64, _next_pow2(group), 16)
        block_q = block_m // group
        grid = (b, triton.cdiv(max_query_len, block_q), kvh)

    if splits > 1:
        part_acc = torch.empty(num_tokens, num_heads, splits, d_p2, dtype=torch.float32, device=query.device)
        part_ml = torch.empty(num_tokens, num_heads, splits, 2, dtype=torch.float32, device=query.device)
    else:
        part_acc = part_ml = out  # unused
    _paged_attn_kernel[grid](
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        query_start_loc,
        out,
        part_acc,
        part_ml,
        float(scale) * _LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        int(sliding_window or 0),
        query if sinks is None else sinks.contiguous(),  # any pointer when there are none
        float(scale) / soft_cap if soft_cap else 0.0,
        soft_cap * _LOG2E if soft_cap else 0.0,
        NUM_HEADS=num_heads,
        GROUP=group,
        HEAD_D=d,
        D_P2=d_p2,
        BLOCK_SIZE=bs,
        TILE_N=tile_n,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        NUM_SPLITS=splits,
        HAS_WINDOW=bool(sliding_window),
        HAS_SOFTCAP=soft_cap is not None,
        HAS_SINKS=sinks is not None,
        DOT_PRECISION=precision,
        UPCAST=_INTERPRET and query.dtype == torch.bfloat16,
        num_warps=4 if d_p2 <= 128 else 8,
    )
    if splits > 1:
        _reduce_splits_kernel[(b, num_heads)](
            out,
            part_acc,
            part_ml,
            query_start_loc,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_D=d,
            D_P2=d_p2,
            NUM_SPLITS=splits,
        )
    return out


# -------------------------------------------------------------------------------------- copy_blocks


@triton.jit
def _copy_blocks_kernel(
    cache_ptrs,  # int64 [2 * layers] data pointers: all K caches, then all V caches
    pairs_ptr,  # int64 [N, 2]
    BLOCK_NUMEL: tl.constexpr,
    CHUNK: tl.constexpr,
    DTYPE: tl.constexpr,
):
    pair = tl.program_id(0)
    cache = tl.load(cache_ptrs + tl.program_id(1)).to(tl.pointer_type(DTYPE))
    src = tl.load(pairs_ptr + pair * 2)
    dst = tl.load(pairs_ptr + pair * 2 + 1)
    offs = tl.program_id(2) * CHUNK + tl.arange(0, CHUNK)
    m = offs < BLOCK_NUMEL
    x = tl.load(cache + src * BLOCK_NUMEL + offs, mask=m)
    tl.store(cache + dst * BLOCK_NUMEL + offs, x, mask=m)


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def copy_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], src_to_dst: torch.Tensor) -> None:
    """All layers in one launch. Pairs must not chain (a dst that is also a src in the same call)."""
    if not k_caches or src_to_dst.numel() == 0:
        return
    caches = list(k_caches) + list(v_caches)
    first = caches[0]
    for c in caches:
        if (
            c.shape != first.shape
            or c.dtype != first.dtype
            or not c.is_contiguous()
            or c.device != first.device
        ):
            raise ValueError("copy_blocks needs contiguous caches of one shape, dtype and device")
    ptrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64, device=first.device)
    pairs = src_to_dst.to(device=first.device, dtype=torch.int64).contiguous()
    numel = first[0].numel()
    chunk = min(4096, _next_pow2(numel))
    grid = (pairs.shape[0], len(caches), triton.cdiv(numel, chunk))
    _copy_blocks_kernel[grid](ptrs, pairs, BLOCK_NUMEL=numel, CHUNK=chunk, DTYPE=_TL_DTYPES[first.dtype])


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, src_to_dst: torch.Tensor) -> None:
    from .reference import swap_blocks as ref

    ref(src, dst, src_to_dst)
