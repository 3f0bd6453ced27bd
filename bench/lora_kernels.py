"""The batched LoRA's per-call time on the CPU: the native kernel (``csrc/lora_cpu.c``, one call for every
segment of a layer) against the torch reference (two GEMMs per segment), float32 and bfloat16, and where the
two cross over for one long segment (a prefill's rows), which sets ``kvpilot.kernels.lora.NATIVE_MAX_ROWS``.

Decode-shaped calls use SmolLM2-135M's projections (hidden 576: q|k|v 576 -> 960, o 576 -> 576, gate or up
576 -> 1536, down 1536 -> 576) at R = 16 with 4 slots, T = 1, 8, 32, 96, 256 rows spread over 1 or 4 adapters
(contiguous runs, as the engine groups them). Each timed call goes through ``lora_shrink_expand`` itself (its
checks and dispatch included): "native" with every segment forced to the kernel, "reference" with the backend
forced to torch, and "dispatch" as the defaults pick. Every call reads another of ``--copies`` copies of the
adapter weights (a step's layers each have their own). Times: the median of ``--repeat`` calls, best of five
rounds, each round a pass over every case (the host is shared: read the ratios more than the absolute figures).
Each case's native result is checked against the reference first.

Usage: python bench/lora_kernels.py [--repeat 40] [--copies 8] [--threads N]
Writes bench/results/lora_kernels.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from host import cpu_name
from timing import call_times

from kvpilot.kernels import cpu_native, lora
from kvpilot.kernels import ops as K

PROJECTIONS = [("qkv", 576, 960), ("o", 576, 576), ("gate/up", 576, 1536), ("down", 1536, 576)]
RANK, SLOTS = 16, 4
DECODE_ROWS = (1, 8, 32, 96, 256)
CROSSOVER_ROWS = (32, 64, 96, 128, 160, 192, 256, 384, 512, 1024)
ROUNDS = 5
DTYPES = (torch.float32, torch.bfloat16)


def _median_call(fn: Callable[[int], None], calls: int) -> float:
    return statistics.median(call_times(fn, calls))


def _weights(k: int, n: int, dtype: torch.dtype, copies: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(k * n)
    return [((torch.randn(SLOTS, RANK, k, generator=g) / k**0.5).to(dtype),
             (torch.randn(SLOTS, n, RANK, generator=g) / RANK**0.5).to(dtype)) for _ in range(copies)]


def _segments(rows: int, adapters: int) -> lora.LoRASegments:
    per = -(-rows // adapters)
    return lora.LoRASegments.from_row_slots(np.repeat(np.arange(adapters), per)[:rows])


class _Backends:
    """Calls of lora_shrink_expand under each policy, restoring the settings afterwards."""

    def __init__(self) -> None:
        self.settings = K.current()
        self.max_rows = dict(lora.NATIVE_MAX_ROWS)

    def call(self, policy: str, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             seg: lora.LoRASegments) -> None:
        self.set(policy)
        lora.lora_shrink_expand(y, x, a, b, seg)

    def set(self, policy: str) -> None:
        """native: every segment to the kernel; reference: the torch backend; dispatch: the defaults."""
        K.configure(replace(self.settings, attention_backend="torch" if policy == "reference" else "auto"))
        big = 1 << 30
        lora.NATIVE_MAX_ROWS.update({d: big if policy == "native" else self.max_rows[d] for d in DTYPES})

    def restore(self) -> None:
        K.configure(self.settings)
        lora.NATIVE_MAX_ROWS.update(self.max_rows)


class _Case:
    """One timed configuration: its inputs, its check against the reference, and its best times so far."""

    def __init__(self, backends: _Backends, kind: str, projection: str, k: int, n: int, rows: int, adapters: int,
                 dtype: torch.dtype, weights: list[tuple[torch.Tensor, torch.Tensor]], repeat: int,
                 policies: tuple[str, ...]) -> None:
        self.kind, self.projection, self.k, self.n, self.rows, self.adapters = kind, projection, k, n, rows, adapters
        self.dtype, self.weights, self.repeat, self.policies = dtype, weights, repeat, policies
        g = torch.Generator().manual_seed(rows)
        self.x = torch.randn(rows, k, generator=g).to(dtype)
        self.y = torch.randn(rows, n, generator=g).to(dtype)
        self.seg = _segments(rows, adapters)
        want, got = self.y.clone(), self.y.clone()
        backends.call("reference", want, self.x, *weights[0], self.seg)
        backends.call("native", got, self.x, *weights[0], self.seg)
        self.err = float((got.double() - want.double()).abs().max() / want.double().abs().max())
        self.best = dict.fromkeys(policies, float("inf"))

    def time_round(self, backends: _Backends) -> None:
        def fn(i: int) -> None:
            lora.lora_shrink_expand(self.y, self.x, *self.weights[i % len(self.weights)], self.seg)

        for policy in self.policies:
            backends.set(policy)  # outside the timed calls
            self.best[policy] = min(self.best[policy], _median_call(fn, self.repeat))

    def row(self) -> dict:
        t = {p: round(self.best[p] * 1e6, 2) for p in self.policies}
        return {"projection": self.projection, "rows": self.rows, "adapters": self.adapters,
                "dtype": str(self.dtype).removeprefix("torch."), "K": self.k, "N": self.n,
                **{f"{p}_us": v for p, v in t.items()},
                "native_speedup": round(t["reference"] / t["native"], 2), "max_rel_err_vs_reference": self.err}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=40, help="calls per case and round")
    ap.add_argument("--copies", type=int, default=8, help="copies of each projection's adapter weights rotated through")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "lora_kernels.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    assert lora.backend_for(torch.empty(1)) == "cpu", f"no native kernel: {cpu_native.build_error()}"
    backends = _Backends()
    cases: list[_Case] = []
    try:
        for dtype in DTYPES:
            for name, k, n in PROJECTIONS:
                weights = _weights(k, n, dtype, args.copies)
                cases += [_Case(backends, "decode", name, k, n, rows, adapters, dtype, weights, args.repeat,
                                ("native", "reference", "dispatch"))
                          for rows in DECODE_ROWS for adapters in (1, 4) if adapters <= rows]
                if name == "qkv":
                    cases += [_Case(backends, "crossover", name, k, n, rows, 1, dtype, weights,
                                    max(10, args.repeat // 2), ("native", "reference")) for rows in CROSSOVER_ROWS]
        # each round passes over every case, so a case's rounds are spread over the whole run: a burst of load on
        # the shared host spoils some of them, not all
        for _ in range(ROUNDS):
            for case in cases:
                case.time_round(backends)
    finally:
        backends.restore()
    decode = [c.row() for c in cases if c.kind == "decode"]
    crossover = [c.row() for c in cases if c.kind == "crossover"]
    for r in decode:
        print(f"{r['dtype']:8s} {r['projection']:8s} {r['K']:4d}->{r['N']:<4d} T={r['rows']:<4d} "
              f"adapters={r['adapters']} native {r['native_us']:8.1f} us  reference {r['reference_us']:8.1f} us  "
              f"dispatch {r['dispatch_us']:8.1f} us  x{r['native_speedup']:.2f}")
    for r in crossover:
        print(f"{r['dtype']:8s} one segment of {r['rows']:5d} rows ({r['projection']}): native {r['native_us']:8.1f} us"
              f"  reference {r['reference_us']:8.1f} us  x{r['native_speedup']:.2f}")
    faster = {}  # the rows up to which the kernel is at least as fast at every size measured
    for dtype in DTYPES:
        d = str(dtype).removeprefix("torch.")
        faster[d] = 0
        for r in (r for r in crossover if r["dtype"] == d):
            if r["native_us"] > r["reference_us"]:
                break
            faster[d] = r["rows"]
    result = {
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "cpu": cpu_name(),
        "torch": torch.__version__,
        "rank": RANK,
        "slots": SLOTS,
        "weight_copies": args.copies,
        "repeat": args.repeat,
        "rounds": ROUNDS,
        "native_max_rows": {str(d).removeprefix("torch."): v for d, v in lora.NATIVE_MAX_ROWS.items()},
        "native_faster_up_to_rows": faster,
        "decode": decode,
        "crossover": crossover,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"native faster for one segment up to (rows): {faster}")
    print(f"wrote {args.out}")



if __name__ == "__main__":
    main()
