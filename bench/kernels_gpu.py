"""GPU check of the Triton paged-attention kernels (needs CUDA and triton).

1. correctness of every Triton kernel against the torch reference at realistic sizes;
2. decode ``paged_attention`` time and achieved bandwidth (Llama-8B layout: 32 query heads, 8 kv
   heads, head_dim 128, bf16, block size 16) for batch 64-256 and context 512-8k, against the
   peak (H200: 4.8 TB/s), next to un-paged ``scaled_dot_product_attention`` on the same data;
3. ``store_kv`` and ``copy_blocks`` bandwidth.

Writes JSON to bench/results/kernels_gpu-<time>.json. Usage:
    .venv/bin/python bench/kernels_gpu.py [--quick] [--peak-tbps 4.8]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

H, KVH, D, BS = 32, 8, 128, 16  # Llama-3-8B attention layout, 16-token blocks
RESULTS = Path(__file__).resolve().parent / "results"


def need_gpu():
    if not torch.cuda.is_available():
        sys.exit(
            "bench/kernels_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing to measure here"
        )
    try:
        import triton  # noqa: F401
    except ImportError as e:
        sys.exit(f"bench/kernels_gpu.py needs triton: {e}")
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: this script times compiled kernels")


def bench_ms(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100))


def make_batch(ctx_lens, q_lens, pool_blocks, dtype, gen, dev, h=H, d=D, bs=BS):
    """Random paged batch over a shuffled block pool (the pool is allocated by the caller)."""
    nbl = [math.ceil(c / bs) for c in ctx_lens]
    perm = torch.randperm(pool_blocks, generator=gen, device="cpu")[: sum(nbl)]
    bt = torch.zeros(len(ctx_lens), max(nbl), dtype=torch.int32)
    used = 0
    for i, nb in enumerate(nbl):
        bt[i, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn(int(qsl[-1]), h, d, dtype=dtype, device=dev)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=dev)
    return q, bt.to(dev), ctx, qsl.to(dev)


def check_correctness(tk, ref, dev) -> dict:
    gen = torch.Generator().manual_seed(0)
    res = {}
    tol = {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 1e-4}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        pool = 40_000
        kc = torch.randn(pool, BS, KVH, D, dtype=dtype, device=dev)
        vc = torch.randn_like(kc)
        ctx = [int(x) for x in torch.randint(1, 8192, (48,), generator=gen)] + [16, 17, 1, 4096, 1536]
        ql = [1] * 51 + [512, 300]  # decode rows plus two prefill chunks over cached prefixes
        q, bt, cl, qsl = make_batch(ctx, ql, pool, dtype, gen, dev)
        want = ref.paged_attention(q, kc, vc, bt, cl, qsl, D**-0.5)
        got = tk.paged_attention(q, kc, vc, bt, cl, qsl, D**-0.5)
        err_mixed = (got.float() - want.float()).abs().max().item()
        # decode only: exercises the split-K path at long context
        dq, dbt, dcl, dqsl = make_batch([8192, 6000, 33, 7777], [1] * 4, pool, dtype, gen, dev)
        want = ref.paged_attention(dq, kc, vc, dbt, dcl, dqsl, D**-0.5)
        errs = {}
        for s in (1, 4, 16):
            got = tk.paged_attention(dq, kc, vc, dbt, dcl, dqsl, D**-0.5, max_query_len=1, num_splits=s)
            errs[s] = (got.float() - want.float()).abs().max().item()
        got = tk.paged_attention(q, kc, vc, bt, cl, qsl, D**-0.5, sliding_window=1000)
        want = ref.paged_attention(q, kc, vc, bt, cl, qsl, D**-0.5, sliding_window=1000)
        err_win = (got.float() - want.float()).abs().max().item()
        worst = max(err_mixed, err_win, *errs.values())
        res[str(dtype)] = {
            "mixed_max_abs_err": err_mixed,
            "decode_split_max_abs_err": errs,
            "window_max_abs_err": err_win,
            "ok": worst <= tol[dtype],
        }
        del kc, vc
    # store_kv with padding, copy_blocks across layers
    kc = torch.zeros(512, BS, KVH, D, dtype=torch.bfloat16, device=dev)
    vc = torch.zeros_like(kc)
    key = torch.randn(3000, KVH, D, dtype=torch.bfloat16, device=dev)
    val = torch.randn_like(key)
    slots = torch.randperm(512 * BS, device=dev)[:3000]
    slots[::7] = -1
    kc2, vc2 = kc.clone(), vc.clone()
    tk.store_kv(key, val, kc, vc, slots)
    ref.store_kv(key, val, kc2, vc2, slots)
    res["store_kv_exact"] = bool(torch.equal(kc, kc2) and torch.equal(vc, vc2))
    ks = [torch.randn(256, BS, KVH, D, dtype=torch.bfloat16, device=dev) for _ in range(4)]
    vs = [torch.randn_like(k) for k in ks]
    ks2, vs2 = [k.clone() for k in ks], [v.clone() for v in vs]
    pairs = torch.tensor([[1, 200], [5, 201], [9, 202]], device=dev)
    tk.copy_blocks(ks, vs, pairs)
    ref.copy_blocks(ks2, vs2, pairs)
    res["copy_blocks_exact"] = all(torch.equal(a, b) for a, b in zip(ks + vs, ks2 + vs2, strict=True))
    return res


def decode_sweep(tk, dev, batches, contexts, peak_gbps) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    dtype = torch.bfloat16
    pool = max(batches) * max(contexts) // BS + 64
    kc = torch.randn(pool, BS, KVH, D, dtype=dtype, device=dev)
    vc = torch.randn_like(kc)
    rows = []
    for b in batches:
        for c in contexts:
            q, bt, cl, qsl = make_batch([c] * b, [1] * b, pool, dtype, gen, dev)
            out = torch.empty_like(q)
            kv_bytes = 2 * b * c * KVH * D * kc.element_size()
            io_bytes = kv_bytes + 2 * q.numel() * q.element_size() + bt.numel() * 4

            def run(splits=None, q=q, bt=bt, cl=cl, qsl=qsl, out=out, c=c):
                tk.paged_attention(
                    q,
                    kc,
                    vc,
                    bt,
                    cl,
                    qsl,
                    D**-0.5,
                    max_query_len=1,
                    max_context_len=c,
                    out=out,
                    num_splits=splits,
                )

            ms = bench_ms(run)
            best_split, best_ms = None, ms
            for s in (1, 2, 4, 8, 16):
                t = bench_ms(lambda s=s, run=run: run(s))
                if t < best_ms:
                    best_split, best_ms = s, t
            # un-paged SDPA on the same amount of data, contiguous [B, kvh, C, d]
            kd = torch.randn(b, KVH, c, D, dtype=dtype, device=dev)
            vd = torch.randn_like(kd)
            qd = q.view(b, H, 1, D)
            sdpa_ms = bench_ms(
                lambda qd=qd, kd=kd, vd=vd: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True)
            )
            del kd, vd
            row = {
                "batch": b,
                "context": c,
                "ms": ms,
                "GBps": io_bytes / ms / 1e6,
                "peak_frac": io_bytes / ms / 1e6 / peak_gbps,
                "best_num_splits": best_split or "heuristic",
                "best_ms": best_ms,
                "best_peak_frac": io_bytes / best_ms / 1e6 / peak_gbps,
                "sdpa_unpaged_ms": sdpa_ms,
                "sdpa_unpaged_peak_frac": io_bytes / sdpa_ms / 1e6 / peak_gbps,
            }
            rows.append(row)
            print(
                f"decode B={b:4d} ctx={c:5d}: {ms * 1e3:8.1f} us {row['GBps']:7.0f} GB/s "
                f"({row['peak_frac']:.0%} of peak; best splits={row['best_num_splits']} {row['best_peak_frac']:.0%}) "
                f"| sdpa un-paged {sdpa_ms * 1e3:8.1f} us ({row['sdpa_unpaged_peak_frac']:.0%})",
                flush=True,
            )
    return rows


def fp32_prefill_variants(tk, ref, dev) -> list[dict]:
    """float32 mixed steps (decode rows beside prefill chunks, as the engine batches them): time and error
    of each tl.dot precision and prefill block size, for SmolLM2's and Llama-8B's attention shapes."""
    from dataclasses import replace

    from kvpilot.kernels import ops

    gen = torch.Generator().manual_seed(5)
    rows = []
    for h, kvh, d in ((9, 3, 64), (32, 8, 128)):
        pool = 20_000
        kc = torch.randn(pool, BS, kvh, d, device=dev)
        vc = torch.randn_like(kc)
        ctx = [int(x) for x in torch.randint(50, 500, (240,), generator=gen)] + [400] * 16
        ql = [1] * 240 + [400] * 16
        q, bt, cl, qsl = make_batch(ctx, ql, pool, torch.float32, gen, dev, h=h, d=d)
        want = ref.paged_attention(q, kc, vc, bt, cl, qsl, d**-0.5)
        saved = ops.current()
        for precision in ("ieee", "tf32x3"):
            for block_m in (64, 32, 16):
                ops.configure(replace(saved, triton_fp32_precision=precision, triton_fp32_prefill_block_m=block_m))
                row = {"heads": h, "kv_heads": kvh, "head_dim": d, "precision": precision, "block_m": block_m}
                try:
                    run = functools.partial(tk.paged_attention, q, kc, vc, bt, cl, qsl, d**-0.5,
                                            max_query_len=400, max_context_len=500)
                    row["max_abs_err"] = (run() - want).abs().max().item()
                    row["us"] = 1e3 * bench_ms(run)
                except Exception as e:  # a variant that does not compile is a result too
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(row)
                print("fp32 mixed step:", row, flush=True)
        ops.configure(saved)
        del kc, vc
    return rows


def store_copy_bench(tk, dev, peak_gbps) -> dict:
    dtype = torch.bfloat16
    res = {}
    for tokens in (256, 8192, 65536):
        pool = tokens // BS + 16
        kc = torch.zeros(pool, BS, KVH, D, dtype=dtype, device=dev)
        vc = torch.zeros_like(kc)
        key = torch.randn(tokens, KVH, D, dtype=dtype, device=dev)
        val = torch.randn_like(key)
        slots = torch.randperm(pool * BS, device=dev)[:tokens]
        ms = bench_ms(
            lambda kc=kc, vc=vc, key=key, val=val, slots=slots: tk.store_kv(key, val, kc, vc, slots)
        )
        nbytes = 2 * 2 * key.numel() * key.element_size()  # read + write, K and V
        res[f"store_kv_{tokens}"] = {
            "ms": ms,
            "GBps": nbytes / ms / 1e6,
            "peak_frac": nbytes / ms / 1e6 / peak_gbps,
        }
        print(f"store_kv {tokens:6d} tokens: {ms * 1e3:8.1f} us {nbytes / ms / 1e6:7.0f} GB/s", flush=True)
    layers = 32
    ks = [torch.zeros(1024, BS, KVH, D, dtype=dtype, device=dev) for _ in range(layers)]
    vs = [torch.zeros_like(k) for k in ks]
    pairs = torch.stack([torch.arange(0, 64), torch.arange(512, 576)], 1).to(dev)
    ms = bench_ms(lambda: tk.copy_blocks(ks, vs, pairs))
    nbytes = 2 * 2 * layers * 64 * ks[0][0].numel() * 2
    res["copy_blocks_32layers_64blocks"] = {"ms": ms, "GBps": nbytes / ms / 1e6}
    print(f"copy_blocks 32 layers x 64 blocks: {ms * 1e3:8.1f} us {nbytes / ms / 1e6:7.0f} GB/s", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="batch 128 only, contexts 512/4096")
    ap.add_argument("--peak-tbps", type=float, default=4.8, help="peak HBM bandwidth (H200: 4.8)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--fp32-variants", action="store_true", help="only the float32 mixed-step variants")
    args = ap.parse_args()
    need_gpu()
    from kvpilot.kernels import reference as ref
    from kvpilot.kernels import triton_kernels as tk

    dev = torch.device("cuda")
    peak = args.peak_tbps * 1e3
    t0 = time.time()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "peak_GBps": peak}
    import triton

    report["triton"] = triton.__version__
    if args.fp32_variants:
        report["fp32_mixed_step_variants"] = fp32_prefill_variants(tk, ref, dev)
        out = args.out or RESULTS / f"kernels_gpu_fp32-{time.strftime('%Y%m%d-%H%M%S')}.json"
        out.write_text(json.dumps(report, indent=1))
        return
    report["correctness"] = check_correctness(tk, ref, dev)
    print(json.dumps(report["correctness"], indent=1), flush=True)
    batches = [128] if args.quick else [64, 128, 256]
    contexts = [512, 4096] if args.quick else [512, 1024, 2048, 4096, 8192]
    report["decode"] = decode_sweep(tk, dev, batches, contexts, peak)
    report["store_copy"] = store_copy_bench(tk, dev, peak)
    target = [r for r in report["decode"] if r["batch"] == 128 and r["context"] == 4096]
    if target:
        report["target_b128_ctx4k_peak_frac"] = target[0]["peak_frac"]
        print(f"target (B=128, ctx=4k, >= 60% of peak): {target[0]['peak_frac']:.0%}")
    report["wall_s"] = time.time() - t0
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = args.out or RESULTS / f"kernels_gpu-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    if not all(v["ok"] if isinstance(v, dict) else v for v in report["correctness"].values()):
        sys.exit("correctness check FAILED")


if __name__ == "__main__":
    main()
