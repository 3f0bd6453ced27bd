"""The CPU MoE path (``moe.fused_moe_cpu``) against the torch reference (``moe_reference.fused_moe``), over
dense expert stacks and over stacks packed for the CPU GEMMs (``moe.PackedExperts``: panels, float32 only, which
``fused_moe_cpu`` hands to the native MoE kernel, csrc/moe_cpu.c; and oneDNN-packed weights: what
``MoEBlock.prepack_experts`` makes).

A Qwen3-MoE-like small layer: E=8 experts, top-2, H=1024, I=768, routed from random logits (uneven loads), at
T=1 (decode), 16 and 256 tokens, float32 and bfloat16. All are timed in the same process one after another,
interleaved, median of ``--repeat`` runs each, best of 3 rounds; read the ratios (reference time / variant
time), not the absolute figures (the host is shared). Every variant's outputs are checked against the
reference's first. The layer's 75 MB (float32) may sit in a large last-level cache here: a model's many
layers do not (bench/moe_model.py measures those).

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
        variants = {"cpu_path": (w13, w2)}
        if dtype == torch.float32 and cpu_native.panel_gemm_max_rows():
            variants["packed_panels"] = (moe.PackedExperts.pack(w13.clone(), panels=True),
                                         moe.PackedExperts.pack(w2.clone(), panels=True))
        if moe.onednn_pack_supported(dtype):
            variants["packed_onednn"] = (moe.PackedExperts.pack(w13, panels=False),
                                         moe.PackedExperts.pack(w2, panels=False))
        for t in TOKENS:
            x = torch.randn(t, H, generator=g).to(dtype)
            weights, ids = moe.moe_route(torch.randn(t, E, generator=g) * 2, K, renormalize=True)
            ref_out = moe_reference.fused_moe(x, w13, w2, weights, ids)
            errs = {name: float((ref_out.float() - moe.fused_moe_cpu(x, a, b, weights, ids).float()).abs().max())
                    for name, (a, b) in variants.items()}
            times: dict[str, list[float]] = {"reference": [], **{name: [] for name in variants}}
            for _ in range(3):  # interleaved rounds: drift on a shared host hits all alike
                times["reference"].append(_time(lambda x=x, w=weights, i=ids, a=w13, b=w2: moe_reference.fused_moe(x, a, b, w, i),
                                                args.repeat))
                for name, (a, b) in variants.items():
                    times[name].append(_time(lambda x=x, a=a, b=b, w=weights, i=ids: moe.fused_moe_cpu(x, a, b, w, i),
                                             args.repeat))
            ref_t = min(times["reference"])
            row = {"dtype": str(dtype).removeprefix("torch."), "tokens": t,
                   "active_experts": int(ids.unique().numel()), "reference_ms": ref_t * 1e3}
            for name in variants:
                best = min(times[name])
                row[f"{name}_ms"] = best * 1e3
                row[f"{name}_speedup"] = ref_t / best
                row[f"{name}_max_abs_diff"] = errs[name]
            rows.append(row)
            print(f"{row['dtype']:>8} T={t:<4} experts={row['active_experts']} reference {ref_t * 1e3:8.3f} ms  "
                  + "  ".join(f"{name} {row[name + '_ms']:8.3f} ms ({row[name + '_speedup']:5.2f}x, "
                              f"max|diff| {errs[name]:.1e})" for name in variants))
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
