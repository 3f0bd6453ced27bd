"""Paged KV-cache kernels: the torch reference against naive dense attention, and the Triton
kernels (under TRITON_INTERPRET=1 on CPU tensors) against the reference."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from kvpilot.kernels import ops as K
from kvpilot.kernels import reference as R


@pytest.fixture
def kernel_settings() -> Iterator[Callable[..., None]]:
    """``kernel_settings(attention_backend="torch", ...)`` puts those kernel settings in effect, as an engine
    configured so would; the test's end restores the ones before."""
    before = K.current()
    yield lambda **changes: K.configure(replace(before, **changes))
    K.configure(before)

# --------------------------------------------------------------------------------------- helpers


@dataclass
class Case:
    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    dense_k: list[torch.Tensor]  # per sequence [ctx, kvh, d], what the cache holds
    dense_v: list[torch.Tensor]
    scale: float

    def args(self, k_cache=None, v_cache=None):
        return (
            self.query,
            self.k_cache if k_cache is None else k_cache,
            self.v_cache if v_cache is None else v_cache,
            self.block_tables,
            self.context_lens,
            self.query_start_loc,
            self.scale,
        )


def make_case(
    ctx_lens: list[int],
    q_lens: list[int],
    *,
    kvh: int,
    group: int,
    d: int,
    bs: int,
    dtype: torch.dtype,
    seed: int,
    fill: float = float("nan"),
) -> Case:
    """Random paged batch. Blocks are shuffled across sequences, unused slots hold ``fill`` and
    block-table padding is -1, so a kernel that reads outside a context shows it."""
    assert all(q <= c for q, c in zip(q_lens, ctx_lens, strict=True))
    g = torch.Generator().manual_seed(seed)
    nblocks = [math.ceil(c / bs) for c in ctx_lens]
    total = sum(nblocks) + 3
    perm = torch.randperm(total, generator=g)
    k_cache = torch.full((total, bs, kvh, d), fill, dtype=dtype)
    v_cache = torch.full_like(k_cache, fill)
    bt = torch.full((len(ctx_lens), max(nblocks) + 1), -1, dtype=torch.int32)
    dense_k, dense_v = [], []
    used = 0
    for i, (c, nb) in enumerate(zip(ctx_lens, nblocks, strict=True)):
        blocks = perm[used : used + nb]
        used += nb
        bt[i, :nb] = blocks.to(torch.int32)
        kd = torch.randn(c, kvh, d, generator=g).to(dtype)
        vd = torch.randn(c, kvh, d, generator=g).to(dtype)
        for p in range(c):
            k_cache[blocks[p // bs], p % bs] = kd[p]
            v_cache[blocks[p // bs], p % bs] = vd[p]
        dense_k.append(kd)
        dense_v.append(vd)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    # the query is a strided slice of a fused q|k projection, as the model passes it
    fused = torch.randn(int(qsl[-1]), kvh * group + kvh, d, generator=g).to(dtype)
    query = fused[:, : kvh * group]
    return Case(
        query,
        k_cache,
        v_cache,
        bt,
        torch.tensor(ctx_lens, dtype=torch.int32),
        qsl,
        dense_k,
        dense_v,
        1.0 / math.sqrt(d),
    )


def dense_attention(q, k, v, scale, window=None):
    """Naive fp32 causal attention for one sequence: q [ql, H, d] are the last ql of k/v [n, kvh, d]."""
    ql, h, _ = q.shape
    n, kvh, _ = k.shape
    k = k.float().repeat_interleave(h // kvh, dim=1)
    v = v.float().repeat_interleave(h // kvh, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    qpos = torch.arange(n - ql, n)[:, None]
    kpos = torch.arange(n)[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask &= qpos - kpos < window
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def dense_batch(case: Case, window=None) -> torch.Tensor:
    outs = []
    qsl = case.query_start_loc.tolist()
    for i in range(len(case.dense_k)):
        q = case.query[qsl[i] : qsl[i + 1]]
        outs.append(dense_attention(q, case.dense_k[i], case.dense_v[i], case.scale, window))
    return torch.cat(outs)


# absolute/relative tolerance per dtype (outputs are O(1))
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}


def assert_close(actual, expected, dtype):
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


# one batch mixing decode rows (ctx 1, a block boundary, boundary + 1), a prefill chunk over a
# cached prefix, and a whole prompt; bs is substituted in
def mixed_lens(bs):
    # the last sequence: a 70-token chunk after 80 cached tokens spans several query and key tiles
    return [1, bs, bs + 1, 2 * bs + 7, 19, 150], [1, 1, 1, 9, 19, 70]


def random_lens(seed: int, bs: int) -> tuple[list[int], list[int]]:
    """A ragged batch: mostly decode rows, a few prefill chunks, lengths near block edges."""
    g = torch.Generator().manual_seed(seed)
    ctx, ql = [], []
    for _ in range(6):
        c = int(torch.randint(1, 5, (1,), generator=g)) * bs + int(torch.randint(-1, 2, (1,), generator=g))
        c = max(c, 1)
        q = 1 if torch.rand(1, generator=g) < 0.6 else int(torch.randint(1, c + 1, (1,), generator=g))
        ctx.append(c)
        ql.append(q)
    return ctx, ql


# ------------------------------------------------------------------------------ reference vs dense


@pytest.mark.parametrize(
    "group,dtype,bs,window",
    [
        (1, torch.float32, 16, None),
        (3, torch.float32, 32, None),
        (8, torch.float32, 16, 5),
        (3, torch.bfloat16, 16, None),
        (8, torch.float16, 32, 12),
    ],
)
def test_reference_matches_dense(group, dtype, bs, window):
    ctx, ql = mixed_lens(bs)
    case = make_case(
        ctx + [3 * bs], ql + [1], kvh=2, group=group, d=64, bs=bs, dtype=dtype, seed=group, fill=0.0
    )
    out = R.paged_attention(*case.args(), sliding_window=window)
    assert out.dtype == dtype and out.shape == case.query.shape
    assert_close(out, dense_batch(case, window), dtype)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_reference_random_ragged(seed):
    bs = (16, 32)[seed % 2]
    ctx, ql = random_lens(seed, bs)
    group = (1, 3, 8, 2)[seed]
    case = make_case(ctx, ql, kvh=2, group=group, d=64, bs=bs, dtype=torch.float32, seed=seed, fill=0.0)
    window = 7 if seed == 3 else None
    assert_close(
        R.paged_attention(*case.args(), sliding_window=window), dense_batch(case, window), torch.float32
    )


def test_reference_pure_decode_and_hints():
    case = make_case(
        [1, 16, 17, 50], [1] * 4, kvh=3, group=3, d=64, bs=16, dtype=torch.float32, seed=1, fill=0.0
    )
    want = dense_batch(case)
    out = torch.full_like(case.query, 7.0)
    got = R.paged_attention(*case.args(), max_query_len=1, max_context_len=4096, out=out)  # loose bound
    assert got is out
    assert_close(out, want, torch.float32)
    # windowed decode skips leading blocks; still exact
    assert_close(R.paged_attention(*case.args(), sliding_window=20), dense_batch(case, 20), torch.float32)


def test_reference_decode_length_buckets():
    # Widely ragged decode batches are split into length buckets on CPU; results must not change.
    lens = [1, 3, 16, 17, 40, 90, 120, 200, 201, 33, 64, 5]
    assert R._decode_buckets(torch.tensor(lens), 16) is not None
    case = make_case(lens, [1] * len(lens), kvh=3, group=3, d=64, bs=16, dtype=torch.float32, seed=5, fill=0.0)
    assert_close(R.paged_attention(*case.args()), dense_batch(case), torch.float32)
    assert_close(R.paged_attention(*case.args(), sliding_window=24), dense_batch(case, 24), torch.float32)


def test_reference_prefill_only_and_zero_len_seq():
    # a sequence with no query rows this step must not disturb the others
    case = make_case(
        [40, 8, 5], [40, 0, 5], kvh=1, group=4, d=64, bs=16, dtype=torch.float32, seed=2, fill=0.0
    )
    qsl = case.query_start_loc.tolist()
    got = R.paged_attention(*case.args())
    want = torch.cat(
        [
            dense_attention(case.query[qsl[i] : qsl[i + 1]], case.dense_k[i], case.dense_v[i], case.scale)
            for i in (0, 2)
        ]
    )
    assert_close(got, want, torch.float32)


@pytest.mark.parametrize(("group", "window"), [(1, None), (3, None), (4, 100), (2, 9)])
def test_reference_whole_prompt_chunks(group, window):
    # chunks that start at position 0 take the mask-free causal SDPA path (unless a window bites)
    ctx = [70, 1, 33, 128]
    case = make_case(ctx, ctx, kvh=2, group=group, d=64, bs=16, dtype=torch.float32, seed=11, fill=0.0)
    assert_close(R.paged_attention(*case.args(), sliding_window=window), dense_batch(case, window), torch.float32)
    # the native CPU backend shares this prefill path
    if K.cpu_native.available():
        got = K.cpu_native.paged_attention(*case.args(), sliding_window=window)
        assert_close(got, dense_batch(case, window), torch.float32)


def test_reference_rejects_bad_gqa():
    case = make_case([4], [1], kvh=2, group=1, d=64, bs=16, dtype=torch.float32, seed=3, fill=0.0)
    with pytest.raises(ValueError, match="multiple"):
        R.paged_attention(case.query[:, :1].repeat(1, 3, 1), *case.args()[1:])


# (query/model dtype, cache dtype): kv_cache_dtype may store the cache narrower or wider than the model
MIXED_KV = [(torch.float32, torch.float16), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16)]


def as_cache(case: Case, kv_dtype: torch.dtype) -> Case:
    """``case`` with its caches stored as ``kv_dtype``: the dense inputs become the rounded values the
    cache holds, so a kernel is checked against what it can read, not what a wider cache would hold."""
    return replace(case, k_cache=case.k_cache.to(kv_dtype), v_cache=case.v_cache.to(kv_dtype),
                   dense_k=[k.to(kv_dtype) for k in case.dense_k], dense_v=[v.to(kv_dtype) for v in case.dense_v])


@pytest.mark.parametrize(("q_dtype", "kv_dtype"), MIXED_KV)
def test_reference_reads_a_cache_of_another_dtype(q_dtype, kv_dtype):
    # decode rows beside prefill chunks (one over a cached prefix, whole prompts), then a ragged
    # pure-decode batch (the length-bucket path)
    ctx, ql = mixed_lens(16)
    mixed = as_cache(make_case(ctx, ql, kvh=2, group=3, d=64, bs=16, dtype=q_dtype, seed=21, fill=0.0), kv_dtype)
    lens = [1, 3, 16, 17, 40, 90, 120, 200, 201, 33, 64, 5]
    decode = as_cache(make_case(lens, [1] * len(lens), kvh=2, group=3, d=64, bs=16, dtype=q_dtype, seed=22,
                                fill=0.0), kv_dtype)
    for case in (mixed, decode):
        out = R.paged_attention(*case.args())
        assert out.dtype == q_dtype
        assert_close(out, dense_batch(case), q_dtype)
    assert_close(R.paged_attention(*mixed.args(), sliding_window=9), dense_batch(mixed, 9), q_dtype)


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_store_kv_converts_to_the_cache_dtype(src_dtype):
    g = torch.Generator().manual_seed(4)
    key = torch.randn(5, 2, 8, generator=g).to(src_dtype)
    value = torch.randn(5, 2, 8, generator=g).to(src_dtype)
    # past float16's range: stored as +-65504 (a clamped key), never as inf (a NaN softmax)
    key[0, 0, :3] = torch.tensor([1e6, -1e6, 70000.0]).to(src_dtype)
    value[1, 1, :2] = torch.tensor([-3e38, 65519.0]).to(src_dtype)
    slots = torch.tensor([0, 17, -1, 31, 5])
    for cache_dtype in (torch.float16, torch.bfloat16):
        kc = torch.zeros(2, 16, 2, 8, dtype=cache_dtype)
        vc = torch.zeros_like(kc)
        K.store_kv(key, value, kc, vc, slots)  # the dispatch: reference on CPU tensors
        real = slots >= 0
        fp16_max = torch.finfo(torch.float16).max
        for src, cache in ((key, kc), (value, vc)):
            want = src[real].float()
            if cache_dtype == torch.float16:
                want = want.clamp(-fp16_max, fp16_max)
            assert cache.dtype == cache_dtype and bool(cache.isfinite().all())
            assert torch.equal(cache.flatten(0, 1)[slots[real]], want.to(cache_dtype))
        assert kc.count_nonzero() == 4 * 2 * 8
    assert torch.equal(R.to_cache_dtype(key, src_dtype), key)  # same dtype: the very tensor


def naive_store(key, value, kc, vc, slots):
    bs = kc.shape[1]
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            kc[s // bs, s % bs] = key[t]
            vc[s // bs, s % bs] = value[t]


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_reference_store_kv(slot_dtype):
    g = torch.Generator().manual_seed(0)
    kc = torch.zeros(5, 16, 2, 64, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    key = torch.randn(6, 2, 64, generator=g).bfloat16()
    value = torch.randn(6, 2, 64, generator=g).bfloat16()
    slots = torch.tensor([0, 15, 16, -1, 79, 33], dtype=slot_dtype)
    kc2, vc2 = kc.clone(), vc.clone()
    R.store_kv(key, value, kc, vc, slots)
    naive_store(key, value, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert kc.count_nonzero() == 5 * 2 * 64  # five real slots written, the padding one skipped


def test_reference_copy_and_swap_blocks():
    g = torch.Generator().manual_seed(0)
    ks = [torch.randn(6, 16, 2, 8, generator=g) for _ in range(3)]
    vs = [torch.randn(6, 16, 2, 8, generator=g) for _ in range(3)]
    before_k = [k.clone() for k in ks]
    before_v = [v.clone() for v in vs]
    R.copy_blocks(ks, vs, torch.tensor([[0, 4], [2, 5]]))
    for k, v, bk, bv in zip(ks, vs, before_k, before_v, strict=True):
        assert torch.equal(k[4], bk[0]) and torch.equal(k[5], bk[2]) and torch.equal(k[:4], bk[:4])
        assert torch.equal(v[4], bv[0]) and torch.equal(v[5], bv[2]) and torch.equal(v[:4], bv[:4])
    host = torch.zeros(3, 16, 2, 8)
    K.swap_blocks(ks[0], host, torch.tensor([[1, 2], [3, 0]]))
    assert torch.equal(host[2], ks[0][1]) and torch.equal(host[0], ks[0][3]) and not host[1].any()


# --------------------------------------------------------------------------------------- dispatch


def test_dispatch_backend_choice(kernel_settings):
    cpu = torch.zeros(1)
    kernel_settings(attention_backend="auto")
    assert K.backend_for(cpu) == "torch"
    kernel_settings(attention_backend="torch")
    assert K.backend_for(cpu) == "torch"
    with pytest.raises(ValueError, match="attention_backend"):
        K.KernelSettings(attention_backend="cuda")


def test_dispatch_without_triton(monkeypatch, kernel_settings):
    # as if triton were not installed: CPU work still runs, forcing triton says why it cannot
    monkeypatch.setattr(K._TRITON, "module", None)
    monkeypatch.setattr(K._TRITON, "error", ImportError("No module named 'triton'"))
    kernel_settings(attention_backend="auto")
    assert not K.triton_available()
    case = make_case([5], [5], kvh=1, group=2, d=64, bs=16, dtype=torch.float32, seed=8, fill=0.0)
    assert_close(K.paged_attention(*case.args()), dense_batch(case), torch.float32)
    with pytest.raises(RuntimeError, match="triton cannot be imported"):  # at engine start, not at a step
        kernel_settings(attention_backend="triton")
    assert K.current().attention_backend == "auto"


def test_dispatch_torch_matches_reference(kernel_settings):
    kernel_settings(attention_backend="torch")
    case = make_case(*mixed_lens(16), kvh=2, group=3, d=64, bs=16, dtype=torch.float32, seed=5, fill=0.0)
    assert_close(K.paged_attention(*case.args()), dense_batch(case), torch.float32)


# ------------------------------------------------------------------------------ native CPU kernel

needs_cc = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler to build the CPU kernel"
)


@needs_cc
@pytest.mark.parametrize(
    "group,d,bs,window",
    [(1, 64, 16, None), (3, 64, 16, None), (8, 128, 32, None), (3, 64, 32, 5), (8, 64, 16, 40), (2, 256, 16, None)],
)
def test_native_cpu_matches_dense(group, d, bs, window):
    from kvpilot.kernels import cpu_native

    ctx, ql = mixed_lens(bs)
    # NaN in every unused slot and -1 table padding: reading outside a context would show
    case = make_case(ctx + [3 * bs], ql + [1], kvh=2, group=group, d=d, bs=bs, dtype=torch.float32, seed=group)
    out = cpu_native.paged_attention(*case.args(), sliding_window=window)
    assert_close(out, dense_batch(case, window), torch.float32)


@needs_cc
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_native_cpu_random_ragged_and_threads(seed):
    from kvpilot.kernels import cpu_native

    bs = (16, 32)[seed % 2]
    g = torch.Generator().manual_seed(seed)
    ctx = [max(1, int(torch.randint(1, 12, (1,), generator=g)) * bs + int(torch.randint(-1, 2, (1,), generator=g)))
           for _ in range(40)]
    ql = [1] * 37 + [ctx[37], min(3, ctx[38]), 1]  # decode rows around two prefill chunks
    case = make_case(ctx, ql, kvh=3, group=(1, 3, 8, 2)[seed], d=64, bs=bs, dtype=torch.float32, seed=seed)
    want = dense_batch(case)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 5):  # rows are shared out among threads; each row is computed the same way
            torch.set_num_threads(n)
            assert_close(cpu_native.paged_attention(*case.args()), want, torch.float32)
    finally:
        torch.set_num_threads(threads)


@needs_cc
def test_native_cpu_out_rows_and_hints():
    from kvpilot.kernels import cpu_native

    case = make_case([1, 16, 17, 50], [1] * 4, kvh=3, group=3, d=64, bs=16, dtype=torch.float32, seed=1)
    # a strided out buffer with an extra row past query_start_loc[-1]: that row stays untouched
    buf = torch.full((5, 9, 128), 7.0)
    out = buf[:, :, :64]
    got = cpu_native.paged_attention(*case.args(), max_query_len=1, max_context_len=4096, out=out)
    assert got is out
    assert_close(out[:4], dense_batch(case), torch.float32)
    assert bool((out[4] == 7.0).all()) and bool((buf[:, :, 64:] == 7.0).all())


def _spy_prefill(monkeypatch, dtype):
    """Record the C prefill entry point's calls for caches of ``dtype`` and unbind the other one."""
    from kvpilot.kernels import cpu_native

    cpu_native.available()
    if dtype not in cpu_native._prefill_fns:
        pytest.skip(f"this build has no {dtype} prefill kernel")
    calls: list[int] = []
    real = cpu_native._prefill_fns[dtype]

    def spy(*args):
        calls.append(args[8])  # num_seqs
        return real(*args)

    monkeypatch.setattr(cpu_native, "_prefill_fns", {dtype: spy})
    return calls


@needs_cc
@pytest.mark.parametrize(
    "group,d,bs,window,kv_dtype",
    [
        (3, 64, 16, None, torch.float32),
        (1, 64, 32, None, torch.float32),
        (16, 64, 16, None, torch.float32),  # the widest group the kernel serves
        (4, 128, 16, 50, torch.float32),
        (3, 40, 16, 7, torch.float32),  # a head size off the 32-wide output tile
        (3, 64, 16, 33, torch.float16),
        (2, 80, 32, None, torch.float16),
        (3, 64, 16, 33, torch.bfloat16),
        (2, 80, 32, None, torch.bfloat16),
    ],
)
def test_native_cpu_prefill_kernel(monkeypatch, group, d, bs, window, kv_dtype):
    # chunks over cached prefixes and whole prompts, several 32-position query tiles and 64-key tiles
    # each, lengths off every tile and block edge; NaN in unused slots, -1 table padding
    ctx = [150, 300, 33, 2, 97, 1, 700]
    ql = [70, 100, 33, 2, 97, 1, 600]  # 600: a long chunk, taken by wider query tasks
    case = make_case(ctx, ql, kvh=2, group=group, d=d, bs=bs, dtype=torch.float32, seed=group * d)
    case = as_cache(case, kv_dtype)
    from kvpilot.kernels import cpu_native

    calls = _spy_prefill(monkeypatch, kv_dtype)
    want = dense_batch(case, window)
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):  # tasks are shared out among threads; each is computed the same way
            torch.set_num_threads(n)
            assert_close(cpu_native.paged_attention(*case.args(), sliding_window=window), want, torch.float32)
    finally:
        torch.set_num_threads(threads)
    assert calls and all(c == len(ctx) for c in calls)


@needs_cc
@pytest.mark.parametrize("group,d,bs,window", [(3, 64, 16, None), (16, 64, 16, None), (4, 128, 16, 50),
                                               (3, 64, 16, 33), (2, 80, 32, None), (3, 40, 16, 7)])
def test_native_cpu_prefill_kernel_bfloat16_model(monkeypatch, group, d, bs, window):
    # a bfloat16 model's prompt chunks (bfloat16 queries over a bfloat16 cache): on CPUs with bfloat16 dot
    # products the kernel's pair panels (K pairs along the head dims, V pairs along the keys, 80 and 40 padded
    # to whole panels); the same chunks as the float32 test above, NaN in unused slots
    ctx = [150, 300, 33, 2, 97, 1, 700]
    ql = [70, 100, 33, 2, 97, 1, 600]
    case = as_cache(make_case(ctx, ql, kvh=2, group=group, d=d, bs=bs, dtype=torch.float32, seed=group * d + 1),
                    torch.bfloat16)
    case = replace(case, query=case.query.bfloat16())
    from kvpilot.kernels import cpu_native

    calls = _spy_prefill(monkeypatch, torch.bfloat16)
    want = dense_batch(case, window)  # float32 over the bfloat16 values
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            got = cpu_native.paged_attention(*case.args(), sliding_window=window)
            assert got.dtype == torch.bfloat16
            # rounded weights and output: a few bfloat16 steps at most, on average well under one
            torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
            assert (got.float() - want).abs().mean().item() < 2e-3
    finally:
        torch.set_num_threads(threads)
    assert calls and all(c == len(ctx) for c in calls)


@needs_cc
def test_native_cpu_prefill_wide_groups_fall_back_to_sdpa(monkeypatch):
    from kvpilot.kernels import cpu_native

    calls = _spy_prefill(monkeypatch, torch.float32)
    case = make_case([40, 1], [40, 1], kvh=1, group=17, d=64, bs=16, dtype=torch.float32, seed=5)
    assert_close(cpu_native.paged_attention(*case.args()), dense_batch(case), torch.float32)
    assert calls == []


@needs_cc
def test_dispatch_picks_native_cpu_for_float32_and_bfloat16(kernel_settings):
    kernel_settings(attention_backend="auto")
    f32 = make_case([20], [1], kvh=1, group=2, d=64, bs=16, dtype=torch.float32, seed=3, fill=0.0)
    bf16 = make_case([20], [1], kvh=1, group=2, d=64, bs=16, dtype=torch.bfloat16, seed=3, fill=0.0)
    fp16 = make_case([20], [1], kvh=1, group=2, d=64, bs=16, dtype=torch.float16, seed=3, fill=0.0)
    assert K.attention_backend_for(f32.query, f32.k_cache) == "cpu"
    assert K.attention_backend_for(bf16.query, bf16.k_cache) == "cpu"  # a bfloat16 model: widened queries
    assert K.attention_backend_for(fp16.query, fp16.k_cache) == "torch"  # float16 queries: the reference
    kernel_settings(attention_backend="torch")
    assert K.attention_backend_for(f32.query, f32.k_cache) == "torch"
    kernel_settings(attention_backend="cpu")
    assert_close(K.paged_attention(*f32.args()), dense_batch(f32), torch.float32)
    got = K.paged_attention(*bf16.args())
    assert got.dtype == torch.bfloat16
    assert_close(got, dense_batch(bf16), torch.bfloat16)
    with pytest.raises(RuntimeError, match="bfloat16 CPU queries"):
        K.paged_attention(*fp16.args())


def _compiler_has_float16() -> bool:
    """What the kernel's float16 entry point needs: _Float16 in the compiler cpu_native builds with."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    r = subprocess.run([cc, "-march=native", "-dM", "-E", "-x", "c", "-"], input="", capture_output=True, text=True)
    return "__FLT16_MAX__" in r.stdout


def _decode_entry_point(monkeypatch, kv_dtype: torch.dtype) -> list[tuple[int, int]]:
    """Spy on the C decode entry point of ``kv_dtype`` caches (the (k, v) cache pointers of each call) and
    unbind the float32 one, so a call that did not run that variant shows."""
    from kvpilot.kernels import cpu_native

    if kv_dtype not in cpu_native.cache_dtypes():
        assert kv_dtype == torch.float16, f"every build has the {kv_dtype} kernel"
        assert not _compiler_has_float16(), "the compiler has _Float16 but the kernel has no float16 entry point"
        pytest.skip("the C compiler has no _Float16: the kernel reads no float16 caches")
    calls: list[tuple[int, int]] = []
    real = cpu_native._fns[kv_dtype]

    def spy(*args):
        calls.append((args[2], args[3]))
        return real(*args)

    monkeypatch.setitem(cpu_native._fns, kv_dtype, spy)
    monkeypatch.delitem(cpu_native._fns, torch.float32)
    return calls


@needs_cc
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "group,d,bs,window",
    [(1, 64, 16, None), (3, 64, 16, None), (8, 128, 32, None), (3, 64, 32, 5), (6, 64, 16, 7), (2, 36, 16, 40),
     (2, 256, 16, None)],
)
def test_native_cpu_16bit_cache(monkeypatch, group, d, bs, window, kv_dtype):
    # d=36 leaves a tail after the 8-wide conversions; 36 and 256 take the plain loops, 64 and 128 the
    # vector path (groups of 6 and 8: its V rows go to 4 heads at a time)
    from kvpilot.kernels import cpu_native

    ctx, ql = mixed_lens(bs)
    case = make_case(ctx + [3 * bs], ql + [1], kvh=2, group=group, d=d, bs=bs, dtype=torch.float32, seed=group + d)
    narrow = as_cache(case, kv_dtype)  # NaN in the unused slots stays NaN
    # the float32 kernel over the very values the 16-bit cache holds: widening them is exact
    same_values = cpu_native.paged_attention(*narrow.args(narrow.k_cache.float(), narrow.v_cache.float()),
                                             sliding_window=window)
    calls = _decode_entry_point(monkeypatch, kv_dtype)
    got = cpu_native.paged_attention(*narrow.args(), sliding_window=window)
    assert calls == [(narrow.k_cache.data_ptr(), narrow.v_cache.data_ptr())]
    assert got.dtype == torch.float32
    assert_close(got, same_values, torch.float32)
    assert_close(got, dense_batch(narrow, window), torch.float32)
    # against the unrounded float32 values: off by what the storage costs (2^-11 / 2^-8 relative per value)
    assert_close(got, dense_batch(case, window), kv_dtype)


def sdpa_bfloat16(case: Case) -> torch.Tensor:
    """What a bfloat16 HF model's attention computes: torch's SDPA on bfloat16 q/K/V, sequence by sequence."""
    outs, qsl = [], case.query_start_loc.tolist()
    for i, (k, v) in enumerate(zip(case.dense_k, case.dense_v, strict=True)):
        q = case.query[qsl[i] : qsl[i + 1]].transpose(0, 1)[None]
        group = q.shape[1] // k.shape[1]
        k, v = (x.repeat_interleave(group, dim=1).transpose(0, 1)[None] for x in (k, v))
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(k.shape[2] - q.shape[2])
        outs.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=case.scale)[0]
                    .transpose(0, 1))
    return torch.cat(outs)


@needs_cc
def test_native_cpu_bfloat16_queries_over_a_bfloat16_cache(monkeypatch):
    # a bfloat16 model: bfloat16 queries over a bfloat16 cache, the output rounded once as it is written. On
    # CPUs with bfloat16 dot products both kernels multiply the bfloat16 values pairwise (exact products,
    # float32 sums), and the prefill kernel rounds its softmax weights to bfloat16 for the product with V, as
    # torch's bfloat16 SDPA does; elsewhere the queries are widened and all arithmetic is float32.
    from kvpilot.kernels import cpu_native

    ctx, ql = [1, 16, 17, 39, 19, 150, 300, 200], [1, 1, 1, 9, 19, 70, 300, 1]
    case = make_case(ctx, ql, kvh=3, group=3, d=64, bs=16, dtype=torch.bfloat16, seed=11)
    widened = replace(case, query=case.query.float())
    want = cpu_native.paged_attention(*widened.args())  # the float32-query call over the same cache
    calls = _decode_entry_point(monkeypatch, torch.bfloat16)
    prefill_calls = _spy_prefill(monkeypatch, torch.bfloat16)
    got = cpu_native.paged_attention(*case.args())
    assert got.dtype == torch.bfloat16 and len(calls) == 1 and prefill_calls == [len(ctx)]
    decode = torch.tensor([q == 1 for q in ql for _ in range(q)])
    # decode rows: the float32 result up to the order of its sums, then rounded: within one bfloat16 step of it
    torch.testing.assert_close(got[decode].float(), want[decode], atol=1e-6, rtol=2**-7)
    assert (got[decode] != want[decode].to(torch.bfloat16)).float().mean().item() < 0.02
    # prefill rows: no further from the exact result (float64) than torch's own bfloat16 SDPA
    exact = dense_batch(replace(case, query=case.query.double(), dense_k=[k.double() for k in case.dense_k],
                                dense_v=[v.double() for v in case.dense_v])).double()
    ours = (got[~decode].double() - exact[~decode]).abs()
    torchs = (sdpa_bfloat16(case)[~decode].double() - exact[~decode]).abs()
    assert ours.mean() <= 1.05 * torchs.mean() and ours.max() <= 1.05 * torchs.max() + 2**-9
    assert_close(got, dense_batch(case), torch.bfloat16)
    # a strided out (rows of a wider buffer) gets the same values, and rows past the batch stay untouched
    buf = torch.full((got.shape[0] + 2, got.shape[1], 2 * got.shape[2]), 7.0, dtype=torch.bfloat16)
    out = buf[:, :, : got.shape[2]]
    cpu_native.paged_attention(*case.args(), out=out)
    assert torch.equal(out[: got.shape[0]], got) and bool((buf[got.shape[0]:] == 7.0).all())
    # a float32 out keeps the float32 result unrounded
    wide_out = cpu_native.paged_attention(*case.args(), out=torch.empty(got.shape, dtype=torch.float32))
    assert torch.equal(wide_out, want)


@needs_cc
def test_native_cpu_float16_cache_ragged_and_threads(monkeypatch):
    from kvpilot.kernels import cpu_native

    g = torch.Generator().manual_seed(7)
    ctx = [max(1, int(torch.randint(1, 12, (1,), generator=g)) * 16 + int(torch.randint(-1, 2, (1,), generator=g)))
           for _ in range(40)]
    ql = [1] * 37 + [ctx[37], min(3, ctx[38]), 1]
    case = as_cache(make_case(ctx, ql, kvh=3, group=3, d=64, bs=16, dtype=torch.float32, seed=7), torch.float16)
    want = dense_batch(case)
    calls = _decode_entry_point(monkeypatch, torch.float16)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 5):
            torch.set_num_threads(n)
            assert_close(cpu_native.paged_attention(*case.args()), want, torch.float32)
    finally:
        torch.set_num_threads(threads)
    assert len(calls) == 3


@needs_cc
def test_dispatch_picks_native_cpu_for_float16_caches(kernel_settings):
    from kvpilot.kernels import cpu_native

    kernel_settings(attention_backend="auto")
    f32 = make_case([20, 40], [1, 1], kvh=1, group=2, d=64, bs=16, dtype=torch.float32, seed=3, fill=0.0)
    bf16 = as_cache(f32, torch.bfloat16)
    if torch.float16 in cpu_native.cache_dtypes():
        half = as_cache(f32, torch.float16)
        assert K.attention_backend_for(half.query, half.k_cache) == "cpu"
        assert_close(K.paged_attention(*half.args()), dense_batch(half), torch.float32)
    assert K.attention_backend_for(bf16.query, bf16.k_cache) == "cpu"  # bfloat16 caches: the bf16kv variant
    assert_close(K.paged_attention(*bf16.args()), dense_batch(bf16), torch.float32)
    fp16_q = replace(f32, query=f32.query.half(), k_cache=f32.k_cache.half(), v_cache=f32.v_cache.half())
    assert K.attention_backend_for(fp16_q.query, fp16_q.k_cache) == "torch"  # no float16 queries
    with pytest.raises(ValueError, match="caches of one dtype"):
        cpu_native.paged_decode(f32.query, f32.k_cache.half(), f32.v_cache, f32.block_tables, f32.context_lens,
                                f32.query_start_loc, f32.scale, None, torch.empty(f32.query.shape))


def _python_with_cache(code: str, cache: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`python -c code args` in a fresh process (what is loaded at import shows there) with its own
    KVPILOT_CACHE_DIR, so the kernel is built as on a clean machine."""
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env=dict(os.environ, KVPILOT_CACHE_DIR=str(cache), **env))


@needs_cc
def test_native_cpu_kernel_builds_into_a_fresh_cache(tmp_path):
    # what a clean machine does on first use: compile, cache, load; the cpu_kernels setting off opts out
    code = (
        "import pathlib, sys; from kvpilot.kernels import cpu_native as c, ops; "
        "sys.argv[2:] and ops.configure(ops.KernelSettings(cpu_kernels=False)); "
        "print(c.available(), len(list(pathlib.Path(sys.argv[1]).glob('kernels/*.so'))), c.build_error())"
    )
    r = _python_with_cache(code, tmp_path, str(tmp_path))
    assert r.stdout.split()[:2] == ["True", "1"], r.stdout + r.stderr
    r = _python_with_cache(code, tmp_path, str(tmp_path), "off")
    assert r.stdout.startswith("False 1 disabled"), r.stdout + r.stderr


@needs_cc
@pytest.mark.slow
@pytest.mark.parametrize("flags,dropped", [("-mno-avx2 -mno-fma", ("__AVX2__", "__FMA__")),
                                           ("-mno-avx512f", ("__AVX512F__",)),
                                           ("-mno-avx512bf16", ("__AVX512BF16__",))],
                         ids=["portable", "avx2", "avx512-without-bf16"])
def test_narrower_builds_pass_the_kernel_tests(tmp_path, flags, dropped):
    # CPUs without AVX2/FMA run the kernels' plain C loops, AVX2-only CPUs their AVX2 paths, and AVX-512 CPUs
    # without bfloat16 dot products a bfloat16 model's attention in float32, where this machine may have more:
    # build the library with those extensions off into a fresh cache and run every native-kernel test against
    # it, this file's, the attention features' (soft-cap, sinks), the GGUF and the MoE kernels' in one child
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    native = subprocess.run([cc, "-march=native", "-dM", "-E", "-x", "c", "-"], input="", capture_output=True,
                            text=True)
    if not all(f"#define {macro} " in native.stdout for macro in dropped):
        pytest.skip(f"the native build has no {' '.join(dropped)} to turn off: it runs the narrower paths already")
    probe = subprocess.run([cc, "-march=native", *flags.split(), "-dM", "-E", "-x", "c", "-"], input="",
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"{cc} does not take {flags}")
    assert not any(f"#define {macro} " in probe.stdout for macro in dropped)
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
         str(Path(__file__).with_name("test_attention_features.py")),
         str(Path(__file__).with_name("test_gguf_kernels.py")), str(Path(__file__).with_name("test_moe_native.py")),
         "-k", "native and not narrower"],
        capture_output=True, text=True, timeout=900, cwd=Path(__file__).parent,
        env=dict(os.environ, KVPILOT_CACHE_DIR=str(tmp_path), KVPILOT_TEST_CPU_KERNEL_CFLAGS=flags),
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " failed" not in r.stdout
    assert len(list(tmp_path.glob("kernels/*.so"))) == 1  # the narrower build, keyed apart from the native one


@needs_cc
def test_loading_the_native_kernel_keeps_subnormal_floats(tmp_path):
    # A -ffast-math link would switch the process to flush-to-zero on load, changing torch's and Python's
    # arithmetic everywhere (hypothesis then fails with FloatingPointError in unrelated tests).
    code = (
        "import sys, torch; from kvpilot.kernels import cpu_native as c; assert c.available(), c.build_error(); "
        "print(sys.float_info.min / 2 > 0, (torch.full((1 << 16,), 1e-39) * 1.0).min().item() > 0)"
    )
    r = _python_with_cache(code, tmp_path)
    assert r.stdout.split() == ["True", "True"], r.stdout + r.stderr


# ------------------------------------------------------------------------ Triton tests


# @triton.jit (triton's own library included) reads TRITON_INTERPRET when triton is imported, which
# in a pytest session may already have happened. So these tests run in a fresh interpreter that has
# the variable from the start: a normal run spawns it; that child defines and runs test_triton_*.
# With KVPILOT_TEST_TRITON_DEVICE=cuda the same tests run the compiled kernels on a GPU instead: each
# call gets device copies of its CPU arguments (strides kept) and in-place results are copied back.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_TEST_DEVICE = os.environ.get("KVPILOT_TEST_TRITON_DEVICE", "").strip()


def _triton_child(env_update: dict[str, str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, **env_update)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "test_triton_", __file__]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


if not (INTERPRETED or TRITON_TEST_DEVICE):

    @pytest.mark.slow
    @pytest.mark.parametrize("through_copies", [False, True], ids=["direct", "on-device-copies"])
    def test_kernels_under_triton_interpreter(through_copies):
        # through_copies: the same tests through OnDevice on CPU copies, which checks the copying that a
        # compiled run on a GPU relies on
        pytest.importorskip("triton")
        r = _triton_child({"TRITON_INTERPRET": "1", **({"KVPILOT_TEST_TRITON_DEVICE": "cpu"} if through_copies else {})})
        assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-4000:]
        assert " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-2000:]

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled Triton kernels need a CUDA GPU")
    def test_kernels_compiled_on_cuda():
        pytest.importorskip("triton")
        r = _triton_child({"TRITON_INTERPRET": "0", "KVPILOT_TEST_TRITON_DEVICE": "cuda"})
        assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-4000:]
        assert " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-2000:]


class OnDevice:
    """The Triton module's functions, called on ``device`` copies of their CPU tensor arguments (lists
    too). Copies keep the strides (a query sliced from a fused projection stays a strided view); after the
    call every argument is copied back, so in-place writes (store_kv, copy_blocks, ``out=``) land in the
    test's tensors, and a result that is one of the arguments comes back as that argument."""

    def __init__(self, module, device: str) -> None:
        self.module = module
        self.device = torch.device(device)

    def _to_device(self, x, pairs: list):
        if isinstance(x, torch.Tensor):
            copy = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=self.device)
            copy.copy_(x)
            pairs.append((x, copy))
            return copy
        if isinstance(x, list | tuple):
            return type(x)(self._to_device(v, pairs) for v in x)
        return x

    def __getattr__(self, name: str):
        fn = getattr(self.module, name)
        if not callable(fn) or name.startswith("_"):
            return fn

        def call(*args, **kwargs):
            pairs: list = []
            dev_args = self._to_device(list(args), pairs)
            dev_kwargs = {k: self._to_device(v, pairs) for k, v in kwargs.items()}
            result = fn(*dev_args, **dev_kwargs)
            for original, copy in pairs:
                original.copy_(copy.cpu())
            if isinstance(result, torch.Tensor):
                same = [orig for orig, copy in pairs if copy is result]
                return same[0] if same else result.cpu()
            return result

        return call


@pytest.fixture(scope="module")
def tk():
    import triton.language as tl

    import kvpilot.kernels.triton_kernels as mod

    if TRITON_TEST_DEVICE == "cuda":
        assert torch.cuda.is_available() and not mod._INTERPRET, "compiled kernels need CUDA, no interpreter"
        return OnDevice(mod, "cuda")
    # fail loudly rather than test compiled kernels on CPU tensors (or crash inside them)
    assert mod._INTERPRET and type(tl.standard.cdiv).__name__ == "InterpretedFunction"
    # KVPILOT_TEST_TRITON_DEVICE=cpu: the interpreter through OnDevice's copies (checks the copying itself)
    return OnDevice(mod, "cpu") if TRITON_TEST_DEVICE == "cpu" else mod


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_store_kv(tk, dtype):
    g = torch.Generator().manual_seed(1)
    kvh, d, h = 3, 64, 9
    # key/value as strided slices of a fused qkv projection, as the model produces them
    qkv = torch.randn(7, (h + 2 * kvh) * d, generator=g).to(dtype)
    key = qkv[:, h * d : (h + kvh) * d].view(7, kvh, d)
    value = qkv[:, (h + kvh) * d :].view(7, kvh, d)
    kc = torch.zeros(4, 16, kvh, d, dtype=dtype)
    vc = torch.zeros_like(kc)
    kc2, vc2 = kc.clone(), vc.clone()
    slots = torch.tensor([3, -1, 16, 17, 63, -1, 32], dtype=torch.int64)
    tk.store_kv(key, value, kc, vc, slots)
    R.store_kv(key, value, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert kc.count_nonzero() == 5 * kvh * d


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_triton_store_kv_converts_to_a_float16_cache(tk, src_dtype):
    g = torch.Generator().manual_seed(3)
    key = torch.randn(6, 2, 64, generator=g).to(src_dtype)
    value = torch.randn(6, 2, 64, generator=g).to(src_dtype)
    key[0, 0, :3] = torch.tensor([1e6, -1e6, 70000.0]).to(src_dtype)  # saturate at +-65504, as the reference
    value[2, 1, :2] = torch.tensor([-3e38, 65519.0]).to(src_dtype)
    slots = torch.tensor([3, -1, 16, 17, 63, 32], dtype=torch.int64)
    kc = torch.zeros(4, 16, 2, 64, dtype=torch.float16)
    vc = torch.zeros_like(kc)
    kc2, vc2 = kc.clone(), vc.clone()
    tk.store_kv(key, value, kc, vc, slots)
    R.store_kv(key, value, kc2, vc2, slots)
    assert bool(kc.isfinite().all()) and bool(vc.isfinite().all())
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


@pytest.mark.parametrize(("q_dtype", "kv_dtype"), [(torch.float32, torch.float16), (torch.bfloat16, torch.float16)])
def test_triton_reads_a_cache_of_another_dtype(tk, q_dtype, kv_dtype):
    # the kernel upcasts (or casts) what it loads to the query's dtype: prefill tiles, decode rows, splits
    case = as_cache(make_case(*mixed_lens(16), kvh=2, group=3, d=64, bs=16, dtype=q_dtype, seed=13), kv_dtype)
    kc, vc = case.k_cache.nan_to_num(0.0), case.v_cache.nan_to_num(0.0)
    got = tk.paged_attention(*case.args())
    assert got.dtype == q_dtype and not got.isnan().any()
    assert_close(got, R.paged_attention(*case.args(kc, vc)), q_dtype)
    assert_close(got, dense_batch(case), q_dtype)
    dec = as_cache(make_case([300, 1, 65], [1, 1, 1], kvh=1, group=8, d=64, bs=16, dtype=q_dtype, seed=14), kv_dtype)
    got = tk.paged_attention(*dec.args(), max_query_len=1, max_context_len=300, num_splits=4)
    assert_close(got, dense_batch(dec), q_dtype)


# (group, dtype, head_dim, block_size, sliding_window): GQA 1/3/8, every dtype, head_dim 64/128/256
ATTN_CASES = [
    (1, torch.float32, 64, 16, None),
    (3, torch.bfloat16, 64, 16, None),
    (8, torch.float16, 128, 32, None),
    (3, torch.float16, 64, 16, 6),
    (2, torch.bfloat16, 256, 16, None),
]


@pytest.mark.parametrize("group,dtype,d,bs,window", ATTN_CASES)
def test_triton_paged_attention_mixed(tk, group, dtype, d, bs, window):
    ctx, ql = mixed_lens(bs)
    kvh = 2 if group < 8 else 1
    if d == 256:  # keep the interpreter fast: one decode row at a boundary, one short chunk
        ctx, ql = [bs + 1, 12], [1, 5]
    case = make_case(ctx, ql, kvh=kvh, group=group, d=d, bs=bs, dtype=dtype, seed=group + d)
    # the reference sees NaN-free caches; Triton sees NaN in every slot outside the contexts
    kc, vc = case.k_cache.nan_to_num(0.0), case.v_cache.nan_to_num(0.0)
    want = R.paged_attention(*case.args(kc, vc), sliding_window=window)
    got = tk.paged_attention(*case.args(), sliding_window=window)
    assert not got.isnan().any()
    assert_close(got, want, dtype)
    assert_close(got, dense_batch(case, window), dtype)


@pytest.mark.parametrize(
    "seed,group,dtype,bs",
    [(0, 1, torch.float16, 32), (1, 3, torch.float32, 16), (2, 8, torch.bfloat16, 16)],
)
def test_triton_random_ragged(tk, seed, group, dtype, bs):
    ctx, ql = random_lens(seed, bs)
    case = make_case(
        ctx, ql, kvh=8 // group if group < 8 else 1, group=group, d=64, bs=bs, dtype=dtype, seed=seed
    )
    kc, vc = case.k_cache.nan_to_num(0.0), case.v_cache.nan_to_num(0.0)
    assert_close(tk.paged_attention(*case.args()), R.paged_attention(*case.args(kc, vc)), dtype)


@pytest.mark.parametrize("splits", [1, 3])  # 3 is rounded up to 4
def test_triton_decode_split_k(tk, splits):
    # long-ish decode contexts split across programs (flash-decoding), some splits left empty
    # for the short sequence; head_dim 80 checks the non-power-of-two masking
    case = make_case([300, 1, 65], [1, 1, 1], kvh=1, group=8, d=80, bs=16, dtype=torch.bfloat16, seed=9)
    kc, vc = case.k_cache.nan_to_num(0.0), case.v_cache.nan_to_num(0.0)
    want = R.paged_attention(*case.args(kc, vc))
    out = torch.full_like(case.query, 5.0)
    got = tk.paged_attention(*case.args(), max_query_len=1, max_context_len=300, out=out, num_splits=splits)
    assert got is out
    assert_close(got, want, torch.bfloat16)


def test_triton_decode_window_split(tk):
    case = make_case([50, 17], [1, 1], kvh=2, group=1, d=64, bs=16, dtype=torch.float32, seed=4)
    kc, vc = case.k_cache.nan_to_num(0.0), case.v_cache.nan_to_num(0.0)
    want = R.paged_attention(*case.args(kc, vc), sliding_window=20)
    got = tk.paged_attention(*case.args(), sliding_window=20, num_splits=2)
    assert_close(got, want, torch.float32)


def test_triton_copy_blocks(tk):
    g = torch.Generator().manual_seed(2)
    ks = [torch.randn(5, 16, 2, 64, generator=g).half() for _ in range(3)]
    vs = [torch.randn(5, 16, 2, 64, generator=g).half() for _ in range(3)]
    ks2 = [k.clone() for k in ks]
    vs2 = [v.clone() for v in vs]
    pairs = torch.tensor([[0, 3], [2, 4]])
    tk.copy_blocks(ks, vs, pairs)
    R.copy_blocks(ks2, vs2, pairs)
    assert all(torch.equal(a, b) for a, b in zip(ks + vs, ks2 + vs2, strict=True))
    assert torch.equal(ks[1][3], ks[1][0]) and not torch.equal(ks[1][3], ks[1][1])


def test_triton_dispatch_forced(tk, kernel_settings):
    case = make_case([17, 5], [1, 5], kvh=1, group=3, d=64, bs=16, dtype=torch.float32, seed=6)
    if isinstance(tk, OnDevice) and tk.device.type == "cuda":
        # on a GPU no setting is needed: CUDA tensors go to Triton
        args = [a.to("cuda") if isinstance(a, torch.Tensor) else a for a in case.args()]
        assert K.attention_backend_for(args[0], args[1]) == "triton"
        got = K.paged_attention(*args).cpu()
    else:
        kernel_settings(attention_backend="triton")
        assert K.backend_for(torch.zeros(1)) == "triton"
        got = K.paged_attention(*case.args())  # NaN outside contexts: only Triton survives that
    assert not got.isnan().any()
    assert_close(got, dense_batch(case), torch.float32)


if not (INTERPRETED or TRITON_TEST_DEVICE):  # the child processes started above run these
    for _name in [n for n in globals() if n.startswith("test_triton_")]:
        del globals()[_name]


@needs_cc
def test_native_greedy_stats_match_torch():
    # the greedy sampler's fused pass: torch's argmax (first index of the max on ties), max and logsumexp
    from kvpilot.kernels import cpu_native

    g = torch.Generator().manual_seed(11)
    for rows, vocab in ((1, 1), (3, 7), (5, 8), (4, 49152), (2, 1000 + 5)):
        x = torch.randn(rows, vocab, generator=g) * 8
        if vocab > 20:
            x[0, 3] = x[0, vocab - 2] = x[0].max() + 1  # a tie: the first index wins
            x[1, ::3] = float("-inf")  # masked tokens (a grammar or logit_bias)
        view = torch.randn(rows, vocab + 9, generator=g)[:, 4 : 4 + vocab]  # rows apart by a stride
        view.copy_(x)
        got = cpu_native.greedy_stats(view)
        assert got is not None
        tokens, mx, lse = got
        assert torch.equal(tokens, x.argmax(-1))
        torch.testing.assert_close(mx, x.amax(-1))
        torch.testing.assert_close(lse, torch.logsumexp(x, -1), atol=2e-5, rtol=2e-6)
    assert cpu_native.greedy_stats(torch.zeros(2, 4, dtype=torch.float64)) is None
    assert cpu_native.greedy_stats(torch.zeros(4, 2).t()) is None  # columns not contiguous


@needs_cc
@pytest.mark.parametrize("rows,dim", [(0, 8), (1, 576), (5, 37), (40, 64), (3, 1536)])
def test_native_silu_mul_and_rms_norm_match_torch(rows, dim):
    # the model's float32 elementwise steps: odd sizes leave a scalar tail after the 8/16-wide loops,
    # 40 rows take the threaded path; inputs are views with a row stride, as the model passes them
    from kvpilot.kernels import cpu_native

    g = torch.Generator().manual_seed(rows * 1000 + dim)
    gu = (torch.randn(rows, 2 * dim + 3, generator=g) * 6)[:, : 2 * dim]
    got = cpu_native.silu_mul(gu)
    assert got is not None and got.is_contiguous() and got.shape == (rows, dim)
    gate, up = gu.split(dim, dim=-1)
    torch.testing.assert_close(got, torch.nn.functional.silu(gate) * up, atol=1e-5, rtol=1e-5)

    x = (torch.randn(rows, dim + 5, generator=g) * 3)[:, :dim]
    w = torch.randn(dim, generator=g)
    got = cpu_native.rms_norm(x, w, 1e-5)
    assert got is not None and got.shape == (rows, dim)
    torch.testing.assert_close(got, torch.nn.functional.rms_norm(x, (dim,), w, 1e-5), atol=1e-5, rtol=1e-5)

    # anything else is left to torch
    assert cpu_native.silu_mul(gu.double()) is None
    assert cpu_native.silu_mul(torch.zeros(2, 3)) is None  # no even split into gate and up
    assert cpu_native.rms_norm(x, w[:-1], 1e-5) is None
    assert cpu_native.rms_norm(x.t(), w, 1e-5) is None


@needs_cc
@pytest.mark.parametrize("rows,dim", [(0, 8), (1, 576), (5, 37), (40, 64), (3, 1536)])
def test_native_bfloat16_silu_mul_and_rms_norm_round_as_hf(rows, dim):
    # a bfloat16 model's elementwise steps as HF's modules compute them, op by op in bfloat16: SiLU(gate) is
    # rounded before the product with up; the normalized row (float32) is rounded before the weight scales it
    from kvpilot.kernels import cpu_native

    g = torch.Generator().manual_seed(rows * 1000 + dim + 1)
    gu = (torch.randn(rows, 2 * dim + 3, generator=g) * 6).bfloat16()[:, : 2 * dim]
    got = cpu_native.silu_mul(gu)
    assert got is not None and got.dtype == torch.bfloat16 and got.is_contiguous() and got.shape == (rows, dim)
    gate, up = gu.split(dim, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    # the same bits but where a float32 SiLU lands within an ulp of a rounding boundary (exp differs in its last bit)
    assert (got != want).float().mean().item() <= 0.01 if rows else True
    torch.testing.assert_close(got, want, atol=1e-2, rtol=8e-3)

    x = (torch.randn(rows, dim + 5, generator=g) * 3).bfloat16()[:, :dim]
    w = torch.randn(dim, generator=g).bfloat16()
    got = cpu_native.rms_norm(x, w, 1e-5)
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == (rows, dim)
    want = w * torch.nn.functional.rms_norm(x.float(), (dim,), None, 1e-5).bfloat16()
    assert (got != want).float().mean().item() <= 0.01 if rows else True
    torch.testing.assert_close(got, want, atol=1e-2, rtol=8e-3)
    # a weight of another dtype than the rows (other than float32 under bfloat16: Gemma's) is left to torch
    assert cpu_native.rms_norm(x, w.half(), 1e-5) is None


@needs_cc
@pytest.mark.parametrize("rows,heads,hd", [(0, 2, 8), (1, 12, 64), (7, 3, 10), (40, 12, 64), (2, 5, 128)])
def test_native_rope_rotates_interleaved_pairs_in_place(rows, heads, hd):
    # q/k rows of a projection (a view with the row stride of q|k|v), each head's dims as (x_2j, x_2j+1)
    # pairs times cis[row, j]: torch's complex product, in float32; a bfloat16 row rotated in float32 and
    # rounded once. hd 10 leaves a scalar tail after the 4-pair vectors; 40 rows take the threaded path.
    from kvpilot.kernels import cpu_native

    g = torch.Generator().manual_seed(rows * 100 + heads * 10 + hd)
    qkv = torch.randn(rows, heads * hd + 24, generator=g) * 4
    angles = torch.randn(rows, hd // 2, generator=g) * 30
    cis = torch.polar(torch.ones_like(angles) * 1.25, angles)
    for dtype in (torch.float32, torch.bfloat16):
        rows_in = qkv.to(dtype)
        x = rows_in[:, : heads * hd]
        wide = x.float().reshape(rows, heads, hd // 2, 2)
        want = torch.view_as_real(torch.view_as_complex(wide.contiguous()) * cis[:, None]).reshape(rows, heads * hd)
        tail = rows_in[:, heads * hd :].clone()
        assert cpu_native.rope_(x, cis, heads)
        torch.testing.assert_close(x.float(), want if dtype is torch.float32 else want.to(dtype).float(),
                                   atol=2e-5 if dtype is torch.float32 else 0.0,
                                   rtol=2e-6 if dtype is torch.float32 else 8e-3)
        if dtype is torch.bfloat16 and rows:  # rounded once: the same bits but at a rounding tie's edge
            assert (x != want.to(dtype)).float().mean().item() <= 0.01
        assert torch.equal(rows_in[:, heads * hd :], tail)  # the v columns stay as they were
    # anything else is left to torch, untouched
    x = qkv[:, : heads * hd].clone()
    assert not cpu_native.rope_(x.double(), cis, heads)
    assert not cpu_native.rope_(x, cis.to(torch.complex128), heads)
    assert not cpu_native.rope_(x, cis[:, : max(hd // 2 - 1, 0)], heads)  # one pair's rotation short
    assert not cpu_native.rope_(x.t(), cis, heads) if rows > 1 else True
    assert torch.equal(x, qkv[:, : heads * hd])


@needs_cc
@pytest.mark.parametrize("rows,n,k,bias", [(1, 49152, 576, False), (2, 960, 576, True), (5, 577, 1536, False),
                                           (12, 64, 64, True), (13, 100, 136, True), (3, 20, 37, True),
                                           (64, 33, 7, False), (0, 8, 8, False)])
def test_native_panel_gemm_matches_torch(rows, n, k, bias):
    # x @ w.T for a decode step's few rows, over the weight repacked in 32-column panels: N not a multiple
    # of 32 leaves a zero-padded last panel, rows beyond one register block (12 with AVX-512, 3 with AVX2)
    # go in groups with a partial last one, any K works; x is a strided view
    from kvpilot.kernels import cpu_native

    g = torch.Generator().manual_seed(rows * 7 + n + k)
    x = torch.randn(rows, k + 3, generator=g)[:, :k]
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g) if bias else None
    panels = cpu_native.pack_panels(w)
    assert panels is not None and panels.shape == (-(-n // 32), k, 32)
    # the layout: panel p, step k holds w[32p .. 32p + 31, k], zeros past the last row
    padded = torch.cat([w, w.new_zeros(panels.shape[0] * 32 - n, k)]).view(panels.shape[0], 32, k)
    assert torch.equal(panels, padded.transpose(1, 2))
    got = cpu_native.panel_gemm(x, panels, n, b)
    assert got is not None and got.shape == (rows, n) and got.is_contiguous()
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), atol=2e-5, rtol=2e-5)
    # anything else is left to torch
    assert cpu_native.pack_panels(w.double()) is None
    assert cpu_native.pack_panels(w.t().contiguous().t()) is None  # weight rows not contiguous
    assert cpu_native.panel_gemm(x.double(), panels, n) is None
    assert cpu_native.panel_gemm(x[:, :-1], panels, n) is None  # K differs
    assert cpu_native.panel_gemm(x, panels, n + 32) is None  # panels of another weight
    assert cpu_native.panel_gemm(x, panels, n, torch.zeros(n + 1)) is None  # bias of the wrong length
    # a residual (a strided view here) is added as the tiles are stored: exactly residual + the product
    r = torch.randn(rows, n + 5, generator=g)[:, :n]
    fused = cpu_native.panel_gemm(x, panels, n, b, residual=r)
    assert fused is not None and torch.equal(fused, r + got)
    assert cpu_native.panel_gemm(x, panels, n, b, residual=r[:, :-1]) is None  # residual of the wrong width
    assert cpu_native.panel_gemm(x, panels, n, b, residual=r.double()) is None


@pytest.mark.parametrize("prepacked", [True, False])
@pytest.mark.parametrize("rows", [2, 100, 700])
def test_linear_with_residual_matches_separate_add(prepacked, rows):
    # the layer's residual adds go into the GEMM (panels for small steps, oneDNN's binary post-op beyond,
    # torch where neither applies): the same values as adding after it
    from kvpilot.daemon.engine.models.linear import linear, prepack, prepack_supported
    from kvpilot.kernels import cpu_native

    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g) / 8
    b = torch.randn(96, generator=g)
    x, r = torch.randn(rows, 64, generator=g), torch.randn(rows, 96, generator=g)
    if prepacked and not prepack_supported(torch.device("cpu"), torch.float32):
        pytest.skip("no oneDNN in this torch build")
    weight = prepack(w) if prepacked else w
    panels = cpu_native.pack_panels(w) if prepacked else None
    expected = r + torch.nn.functional.linear(x, w, b)
    torch.testing.assert_close(linear(x, weight, b, panels, residual=r), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(linear(x, weight, b, panels), expected - r, atol=1e-5, rtol=1e-5)


@needs_cc
@pytest.mark.parametrize(("row_dtype", "kv_dtype"), [(torch.float32, torch.float32), (torch.float32, torch.float16),
                                                     (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)])
def test_native_store_kv_matches_reference(row_dtype, kv_dtype):
    # float32 rows into a float32 or float16 cache (converted), 16-bit rows into a cache of their own dtype
    # (a bfloat16 model's: copied as they are)
    from kvpilot.kernels import cpu_native

    cpu_native.available()  # builds and binds the library
    if (row_dtype, kv_dtype) not in cpu_native._store_fns:
        assert (row_dtype, kv_dtype) == (torch.float32, torch.float16) and not _compiler_has_float16()
        pytest.skip("the C compiler has no _Float16: float32 caches only")
    g = torch.Generator().manual_seed(3)
    fused = torch.randn(6, 9, 64, generator=g) * 3
    if row_dtype is torch.float32:
        fused[2, 5, 7] = 1e6  # saturates at 65504 in a float16 cache, never inf
    fused = fused.to(row_dtype)
    key, value = fused[:, 3:6], fused[:, 6:9]  # strided slices of a fused qkv, as the model passes them
    slots = torch.tensor([5, -1, 17, 0, 63, 31])  # -1: padding, skipped
    want_k = torch.full((4, 16, 3, 64), 7.0, dtype=kv_dtype)
    want_v = want_k.clone()
    R.store_kv(key, value, want_k, want_v, slots)
    got_k, got_v = torch.full_like(want_k, 7.0), torch.full_like(want_v, 7.0)
    assert cpu_native.store_kv(key, value, got_k, got_v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert bool(torch.isfinite(got_k).all())
    # through the dispatcher too, with int32 slots
    k2, v2 = torch.full_like(want_k, 7.0), torch.full_like(want_v, 7.0)
    K.store_kv(key, value, k2, v2, slots.to(torch.int32))
    assert torch.equal(k2, want_k) and torch.equal(v2, want_v)
    # a slot past the cache: nothing written, and the dispatcher reports it as the reference does
    bad = torch.tensor([1, 64])
    k3 = torch.full_like(want_k, 7.0)
    assert not cpu_native.store_kv(key[:2], value[:2], k3, torch.full_like(k3, 7.0), bad)
    assert bool((k3 == 7.0).all())
    with pytest.raises(IndexError):
        K.store_kv(key[:2], value[:2], k3, torch.full_like(k3, 7.0), bad)
    # 16-bit rows into a cache of another dtype (a conversion) are left to the reference
    if row_dtype is not torch.float32:
        other = torch.bfloat16 if row_dtype is torch.float16 else torch.float16
        assert not cpu_native.store_kv(key, value, got_k.to(other), got_v.to(other), slots)
        assert not cpu_native.store_kv(key, value, got_k.float(), got_v.float(), slots)
