"""The CPU step model's calibration: whole engine steps of the demo's daemons, timed on this CPU.

    .venv/bin/python bench/autoscale_stepprofile.py [--rounds 5]

The demo's daemons (e2e/workload.py, e2e/lifecycle.py) run SmolLM2-135M in float32 on one thread each, with
blocks of 16 tokens, at most 4 sequences and 512 tokens a step. Each scenario below adds requests to such an
engine and steps it (`LLMEngine.step`: scheduler, model, sampler, outputs) until they end, timing every
step and recording its shape: prefill tokens, decoding sequences and the context those read. The scenarios
cover the demo's requests (29-token prompts with 16 tokens out, 12-token prompts with 64 out), longer
contexts, prefill-only steps and a step that mixes a prompt into decodes.

This host is shared, and a neighbour only ever makes a step slower, so every round times every scenario
(the rounds interleaved, after one warm-up round) and a shape's time is the fastest round's median of its
steps. Writes bench/results/autoscale_step_cpu.json: each shape with every round's time and the one kept;
`autoscale_stepmodel.cpu()` fits the step model to it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from host import cpu_name

from kvpilot.daemon.engine import LLM, SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"
OUT = RESULTS / "autoscale_step_cpu.json"
MODEL = "builtin://smollm2-135m"
ENGINE = {"dtype": "float32", "block_size": 16, "max_num_seqs": 4, "max_num_batched_tokens": 512,
          "max_model_len": 256, "num_threads": 1, "enable_prefix_caching": False,
          "num_kv_blocks": 64}  # the demo's 16 blocks hold its requests; 64 hold 4 sequences of 248 tokens
# name -> [(prompt tokens, output tokens, requests, added after this many steps)]
SCENARIOS: dict[str, list[tuple[int, int, int, int]]] = {
    **{f"demo heavy x{k}": [(29, 16, k, 0)] for k in (1, 2, 3, 4)},
    "demo trickle x2": [(12, 64, 2, 0)],
    **{f"long x{k}": [(200, 24, k, 0)] for k in (1, 4)},
    **{f"prefill {n}": [(n, 1, 1, 0)] for n in (64, 128, 250)},
    "prefill 4x60": [(60, 1, 4, 0)],
    "mixed": [(29, 16, 3, 0), (29, 16, 1, 3)],  # a prompt joins three decoding sequences
}

Shape = tuple[int, int, int]  # (prefill tokens, decoding sequences, context tokens those read)


def step_shape(entries: list[Any]) -> Shape:
    """A step's shape from the runner's batch: one-token entries past position 0 decode, the rest prefill."""
    prefill = decode = context = 0
    for e in entries:
        if len(e.token_ids) == 1 and e.start_pos > 0:
            decode += 1
            context += e.start_pos + 1
        else:
            prefill += len(e.token_ids)
    return prefill, decode, context


def run_scenario(llm: LLM, name: str, plan: list[tuple[int, int, int, int]], tag: str) -> list[tuple[Shape, float]]:
    engine = llm.engine
    shapes: list[Shape] = []
    execute = engine.runner.execute

    def recording(entries: list[Any]) -> Any:
        shapes.append(step_shape(entries))
        return execute(entries)

    engine.runner.execute = recording
    try:
        steps: list[tuple[Shape, float]] = []
        pending = sorted(plan, key=lambda p: p[3])
        n = 0
        while pending or engine.has_unfinished_requests():
            while pending and pending[0][3] <= len(steps):
                prompt, out, count, _ = pending.pop(0)
                for _ in range(count):
                    n += 1
                    ids = [1000 + 7 * n + i for i in range(prompt)]  # distinct prompts: no shared prefix
                    engine.add_request(f"{tag}-{name}-{n}", {"prompt_token_ids": ids},
                                       SamplingParams(max_tokens=out, ignore_eos=True, temperature=0.0))
            before = len(shapes)
            t0 = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t0
            if len(shapes) > before:  # a step that ran the model
                steps.append((shapes[-1], dt))
        return steps
    finally:
        del engine.runner.execute  # the class's method again


def profile(rounds: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    settings = dict(ENGINE)
    try:
        llm = LLM(model=MODEL, quantization="none", **settings)
    except TypeError:  # an engine from before quantization settings
        llm = LLM(model=MODEL, **settings)
    llm.engine.wait_for_kv_cache_mapped()  # mapping the cache in the background would time its page faults too
    per_round: dict[str, list[float]] = defaultdict(list)
    for r in range(rounds + 1):
        times: dict[Shape, list[float]] = defaultdict(list)
        for name, plan in SCENARIOS.items():
            for shape, dt in run_scenario(llm, name, plan, f"r{r}"):
                times[shape].append(dt)
        if r == 0:
            continue  # warm-up: allocator, caches, lazy kernels
        for shape, ts in times.items():
            per_round[json.dumps(shape)].append(statistics.median(ts))
        print(f"round {r}: {sum(len(t) for t in times.values())} steps", flush=True)
    shapes = {k: {"rounds_s": v, "step_s": min(v)} for k, v in sorted(per_round.items()) if len(v) == rounds}
    return {"model": MODEL, "engine": settings, "threads": 1, "rounds": rounds,
            "rule": "per shape: the median of its steps in a round, then the fastest round",
            "cpu": cpu_name(), "shapes": shapes}



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    result = profile(args.rounds)
    OUT.write_text(json.dumps(result, indent=1))
    print(f"{len(result['shapes'])} shapes -> {OUT}")


if __name__ == "__main__":
    main()
