"""A large LM head without panel copies (bfloat16, or float32 where panels are off): packed whole and
computed in slices of rows whose float32 logits stay within malloc's reach (each slice reading the whole
head), against packed in vocabulary chunks (each chunk read once for all the rows), as
``DecoderForCausalLM.prepack_weights`` now does. Gemma 3's head by default: 262,144 x 640, bfloat16.

Both run in one process, interleaved, best of ``--repeat`` each; the outputs are compared first.

Usage: python bench/lm_head.py [--vocab 262144] [--hidden 640] [--dtype bfloat16] [--repeat 5]
Writes bench/results/lm_head_chunks.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from host import cpu_name

from kvpilot.daemon.engine.host_malloc import row_slices
from kvpilot.daemon.engine.models.decoder import _HEAD_CHUNK_ROWS
from kvpilot.daemon.engine.models.linear import linear, prepack

ROWS = (1, 32, 96, 256)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument("--hidden", type=int, default=640)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    head = torch.randn(args.vocab, args.hidden).to(dtype)
    whole = prepack(head)
    chunks = [prepack(head[v:v + _HEAD_CHUNK_ROWS]) for v in range(0, args.vocab, _HEAD_CHUNK_ROWS)]
    out = torch.empty((max(ROWS), args.vocab), dtype=torch.float32)

    def sliced(x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        parts = row_slices(rows, 4 * args.vocab)
        if parts is None:
            return linear(x, whole).float()
        for part in parts:
            out[part].copy_(linear(x[part], whole))
        return out[:rows]

    def chunked(x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        for start, chunk in zip(range(0, args.vocab, _HEAD_CHUNK_ROWS), chunks, strict=True):
            for part in row_slices(rows, 4 * chunk.shape[0]) or [slice(0, rows)]:
                out[part, start:start + chunk.shape[0]].copy_(linear(x[part], chunk))
        return out[:rows]

    results = []
    with torch.inference_mode():
        for rows in ROWS:
            x = torch.randn(rows, args.hidden).to(dtype)
            diff = float((sliced(x).clone() - chunked(x)).abs().max())
            times: dict[str, list[float]] = {"sliced": [], "chunked": []}
            for _ in range(args.repeat):
                for name, fn in (("sliced", sliced), ("chunked", chunked)):
                    t = time.perf_counter()
                    fn(x)
                    times[name].append(time.perf_counter() - t)
            best = {k: min(v) * 1e3 for k, v in times.items()}
            results.append({"rows": rows, "sliced_ms": best["sliced"], "chunked_ms": best["chunked"],
                            "speedup": best["sliced"] / best["chunked"], "max_abs_diff": diff})
            print(results[-1], flush=True)
    Path(__file__).resolve().parent.joinpath("results", "lm_head_chunks.json").write_text(json.dumps({
        "head": [args.vocab, args.hidden], "dtype": args.dtype, "chunk_rows": _HEAD_CHUNK_ROWS,
        "threads": torch.get_num_threads(), "cpu": cpu_name(), "machine": platform.machine(),
        "torch": torch.__version__, "repeat": args.repeat, "rows": results,
        "command": "python bench/lm_head.py"}, indent=2) + "\n")


if __name__ == "__main__":
    main()
