"""The engine on a CUDA GPU: correctness against the CPU and HF transformers, CUDA graphs, throughput.

1. greedy parity: the CPU engine's greedy tokens (fp32, made here with ``--make-reference``) against the
   engine on CUDA in fp32 and bf16;
2. prompt logprobs against HF transformers on the same GPU, same weights, fp32 and bf16;
3. CUDA graphs off and on: the same greedy tokens, and the decode-heavy time of each;
4. throughput on peers.py's w96 workload (and a 1024-request one of the same shape), bf16 and fp32,
   next to HF ``generate`` in static batches of 16 (bf16).

Each part records its error and the script goes on. Usage:
    python bench/gpu_engine.py --make-reference            # on the CPU, writes the reference file
    python bench/gpu_engine.py [--model M] [--out DIR]     # on the GPU
Writes gpu_engine.json (bench/results, or --out).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import WORKLOADS, make_workload  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
REFERENCE = RESULTS / "gpu_reference_tokens.json"
MODEL = "builtin://smollm2-135m"
PARITY_TOKENS = 48
DEVICE = "cuda"  # --device cpu: a dry run of the script's own logic where there is no GPU
TEXT_PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Kubernetes is an open-source system for",
    "1, 2, 3, 4, 5,",
    "Translate to French: Good morning, how are you?",
]


def engine(model: str, **kwargs: Any):
    from kvpilot.daemon.engine import LLM

    return LLM(model=model, **kwargs)


def greedy_params(max_tokens: int):
    """Greedy sampling of exactly ``max_tokens`` tokens (EOS ignored), as every load here asks."""
    from kvpilot.daemon.engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def greedy(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = greedy_params(max_tokens)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def release_memory() -> None:
    """After the caller has dropped its engine or model: collect it and hand its GPU memory back, so that the
    next one sizes itself on a free device."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# the throughput and profile loads' engine settings
LOAD_SETTINGS: dict[str, Any] = {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "num_kv_blocks": 16384}


def w96_shaped(n: int) -> list[tuple[list[int], int]]:
    """``n`` requests of peers.py's w96 shape: w96 itself first, then w96 with seeds 1, 2, ..."""
    work = make_workload("w96")
    seed = 1
    while len(work) < n:
        work += make_workload("w96", seed=seed)
        seed += 1
    return work[:n]


def make_reference(model: str) -> None:
    """CPU fp32 greedy tokens of the text prompts and two random-id prompts, with the prompts' ids."""
    llm = engine(model, device="cpu", dtype="float32")
    tok = llm.engine.tokenizer
    rng = random.Random(7)
    prompts = [tok.encode(t) for t in TEXT_PROMPTS]
    prompts += [[rng.randint(100, 49151) for _ in range(n)] for n in (40, 300)]
    ref = {"model": model, "device": "cpu", "dtype": "float32", "max_tokens": PARITY_TOKENS, "prompts": prompts,
           "tokens": greedy(llm, prompts, PARITY_TOKENS)}
    REFERENCE.write_text(json.dumps(ref))
    print(f"wrote {REFERENCE}: {len(prompts)} prompts x {PARITY_TOKENS} tokens")


def write_random_model(meta: Path, out: Path) -> None:
    """A folder with ``meta``'s config and tokenizer and random weights (seed 0): for a GPU machine that
    the real weights could not reach. Greedy parity with the CPU reference needs the real ones."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(meta), dtype=torch.float32)
    model.save_pretrained(out)
    for f in meta.iterdir():
        if f.name != "config.json":
            shutil.copy(f, out / f.name)
    print(f"wrote random weights of {meta}'s shape to {out}")


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def greedy_parity(model: str, reference: dict) -> dict:
    res: dict[str, Any] = {}
    for dtype in ("float32", "bfloat16"):
        llm = engine(model, device=DEVICE, dtype=dtype, num_kv_blocks=4096)
        got = greedy(llm, reference["prompts"], reference["max_tokens"])
        prefixes = [common_prefix(g, w) for g, w in zip(got, reference["tokens"], strict=True)]
        res[dtype] = {"identical": sum(p == reference["max_tokens"] for p in prefixes), "of": len(prefixes),
                      "common_prefix_tokens": prefixes}
        print(f"greedy vs CPU fp32, {dtype} on {DEVICE}: {res[dtype]}", flush=True)
        del llm
        release_memory()
    res["ok"] = res["float32"]["identical"] >= len(reference["prompts"]) - 1  # one late near-tie may flip
    return res


def prompt_logprob_parity(model: str, prompts: list[list[int]]) -> dict:
    """Max |engine - HF| over every scored prompt position, same GPU, same weights."""
    from transformers import AutoModelForCausalLM

    from kvpilot.common.model_source import resolve_model_path
    from kvpilot.daemon.engine import SamplingParams

    folder = resolve_model_path(model)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    res: dict[str, Any] = {}
    for dtype, tol in (("float32", 2e-3), ("bfloat16", 0.25)):
        llm = engine(model, device=DEVICE, dtype=dtype, num_kv_blocks=4096)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        ours = [[e[p[i + 1]].logprob for i, e in enumerate(o.prompt_logprobs[1:])] for o, p in zip(outs, prompts, strict=True)]
        del llm
        release_memory()
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).to(DEVICE).eval()
        worst = 0.0
        with torch.inference_mode():
            for p, mine in zip(prompts, ours, strict=True):
                ids = torch.tensor([p], device=DEVICE)
                logp = hf(ids).logits[0].float().log_softmax(-1)
                theirs = logp[torch.arange(len(p) - 1, device=DEVICE), ids[0, 1:]]
                worst = max(worst, (theirs.cpu() - torch.tensor(mine)).abs().max().item())
        del hf
        release_memory()
        res[dtype] = {"max_abs_diff": worst, "tolerance": tol, "ok": worst <= tol}
        print(f"prompt logprobs vs HF on {DEVICE}, {dtype}: {res[dtype]}", flush=True)
    res["ok"] = all(res[d]["ok"] for d in ("float32", "bfloat16"))
    return res


def graphs_on_off(model: str) -> dict:
    """64 random-id prompts, 64 greedy tokens each: eager, then with decode graphs."""
    rng = random.Random(3)
    prompts = [[rng.randint(100, 49151) for _ in range(16 + 5 * i)] for i in range(64)]
    res: dict[str, Any] = {}
    tokens = {}
    for dtype in ("float32", "bfloat16"):
        for flag in ("0", "1"):
            llm = engine(model, device=DEVICE, dtype=dtype, max_num_seqs=64, num_kv_blocks=4096,
                         enforce_eager=flag == "0")
            greedy(llm, prompts[:2], 4)  # compiles the kernels
            sync()
            t0 = time.perf_counter()
            tokens[dtype, flag] = greedy(llm, prompts, 64)
            sync()
            seconds = time.perf_counter() - t0
            captured = llm.engine.runner._graphs is not None  # noqa: SLF001
            res[f"{dtype}_graphs{flag}"] = {"seconds": seconds, "captured": captured}
            print(f"{dtype} graphs={flag}: {seconds:.2f} s, captured={captured}", flush=True)
            del llm
            release_memory()
        same = sum(a == b for a, b in zip(tokens[dtype, "0"], tokens[dtype, "1"], strict=True))
        res[f"{dtype}_identical"] = same
        res[f"{dtype}_speedup"] = res[f"{dtype}_graphs0"]["seconds"] / res[f"{dtype}_graphs1"]["seconds"]
    res["ok"] = res["float32_identical"] == len(prompts) and res["float32_graphs1"]["captured"]
    return res


def timed_engine_run(model: str, work: list[tuple[list[int], int]], dtype: str) -> dict:

    t_start = time.perf_counter()
    llm = engine(model, device=DEVICE, dtype=dtype, **LOAD_SETTINGS)
    start_s = time.perf_counter() - t_start
    greedy(llm, [p for p, _ in work[:8]], 4)
    llm.engine.reset_prefix_cache()
    params = [greedy_params(m) for _, m in work]
    sync()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in work], params, use_tqdm=False)
    sync()
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(m for _, m in work)
    del llm
    release_memory()
    return {"seconds": seconds, "output_tokens": tokens, "output_tokens_per_s": tokens / seconds,
            "engine_start_s": start_s}


def hf_static(model: str, work: list[tuple[list[int], int]], batch_size: int = 16) -> dict:
    """HF ``generate`` in static batches (throughput.py's peer), bf16 on this device."""
    from throughput import bench_hf_static
    from transformers import AutoModelForCausalLM

    from kvpilot.common.model_source import resolve_model_path

    hf = AutoModelForCausalLM.from_pretrained(resolve_model_path(model), dtype=torch.bfloat16).to(DEVICE).eval()
    sync()
    res = bench_hf_static(hf, work, batch_size)
    del hf
    release_memory()
    return res


RUNS = ("bfloat16:w96", "float32:w96", "bfloat16:w1024", "float32:w1024")


def throughput(model: str, cap: int | None = None, runs: tuple[str, ...] = RUNS, hf: bool = True) -> dict:
    res: dict[str, Any] = {"workloads": {"w96": WORKLOADS["w96"], "w1024": "1024 requests, w96's shape"}}
    w96, w1024 = w96_shaped(96), w96_shaped(1024)
    if cap:  # a dry run
        w96, w1024 = w96[:cap], w1024[: 2 * cap]
    loads = {"w96": w96, "w1024": w1024}
    for run in runs:
        dtype, name = run.split(":")
        r = timed_engine_run(model, loads[name], dtype)
        res[f"kvpilot_{dtype}_{name}"] = r
        print(f"kvpilot {dtype} {name}: {r}", flush=True)
    if hf:
        r = hf_static(model, w96)
        res["hf_static16_bfloat16_w96"] = r
        print(f"HF static16 bf16 w96: {r}", flush=True)
        if "kvpilot_bfloat16_w96" in res:
            res["ratio_w96_bf16_vs_hf_static16"] = (res["kvpilot_bfloat16_w96"]["output_tokens_per_s"]
                                                    / r["output_tokens_per_s"])
    res["default_sizing"] = default_sizing(model)
    return res


def default_sizing(model: str) -> dict:
    """The engine as a user starts it (gpu_memory_utilization=0.9 sizes the KV cache): start time, blocks."""
    t0 = time.perf_counter()
    llm = engine(model, device=DEVICE)
    start_s = time.perf_counter() - t0
    runner = llm.engine.runner
    res = {"engine_start_s": start_s, "dtype": str(runner.dtype), "num_kv_blocks": runner.num_blocks,
           "kv_cache_gib": runner.num_blocks * runner.kv_bytes_per_block / 2**30,
           "graphs_captured": runner._graphs is not None}  # noqa: SLF001
    res["first_request_tokens"] = len(greedy(llm, [[100, 200, 300]], 8)[0])
    del llm
    release_memory()
    print(f"default sizing: {res}", flush=True)
    return res


def add_greedy_load(llm, work: list[tuple[list[int], int]], prefix: str = "p", start: int = 0) -> list[str]:
    """Queue ``work`` (prompt ids, output length) as greedy requests ``prefix``+start, +start+1, ...;
    returns their ids."""
    ids = []
    for i, (p, m) in enumerate(work, start=start):
        llm.engine.add_request(f"{prefix}{i}", {"prompt_token_ids": p}, greedy_params(m))
        ids.append(f"{prefix}{i}")
    return ids


def timed_step(llm) -> float:
    """One engine step, with the GPU's work in it: seconds."""
    sync()
    t0 = time.perf_counter()
    llm.engine.step()
    sync()
    return time.perf_counter() - t0


def profile_steps(model: str, requests: int = 400, steps: int = 120, profiled: tuple[int, int] = (60, 75)) -> dict:
    """Per-step wall time for the first ``steps`` steps of a w1024-shaped load, per dtype, and the
    profiler's top kernels over a window of them: where a slow dtype loses its time."""
    from torch.profiler import ProfilerActivity, profile

    work = w96_shaped(requests)
    res: dict[str, Any] = {}
    for dtype in ("float32", "bfloat16"):
        llm = engine(model, device=DEVICE, dtype=dtype, **LOAD_SETTINGS)
        ids = add_greedy_load(llm, work)
        times = []
        table = ""
        for k in range(steps):
            if k == profiled[0]:
                prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                prof.__enter__()
            times.append(timed_step(llm))
            if k == profiled[1]:
                prof.__exit__(None, None, None)
                table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60)
        llm.engine.abort_request(ids)
        del llm
        release_memory()
        res[dtype] = {"step_ms": [round(1000 * t, 2) for t in times], "total_s": sum(times),
                      "profiled_steps": list(profiled), "top_kernels": table}
        print(f"{dtype}: {steps} steps {sum(times):.2f} s; step ms {res[dtype]['step_ms'][::6]}", flush=True)
        print(table, flush=True)
    return res


def gemm_rows(calls: int = 200) -> dict:
    """Host time per GEMM call (enqueue only, no sync inside the loop) when every call has a new row count,
    as mixed steps give, against one repeated count and counts padded to multiples of 64: whether the BLAS
    library's per-shape kernel choice is what the host pays for. SmolLM2's gate|up shape."""
    import torch.nn.functional as F

    res: dict[str, Any] = {}
    rng = random.Random(5)
    for dtype in (torch.bfloat16, torch.float32):
        w = torch.randn(3072, 576, dtype=dtype, device=DEVICE)
        fresh = rng.sample(range(17, 4000), calls)  # never the same count twice
        cases = {"new_count_each_call": fresh, "one_count": [1000] * calls,
                 "padded_to_64": [-(-m // 64) * 64 for m in fresh]}
        xs = torch.randn(4096, 576, dtype=dtype, device=DEVICE)
        for name, counts in cases.items():
            for m in counts[:3]:
                F.linear(xs[:m], w)
            sync()
            host = 0.0
            t0 = time.perf_counter()
            for m in counts:
                t = time.perf_counter()
                F.linear(xs[:m], w)
                host += time.perf_counter() - t
            sync()
            wall = time.perf_counter() - t0
            key = f"{str(dtype).removeprefix('torch.')}_{name}"
            res[key] = {"host_us_per_call": 1e6 * host / calls, "wall_us_per_call": 1e6 * wall / calls}
            print(f"gemm rows {key}: host {res[key]['host_us_per_call']:.1f} us/call, "
                  f"wall {res[key]['wall_us_per_call']:.1f} us/call", flush=True)
    return res


def host_profile(model: str, requests: int = 400, steps: int = 100, window: tuple[int, int] = (40, 100)) -> dict:
    """Where the host's time goes in a w1024-shaped bf16 load: cProfile over a window of steps (Python
    functions; a wait for the GPU shows where it syncs), then the same steps timed without the profiler."""
    import cProfile
    import io
    import pstats

    work = w96_shaped(requests)
    res: dict[str, Any] = {}
    for label in ("profiled", "timed"):
        llm = engine(model, device=DEVICE, dtype="bfloat16", **LOAD_SETTINGS)
        ids = add_greedy_load(llm, work)
        prof = cProfile.Profile()
        times = []
        for k in range(steps):
            if label == "profiled" and k == window[0]:
                prof.enable()
            times.append(timed_step(llm))
            if label == "profiled" and k == window[1] - 1:
                prof.disable()
        llm.engine.abort_request(ids)
        del llm
        release_memory()
        entry: dict[str, Any] = {"window_s": sum(times[window[0]:window[1]]), "total_s": sum(times),
                                 "step_ms": [round(1000 * t, 2) for t in times]}
        if label == "profiled":
            for order in ("tottime", "cumulative"):
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats(order).print_stats(28)
                entry[f"by_{order}"] = text.getvalue()
                print(text.getvalue(), flush=True)
        res[label] = entry
        print(f"host {label}: steps {window} {entry['window_s']:.3f} s, all {steps} {entry['total_s']:.3f} s", flush=True)
    return res


ARRIVALS_PER_STEP = 2


def arrivals(model: str, requests: int = 300) -> dict:
    """Requests of w96's shape arriving a few per step, as a server sees them, so that nearly every step
    has a token count of its own (the engine loop, CUMULATIVE outputs, as the daemon runs it); per dtype,
    after a first run that compiles the kernels."""

    res: dict[str, Any] = {}
    work = w96_shaped(requests)
    for dtype in ("bfloat16", "float32"):
        llm = engine(model, device=DEVICE, dtype=dtype, **LOAD_SETTINGS)
        counts: set[int] = set()  # the steps' token counts
        execute = llm.engine.runner.execute

        def counted(entries: list, execute=execute, counts=counts) -> torch.Tensor:
            counts.add(sum(len(e.token_ids) for e in entries))
            return execute(entries)

        llm.engine.runner.execute = counted
        for run in ("first", "second"):
            llm.engine.reset_prefix_cache()
            counts.clear()
            times: list[float] = []
            added, tokens_before = 0, llm.engine.generation_tokens_total
            sync()
            t0 = time.perf_counter()
            while added < len(work) or llm.engine.has_unfinished_requests():
                added += len(add_greedy_load(llm, work[added: added + ARRIVALS_PER_STEP], run, added))
                times.append(timed_step(llm))
            seconds = time.perf_counter() - t0
            tokens = llm.engine.generation_tokens_total - tokens_before
            r = {"seconds": seconds, "steps": len(times), "distinct_token_counts": len(counts),
                 "output_tokens": tokens, "output_tokens_per_s": tokens / seconds,
                 "step_ms_p50": 1000 * sorted(times)[len(times) // 2], "step_ms_max": 1000 * max(times)}
            res[f"{dtype}_{run}"] = r
            print(f"arrivals {dtype} {run}: {r}", flush=True)
        del llm
        release_memory()
    return res


def output_kinds(model: str, requests: int = 1024) -> dict:
    """The same greedy load through ``LLM.generate`` (FINAL_ONLY: finished outputs only, each text decoded
    once) and through the engine loop with CUMULATIVE outputs (an output per request per step, text decoded
    as it goes, as a server streams), alternating, in one engine per dtype: the host's share of outputs."""

    work = w96_shaped(requests)
    res: dict[str, Any] = {}
    for dtype in ("bfloat16", "float32"):
        llm = engine(model, device=DEVICE, dtype=dtype, **LOAD_SETTINGS)
        greedy(llm, [p for p, _ in work[:8]], 4)
        params = [greedy_params(m) for _, m in work]
        for run in range(2):
            for kind in ("final_only", "cumulative"):
                llm.engine.reset_prefix_cache()
                sync()
                t0 = time.perf_counter()
                if kind == "final_only":
                    llm.generate([{"prompt_token_ids": p} for p, _ in work], params, use_tqdm=False)
                else:
                    add_greedy_load(llm, work, f"c{run}-")
                    while llm.engine.has_unfinished_requests():
                        llm.engine.step()
                sync()
                seconds = time.perf_counter() - t0
                res.setdefault(f"{dtype}_{kind}_s", []).append(seconds)
                print(f"output kinds {dtype} {kind} run {run}: {seconds:.2f} s", flush=True)
        del llm
        release_memory()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--make-reference", action="store_true", help="write the CPU reference tokens and stop")
    ap.add_argument("--reference", type=Path, default=REFERENCE)
    ap.add_argument("--write-random-model", type=Path, nargs=2, metavar=("META", "OUT"),
                    help="write a random-weight model of META's config to OUT and stop")
    ap.add_argument("--parts", default="parity,logprobs,graphs,throughput")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--runs", default=",".join(RUNS), help="throughput runs, dtype:workload")
    ap.add_argument("--skip-hf", action="store_true", help="no HF static-batch run in the throughput part")
    ap.add_argument("--cap", type=int, default=None, help="requests per throughput workload (dry runs)")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    if args.write_random_model:
        write_random_model(*args.write_random_model)
        return
    if args.make_reference:
        make_reference(args.model)
        return
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/gpu_engine.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    reference = json.loads(args.reference.read_text())
    report: dict[str, Any] = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
                              "model": args.model}
    try:
        import triton

        report["triton"] = triton.__version__
    except ImportError as e:
        report["triton"] = f"missing: {e}"
    parts = {"parity": lambda: greedy_parity(args.model, reference),
             "logprobs": lambda: prompt_logprob_parity(args.model, reference["prompts"]),
             "graphs": lambda: graphs_on_off(args.model),
             "throughput": lambda: throughput(args.model, args.cap, tuple(args.runs.split(",")), not args.skip_hf),
             "profile": lambda: profile_steps(args.model),
             "gemm_rows": gemm_rows,
             "host": lambda: host_profile(args.model),
             "arrivals": lambda: arrivals(args.model, args.cap or 300),
             "output_kinds": lambda: output_kinds(args.model, args.cap or 1024)}
    for name in args.parts.split(","):
        t0 = time.perf_counter()
        try:
            report[name] = parts[name]()
        except Exception as e:  # record and go on: one device session has to show as much as it can
            traceback.print_exc()
            report[name] = {"error": f"{type(e).__name__}: {e}", "ok": False}
        report[name]["wall_s"] = time.perf_counter() - t0
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_engine.json").write_text(json.dumps(report, indent=1))
    failed = [n for n in args.parts.split(",") if report[n].get("ok") is False]
    print("failed:", failed or "none")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
