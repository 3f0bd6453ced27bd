"""Torch reference kernels for the paged KV cache.

These are the engine's CPU hot path, so they are vectorized: every decode row of a batch goes
through one gathered SDPA call; only prefill chunks (few per step) are handled per sequence.
Cache layout: ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer; slot =
block_id * block_size + offset. The cache may have another dtype than the model (``kv_cache_dtype``):
``store_kv`` converts on the way in and attention casts what it gathers to the query's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["store_kv", "to_cache_dtype", "check_features", "paged_attention", "attend_prefill_chunks", "copy_blocks", "swap_blocks"]

_FP16_MAX = torch.finfo(torch.float16).max


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as ``dtype``. Into float16 from a wider-ranged type the values saturate at +-65504: an
    inf in the cache would make every softmax that sees it NaN, where a clamped key only skews it."""
    if x.dtype == dtype:
        return x
    if dtype == torch.float16 and x.dtype in (torch.float32, torch.bfloat16):
        # clamped in float32: bfloat16 cannot hold 65504 and would round the bound up to inf's side
        return x.float().clamp(-_FP16_MAX, _FP16_MAX).to(dtype)
    return x.to(dtype)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[T, kvh, d]`` into their slots; slot -1 means skip (padding)."""
    if key.shape[0] == 0:
        return
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("store_kv needs contiguous caches")
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.long)
    n = slots.shape[0]
    key, value = key[:n], value[:n]
    valid = slots >= 0
    if not bool(valid.all()):
        idx = valid.nonzero().squeeze(1)
        slots, key, value = slots[idx], key[idx], value[idx]
    # flatten(0, 1) is a view for the contiguous caches the engine allocates
    kf = k_cache.flatten(0, 1)
    vf = v_cache.flatten(0, 1)
    kf.index_copy_(0, slots, to_cache_dtype(key, k_cache.dtype))
    vf.index_copy_(0, slots, to_cache_dtype(value, v_cache.dtype))


def check_features(
    soft_cap: float | None, sinks: torch.Tensor | None, num_heads: int, device: torch.device
) -> float | None:
    """Validate ``soft_cap``/``sinks`` (every backend's rules) and return the cap, None when it is off (None or 0)."""
    if soft_cap is not None:
        if isinstance(soft_cap, bool) or not isinstance(soft_cap, int | float):
            raise ValueError(f"soft_cap must be a number or None, got {type(soft_cap).__name__}")
        if not soft_cap >= 0.0 or soft_cap == float("inf"):  # NaN fails the first test
            raise ValueError(f"soft_cap must be finite and >= 0, got {soft_cap}")
        soft_cap = float(soft_cap) or None
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor):
            raise ValueError(f"sinks must be a torch.Tensor or None, got {type(sinks).__name__}")
        if sinks.dtype != torch.float32 or sinks.shape != (num_heads,):
            raise ValueError(f"sinks must be a float32 tensor of shape ({num_heads},) (one logit per query head), "
                             f"got {sinks.dtype} {tuple(sinks.shape)}")
        if sinks.device != device:
            raise ValueError(f"sinks must be on the query's device {device}, got {sinks.device}")
    return soft_cap


def _attend_features(
    qg: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    soft_cap: float | None,
    row_sinks: torch.Tensor | None,
) -> torch.Tensor:
    """SDPA with soft-capped scores and/or a sink logit per row, in float32 (SDPA takes neither).
    qg [B, kvh, R, d], k/v [B, kvh, L, d], mask broadcastable to [B, kvh, R, L] (True: visible),
    row_sinks broadcastable to [B, kvh, R, 1]. Returns the query's dtype."""
    s = torch.matmul(qg.float(), k.float().transpose(-1, -2)) * scale
    if soft_cap is not None:
        s = torch.tanh(s / soft_cap) * soft_cap  # Gemma 2: after the scale, before the mask
    s = s.masked_fill(~mask, float("-inf"))
    if row_sinks is not None:
        # gpt-oss: the sink is one more logit in each row's softmax, with no value row behind it
        sink = row_sinks.float().expand(*s.shape[:-1], 1)
        p = torch.cat([s, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        p = s.softmax(-1)
    return torch.matmul(p, v.float()).to(qg.dtype)


def _decode_buckets(ctx: torch.Tensor, bs: int, max_ratio: float = 1.5) -> list[torch.Tensor] | None:
    """Group decode rows of similar length so that padding each group to its longest row wastes
    little gather work. None when one group is already tight enough."""
    nbs = ((ctx + bs - 1) // bs).tolist()
    if len(nbs) < 8 or max(nbs) <= max_ratio * max(1, min(nbs)):
        return None
    order = sorted(range(len(nbs)), key=nbs.__getitem__)
    groups: list[list[int]] = [[order[0]]]
    low = max(1, nbs[order[0]])
    for i in order[1:]:
        if nbs[i] > max_ratio * low and len(groups[-1]) >= 4:
            groups.append([])
            low = max(1, nbs[i])
        groups[-1].append(i)
    return [torch.tensor(g, dtype=torch.long, device=ctx.device) for g in groups]


def _attend_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    ctx: torch.Tensor,
    max_ctx: int,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query row per sequence, all sequences in a single SDPA call. q: [n, H, d]."""
    n, num_heads, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    g = num_heads // kvh
    nb = min((max_ctx + bs - 1) // bs, block_tables.shape[1])  # the hint may be a loose bound
    first = 0
    if sliding_window is not None and sliding_window < max_ctx:
        # skip the leading blocks that fall outside every sequence's window
        first = max(0, int(ctx.min()) - sliding_window) // bs
    bt = block_tables[:, first:nb].long().clamp_(min=0).flatten()
    length = (nb - first) * bs
    # index_select is several times faster than advanced indexing here; [n, kvh, L, d] strided view;
    # SDPA wants one dtype, and the cache's may differ from the query's (kv_cache_dtype)
    k = k_cache.index_select(0, bt).to(q.dtype).view(n, length, kvh, d).transpose(1, 2)
    v = v_cache.index_select(0, bt).to(q.dtype).view(n, length, kvh, d).transpose(1, 2)
    pos = torch.arange(first * bs, nb * bs, device=q.device)
    mask = pos[None, :] < ctx[:, None]
    if sliding_window is not None:
        mask &= pos[None, :] >= (ctx[:, None] - sliding_window)
    # the g query heads sharing a kv head act as g query rows of that head: GQA without repeats
    qg = q.view(n, kvh, g, d)
    if soft_cap is not None or sinks is not None:
        row_sinks = None if sinks is None else sinks.view(1, kvh, g, 1)
        o = _attend_features(qg, k, v, mask[:, None, None, :], scale, soft_cap, row_sinks)
    else:
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask[:, None, None, :], scale=scale)
    return o.reshape(n, num_heads, d)


def _attend_chunk(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    blocks: torch.Tensor,
    ctx: int,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [ql, H, d], the last ql positions of a ctx-token sequence; causal with the offset."""
    ql, num_heads, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    g = num_heads // kvh
    nb = (ctx + bs - 1) // bs
    bt = blocks[:nb].long().clamp_(min=0)
    k = k_cache.index_select(0, bt).to(q.dtype).view(nb * bs, kvh, d)[:ctx].transpose(0, 1).unsqueeze(0)
    v = v_cache.index_select(0, bt).to(q.dtype).view(nb * bs, kvh, d)[:ctx].transpose(0, 1).unsqueeze(0)
    features = soft_cap is not None or sinks is not None
    if ql == ctx and (sliding_window is None or sliding_window >= ctx) and not features:
        # a whole prompt from position 0: plain causal, no mask tensor, so the flash kernel skips
        # the masked half of the blocks (1.8x at 512 tokens, 2.7x at 2048 on a 2-core EPYC)
        o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k, v, is_causal=True, scale=scale,
                                           enable_gqa=g > 1)
        return o[0].transpose(0, 1)
    # rows ordered (kv head, group member, query position) so each kv head serves g*ql rows
    qg = q.view(ql, kvh, g, d).permute(1, 2, 0, 3).reshape(1, kvh, g * ql, d)
    qpos = torch.arange(ctx - ql, ctx, device=q.device)
    kpos = torch.arange(ctx, device=q.device)
    diff = qpos[:, None] - kpos[None, :]
    mask = diff >= 0
    if sliding_window is not None:
        mask &= diff < sliding_window
    mask = mask.repeat(g, 1)
    if features:
        # row (g_i, q_i) of kv head h belongs to query head h * g + g_i
        row_sinks = None if sinks is None else sinks.view(1, kvh, g, 1).repeat_interleave(ql, dim=2)
        o = _attend_features(qg, k, v, mask[None, None], scale, soft_cap, row_sinks)
    else:
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask[None, None], scale=scale)
    return o.view(kvh, g, ql, d).permute(2, 0, 1, 3).reshape(ql, num_heads, d)


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
) -> torch.Tensor:
    """Varlen causal attention of ``query`` against the paged cache (see DESIGN.md, Kernels).

    A query at position p sees keys k with k <= p and, with a sliding window w, p - k < w. With
    ``soft_cap`` c each score s = scale * q.k becomes c * tanh(s / c) before the softmax (Gemma 2);
    ``sinks`` (float32 [H]) adds one logit per query head to every row's softmax denominator with no
    value behind it (gpt-oss). Both go through a float32 path here, as SDPA takes neither.
    """
    num_tokens, num_heads, d = query.shape
    kvh = k_cache.shape[2]
    if num_heads % kvh:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {kvh}")
    soft_cap = check_features(soft_cap, sinks, num_heads, query.device)
    if out is None:
        out = torch.empty_like(query)
    b = context_lens.shape[0]
    if num_tokens == 0 or b == 0:
        return out
    dev = query.device
    qsl = query_start_loc.to(device=dev, dtype=torch.long)
    ctx = context_lens.to(device=dev, dtype=torch.long)
    q_lens = qsl[1:] - qsl[:-1]
    if max_query_len is None:
        max_query_len = int(q_lens.max())
    if max_context_len is None:
        max_context_len = int(ctx.max())
    if max_query_len == 1 and num_tokens == b:
        # pure decode: row i is sequence i
        buckets = _decode_buckets(ctx, k_cache.shape[1]) if dev.type == "cpu" else None
        if buckets is None:
            o = _attend_decode(query, k_cache, v_cache, block_tables, ctx, max_context_len, scale, sliding_window,
                               soft_cap, sinks)
            out.copy_(o)
            return out
        for rows in buckets:
            rctx = ctx[rows]
            o = _attend_decode(
                query.index_select(0, rows), k_cache, v_cache, block_tables[rows], rctx, int(rctx.max()), scale,
                sliding_window, soft_cap, sinks,
            )
            out.index_copy_(0, rows, o.to(out.dtype))
        return out
    q_lens_l = q_lens.tolist()
    dec = [i for i, n in enumerate(q_lens_l) if n == 1]
    if dec:
        dec_t = torch.tensor(dec, device=dev, dtype=torch.long)
        rows = qsl[dec_t]
        dctx = ctx[dec_t]
        o = _attend_decode(
            query.index_select(0, rows),
            k_cache,
            v_cache,
            block_tables[dec_t],
            dctx,
            int(dctx.max()),
            scale,
            sliding_window,
            soft_cap,
            sinks,
        )
        out.index_copy_(0, rows, o.to(out.dtype))
    attend_prefill_chunks(query, k_cache, v_cache, block_tables, ctx, qsl, scale, sliding_window, out,
                          soft_cap=soft_cap, sinks=sinks)
    return out


def attend_prefill_chunks(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
    *,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Fill ``out`` for the sequences with more than one query token (one SDPA call each); ``soft_cap`` (0 or
    None: off) and ``sinks`` as in ``paged_attention``."""
    soft_cap = soft_cap or None
    starts = query_start_loc.tolist()
    ctx_l = context_lens.tolist()
    for i in range(len(ctx_l)):
        s, n = starts[i], starts[i + 1] - starts[i]
        if n <= 1:
            continue
        out[s : s + n] = _attend_chunk(
            query[s : s + n], k_cache, v_cache, block_tables[i], ctx_l[i], scale, sliding_window, soft_cap, sinks
        )


def copy_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], src_to_dst: torch.Tensor) -> None:
    """Copy-on-write: block src -> block dst in every layer's K and V cache."""
    if src_to_dst.numel() == 0:
        return
    pairs = src_to_dst.to(device=k_caches[0].device, dtype=torch.long)
    src, dst = pairs[:, 0], pairs[:, 1]
    for kc, vc in zip(k_caches, v_caches, strict=True):
        kc.index_copy_(0, dst, kc.index_select(0, src))
        vc.index_copy_(0, dst, vc.index_select(0, src))


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, src_to_dst: torch.Tensor) -> None:
    """Copy blocks between two caches of the same block shape, possibly on different devices."""
    if src_to_dst.numel() == 0:
        return
    pairs = src_to_dst.to(dtype=torch.long)
    s = pairs[:, 0].to(src.device)
    t = pairs[:, 1].to(dst.device)
    blocks = src.index_select(0, s)
    dst.index_copy_(0, t, blocks.to(dst.device, non_blocking=dst.device.type == "cuda"))
