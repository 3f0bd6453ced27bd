"""The panel kernel's software prefetch (csrc/panel_kernel.h, PANEL_PREFETCH) on and off, on the weight streams of
a decode step: the native MoE layer (csrc/moe_cpu.c) over a Qwen3-MoE-shaped model's 12 layers of experts
(8 experts, top-2, H=1024, I=768: 906 MB float32, beyond the caches) and dense ``panel_gemm`` products over
12 layers of a dense model's weights (the MoE bench's dense twin: q|k|v, o, gate|up, down; 340 MB).

Both builds are loaded in this one process (``cpu_kernel_cflags`` keys the build cache) and timed in interleaved
rounds, best of ``--rounds``; read the ratios. GB/s counts the weight bytes each call reads.

Usage: python bench/panel_prefetch.py [--rounds 5] [--threads 2]
Writes bench/results/moe_cpu_prefetch.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
from pathlib import Path

import torch

from kvpilot.kernels import cpu_native, moe, ops

E, K, H, INTER, LAYERS = 8, 2, 1024, 768, 12
DENSE = ((1024 + 2 * 256, 1024), (1024, 1024), (2 * 1536, 1024), (1024, 1536))  # [N, K] per layer
ROWS = (1, 4, 16, 64)
BUILDS = {"prefetch_off": ("-DPANEL_PREFETCH=0",), "prefetch_on": ()}
RESULTS = Path(__file__).resolve().parent / "results" / "moe_cpu_prefetch.json"


def use_build(flags: tuple[str, ...]) -> None:
    ops.configure(dataclasses.replace(ops.current(), cpu_kernel_cflags=flags))
    if cpu_native.panel_gemm_max_rows() == 0:
        raise SystemExit(f"no native panel kernel with {flags}: {cpu_native.build_error()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    use_build(())
    experts = [(moe.PackedExperts.pack(torch.randn(E, 2 * INTER, H), panels=True).panels,
                moe.PackedExperts.pack(torch.randn(E, H, INTER), panels=True).panels) for _ in range(LAYERS)]
    dense = [[(cpu_native.pack_panels(torch.randn(n, k)), n) for n, k in DENSE] for _ in range(LAYERS)]
    dense_bytes = LAYERS * sum(n * k * 4 for n, k in DENSE)
    cases = []
    for rows in ROWS:
        logits = torch.randn(rows, E)
        logits[:, 0] += 1.0  # uneven loads
        weights, ids = moe.moe_route(logits, K, renormalize=True)
        active = int(ids.unique().numel())
        cases.append(("moe", rows, torch.randn(rows, H), (weights, ids), LAYERS * active * 3 * H * INTER * 4))
        cases.append(("dense", rows, torch.randn(rows, 1536), None, dense_bytes))

    def run(kind: str, x: torch.Tensor, route: tuple | None) -> None:
        if kind == "moe":
            for w13, w2 in experts:
                assert cpu_native.moe_panels(x, w13, w2, INTER, route[1], route[0]) is not None
        else:
            for layer in dense:
                for panels, n in layer:
                    assert cpu_native.panel_gemm(x[:, :panels.shape[1]], panels, n) is not None

    best: dict[tuple[str, str, int], float] = {}
    for _ in range(args.rounds):
        for build, flags in BUILDS.items():
            use_build(flags)
            for kind, rows, x, route, _nbytes in cases:
                run(kind, x, route)  # warm: the first call after a switch binds the library
                t0 = time.perf_counter()
                for _ in range(3):
                    run(kind, x, route)
                sec = (time.perf_counter() - t0) / 3
                key = (build, kind, rows)
                best[key] = min(best.get(key, sec), sec)
    use_build(())
    out = {"command": f"python bench/panel_prefetch.py --rounds {args.rounds} --threads {args.threads}",
           "run": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), "threads": args.threads,
           "machine": platform.processor() or platform.machine(), "rows": []}
    for kind, rows, _x, _route, nbytes in cases:
        off, on = best[("prefetch_off", kind, rows)], best[("prefetch_on", kind, rows)]
        out["rows"].append({"kind": kind, "rows": rows, "weight_mb": round(nbytes / 1e6, 1),
                            "off_ms": off * 1e3, "on_ms": on * 1e3, "off_gb_s": nbytes / off / 1e9,
                            "on_gb_s": nbytes / on / 1e9, "speedup": off / on})
        print(json.dumps(out["rows"][-1]))
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
