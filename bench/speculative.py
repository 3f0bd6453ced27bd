"""Speculative decoding on SmolLM2-135M (float32, float weights): where it pays and where it must not cost.

Two parts, each alternating runs with speculation off and on in one engine (the speculator is swapped in
and out, so both see the same weights, cache and warm kernels):

* batch 1 on copy-heavy prompts (continue a passage seen in the prompt, rewrite a code file with one edit,
  answer by quoting), greedy: output tok/s off and on, the tokens checked identical, the acceptance per
  draft position;
* the 96-request workload of bench/peers.py (make_workload("w96"), greedy, EOS ignored) with speculation
  configured and not: the batch-size switch (disable_by_batch_size) must keep it from costing throughput.

Usage: python bench/speculative.py [--k 6] [--lookup-min N] [--lookup-max N] [--reps 3] [--max-tokens 160]
       [--w96-reps 2] [--threads 1] [--parts copy,w96] [--out bench/results/speculative.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from peers import make_workload, warm_up_kvpilot  # noqa: E402

MODEL = "builtin://smollm2-135m"
SETTINGS: dict[str, Any] = {"dtype": "float32", "quantization": "none", "max_num_seqs": 256,
                            "max_num_batched_tokens": 2048}

PASSAGE = (
    "The lighthouse stood at the end of a narrow spit of rock, and for forty years the same keeper had "
    "climbed its iron stairs every evening at dusk. He carried a brass lantern, a tin of oil and a small "
    "notebook in which he wrote down the weather, the ships that passed and the strange green lights he "
    "sometimes saw far out on the water. The villagers thought him odd, but the fishermen trusted him, "
    "because on the stormiest nights his light had never once gone out."
)
CODE = '''import math


def area(radius: float) -> float:
    """The area of a circle of the given radius."""
    if radius < 0:
        raise ValueError("radius must be >= 0")
    return math.pi * radius * radius


def circumference(radius: float) -> float:
    """The length of a circle of the given radius."""
    if radius < 0:
        raise ValueError("radius must be >= 0")
    return 2 * math.pi * radius


def describe(radius: float) -> str:
    return f"radius {radius}: area {area(radius):.2f}, circumference {circumference(radius):.2f}"


if __name__ == "__main__":
    for r in (1.0, 2.5, 10.0):
        print(describe(r))
'''
ARTICLE = (
    "At Tuesday's council meeting the mayor, Ellen Park, said that \"the new bridge will open in the spring, "
    "on time and within its budget\". She added that \"the old ferry will keep running until the last car "
    "has crossed the new deck\" and that \"no one in this town will pay a toll to cross their own river\". "
    "The treasurer, Omar Diaz, said that \"the bonds we sold last year cover every cost we can foresee\"."
)


def copy_heavy_prompts() -> dict[str, str]:
    """Prompts whose answers repeat text the prompt holds: where n-gram drafts find their tokens."""
    return {
        "passage": f"Copy the passage below exactly.\n\nPassage:\n{PASSAGE}\n\nCopy:\n{PASSAGE[:80]}",
        "code_edit": (f"Here is a Python file:\n\n{CODE}\nThe same file with `area` renamed to `disk_area`:\n\n"
                      f"{CODE[:60]}"),
        "quotes": (f"{ARTICLE}\n\nQuote the mayor's three statements and the treasurer's statement, one per "
                   "line.\n1. \"the new bridge will open"),
    }


def _speculator(llm: Any, raw: dict[str, Any] | None) -> Any:
    from dataclasses import replace

    from kvpilot.daemon.engine.spec_decode.speculator import make_speculator

    engine = llm.engine
    if raw is None:
        return None
    return make_speculator(replace(engine.config, speculative_config=raw), engine.loaded, engine.runner,
                           engine.max_model_len)


def timed(llm: Any, speculator: Any, prompts: list[Any], params: Any) -> tuple[float, list[list[int]], Any]:
    llm.engine.speculator = speculator
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sec = time.perf_counter() - t0
    return sec, [list(o.outputs[0].token_ids) for o in outs], speculator


def _stats_delta(speculator: Any, before: dict[str, Any]) -> dict[str, Any]:
    st = speculator.stats
    return {"drafts": st.num_drafts - before["drafts"], "draft_tokens": st.num_draft_tokens - before["draft_tokens"],
            "accepted": st.num_accepted_tokens - before["accepted"],
            "per_pos": [a - b for a, b in zip(st.accepted_per_pos, before["per_pos"], strict=True)]}


def _snapshot(speculator: Any) -> dict[str, Any]:
    st = speculator.stats
    return {"drafts": st.num_drafts, "draft_tokens": st.num_draft_tokens, "accepted": st.num_accepted_tokens,
            "per_pos": list(st.accepted_per_pos)}


def copy_heavy(llm: Any, raw: dict[str, Any], reps: int, max_tokens: int) -> dict[str, Any]:
    from kvpilot.daemon.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    spec = _speculator(llm, raw)
    out: dict[str, Any] = {}
    for name, prompt in copy_heavy_prompts().items():
        off_s, on_s, tokens_off, tokens_on = [], [], None, None
        before = _snapshot(spec)
        for rep in range(reps):
            order = [(None, off_s), (spec, on_s)] if rep % 2 == 0 else [(spec, on_s), (None, off_s)]
            for which, times in order:
                llm.engine.reset_prefix_cache()  # every run prefills its prompt
                sec, toks, _ = timed(llm, which, [prompt], params)
                times.append(sec)
                if which is None:
                    tokens_off = toks
                else:
                    tokens_on = toks
        n = len(tokens_off[0])
        delta = _stats_delta(spec, before)
        ratio = statistics.median(off_s) / statistics.median(on_s)
        out[name] = {
            "output_tokens": n, "identical_tokens": tokens_on == tokens_off,
            "tok_s_off": [n / s for s in off_s], "tok_s_on": [n / s for s in on_s],
            "median_tok_s_off": n / statistics.median(off_s), "median_tok_s_on": n / statistics.median(on_s),
            "speedup": ratio,
            "acceptance_rate": delta["accepted"] / max(delta["draft_tokens"], 1),
            "acceptance_per_pos": [a / max(delta["drafts"], 1) for a in delta["per_pos"]],
            "mean_tokens_per_verification": 1 + delta["accepted"] / max(delta["drafts"], 1),
            **{f"spec_{k}": v for k, v in delta.items()},
        }
        print(f"{name}: {n} tokens, off {out[name]['median_tok_s_off']:.1f} tok/s, on "
              f"{out[name]['median_tok_s_on']:.1f} tok/s, {ratio:.2f}x, acceptance "
              f"{out[name]['acceptance_rate']:.2f} {[round(a, 2) for a in out[name]['acceptance_per_pos']]}, "
              f"identical {out[name]['identical_tokens']}", flush=True)
    llm.engine.speculator = None
    return out


def w96(llm: Any, raw: dict[str, Any], reps: int) -> dict[str, Any]:
    from kvpilot.daemon.engine import SamplingParams

    work = make_workload("w96")
    prompts = [{"prompt_token_ids": p} for p, _ in work]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in work]
    spec = _speculator(llm, raw)
    off_s, on_s, tokens = [], [], {}
    before = _snapshot(spec)
    for rep in range(reps):
        order = [(None, off_s), (spec, on_s)] if rep % 2 == 0 else [(spec, on_s), (None, off_s)]
        for which, times in order:
            llm.engine.reset_prefix_cache()
            sec, toks, _ = timed(llm, which, prompts, params)
            times.append(sec)
            tokens[which is None] = toks
    n = sum(len(t) for t in tokens[True])
    delta = _stats_delta(spec, before)
    res = {"output_tokens": n, "identical_tokens": tokens[True] == tokens[False],
           "seconds_off": off_s, "seconds_on": on_s,
           "tok_s_off": n / statistics.median(off_s), "tok_s_on": n / statistics.median(on_s),
           "on_vs_off": statistics.median(off_s) / statistics.median(on_s),
           **{f"spec_{k}": v for k, v in delta.items()}}
    print(f"w96: off {res['tok_s_off']:.1f} tok/s, on {res['tok_s_on']:.1f} tok/s, on/off {res['on_vs_off']:.3f}, "
          f"identical {res['identical_tokens']}, drafts {delta['drafts']}", flush=True)
    llm.engine.speculator = None
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=6)  # tuned: 4, 6 and 8 drafts in bench/README.md
    ap.add_argument("--lookup-min", type=int, default=None)
    ap.add_argument("--lookup-max", type=int, default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--w96-reps", type=int, default=2)
    # one thread: on the shared 2-core host a second OpenMP thread waits on a busy core and turns the
    # figures to noise (a batch-1 step varied 5x); the ratios are what this measures
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--parts", default="copy,w96")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "speculative.json"))
    args = ap.parse_args()

    import torch

    from kvpilot.daemon.engine import LLM
    from kvpilot.daemon.engine.loader import cpu_flags
    from kvpilot.daemon.engine.spec_decode import parse_speculative_config

    torch.set_num_threads(args.threads)
    raw: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": args.k}
    if args.lookup_min is not None:
        raw["prompt_lookup_min"] = args.lookup_min
    if args.lookup_max is not None:
        raw["prompt_lookup_max"] = args.lookup_max
    llm = LLM(model=MODEL, num_threads=args.threads, **SETTINGS)
    warm_up_kvpilot(llm, [100] * 32)
    parts = args.parts.split(",")
    flags = cpu_flags() or frozenset()
    result: dict[str, Any] = {
        "model": MODEL, "settings": SETTINGS, "speculative_config": vars(parse_speculative_config(raw)),
        "threads": args.threads, "reps": args.reps, "max_tokens": args.max_tokens,
        "host": {"avx512f": "avx512f" in flags, "avx2": "avx2" in flags},
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if "copy" in parts:
        result["copy_heavy_batch1"] = copy_heavy(llm, raw, args.reps, args.max_tokens)
        speedups = [r["speedup"] for r in result["copy_heavy_batch1"].values()]
        result["copy_heavy_min_speedup"] = min(speedups)
    if "w96" in parts:
        result["w96"] = w96(llm, raw, args.w96_reps)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
