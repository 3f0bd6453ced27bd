"""The CPU MoE path (``moe.fused_moe_cpu``) against the torch reference (``moe_reference.fused_moe``).

A Qwen3-MoE-like small layer: E=8 experts, top-2, H=1024, I=768, routed from random logits (uneven loads), at
T=1 (decode), 16 and 256 tokens, float32 and bfloat16. Both are timed in the same process one after another,
interleaved, median of ``--repeat`` runs each; read the ratios (reference time / CPU-path time), not the
absolute figures (the host is shared). The CPU path's outputs are checked against the reference's first.

Usage: python bench/moe_cpu.py [--repeat 20] [--threads N]
Writes bench/results/moe_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from kvpilot.kernels import cpu_native, moe, moe_reference

E, K, H, INTER = 8, 2, 1024, 768
TOKENS = (1, 16, 256)


def _time(fn, repeat: int) -> float:
    fn()  # warm: first-call allocations and oneDNN's kernel choice
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        w13 = (torch.randn(E, 2 * INTER, H, generator=g) / H**0.5).to(dtype)
        w2 = (torch.randn(E, H, INTER, generator=g) / INTER**0.5).to(dtype)
        for t in TOKENS:
            x = torch.randn(t, H, generator=g).to(dtype)
            weights, ids = moe.moe_route(torch.randn(t, E, generator=g) * 2, K, renormalize=True)
            ref_out = moe_reference.fused_moe(x, w13, w2, weights, ids)
            cpu_out = moe.fused_moe_cpu(x, w13, w2, weights, ids)
            err = float((ref_out.float() - cpu_out.float()).abs().max())
            ref_s, cpu_s = [], []
            for _ in range(3):  # interleaved rounds: drift on a shared host hits both alike
                ref_s.append(_time(lambda x=x, a=w13, b=w2, w=weights, i=ids: moe_reference.fused_moe(x, a, b, w, i),
                                   args.repeat))
                cpu_s.append(_time(lambda x=x, a=w13, b=w2, w=weights, i=ids: moe.fused_moe_cpu(x, a, b, w, i),
                                   args.repeat))
            ref_t, cpu_t = min(ref_s), min(cpu_s)
            row = {"dtype": str(dtype).removeprefix("torch."), "tokens": t,
                   "active_experts": int(ids.unique().numel()), "reference_ms": ref_t * 1e3,
                   "cpu_path_ms": cpu_t * 1e3, "speedup": ref_t / cpu_t, "max_abs_diff": err}
            rows.append(row)
            print(f"{row['dtype']:>8} T={t:<4} experts={row['active_experts']} reference {ref_t * 1e3:8.3f} ms  "
                  f"cpu path {cpu_t * 1e3:8.3f} ms  ratio {ref_t / cpu_t:5.2f}x  max|diff| {err:.2e}")
    out = {
        "shape": {"experts": E, "top_k": K, "hidden": H, "intermediate": INTER},
        "threads": torch.get_num_threads(),
        "native_kernels": cpu_native.available(),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "repeat": args.repeat,
        "rows": rows,
    }
    path = Path(__file__).resolve().parent / "results" / "moe_cpu.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
