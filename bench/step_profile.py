"""Where a step's time goes: per-component breakdown of kvpilot's CPU forward pass.

Times the real engine code, not a copy: the model module's ``F.linear``/``_rms_norm``/kernel calls
are wrapped with wall-clock timers (each component is a synchronous CPU op), the GEMMs are told
apart by their weight tensor. Shapes: decode batches of 8, 32, 96 and 256 sequences (every
sequence with ``--context`` tokens in the cache) and prefill chunks of 512 and 2048 tokens (one
sequence from position 0, and 2048 as 8 prompts of 256, the engine's usual mix). The KV cache holds
zeros: attention cost does not depend on the values. Sampler (greedy) and scheduler + KV
bookkeeping are timed separately at the same batch size.

Decode steps run their layers through Python while profiled: the native decode loop (models/native_decode.py,
the engine's path for decode steps of up to 20 float32 / 8 bfloat16 rows) is one call the timers cannot split.

"rope/silu/residual/misc" is the model forward minus its timed parts: RoPE, SiLU*up, the residual
adds, the embedding lookup and view/reshape glue. "runner python" is ``execute`` minus the model and
batch building. GFLOP/s counts 2*m*n*k per GEMM.

Usage: python bench/step_profile.py [--repeat 3] [--context 192] [--quick]
Writes bench/results/profile.json and bench/results/profile.md.

``--run w96`` (or w48) profiles a whole ``bench/peers.py`` workload instead, through ``LLM.generate`` as
peers.py times it: the same timers summed over every step of the run, plus "engine" (scheduling,
sampling, outputs: the run minus ``execute``). The run is timed once without the timers first, so the
JSON also says what they cost. Writes bench/results/profile_run_<workload>.json and .md.
"""

# A profiler: it wraps the model's and the runner's private helpers on purpose.
# ruff: noqa: SLF001
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvpilot.daemon.engine import LLM
from kvpilot.daemon.engine.models import decoder
from kvpilot.daemon.engine.models.quantization import unquantized
from kvpilot.daemon.engine.runner import SeqBatchEntry, cpu_threads
from kvpilot.daemon.engine.sampler import SamplingState
from kvpilot.daemon.engine.sampling_params import SamplingParams
from kvpilot.kernels import cpu_native, reference
from kvpilot.kernels import ops as kernels

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import KVPILOT_SETTINGS, fma_peak_gflops, make_workload, warm_up_kvpilot  # noqa: E402
from throughput import MODEL, bench_bookkeeping, cpu_name  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CATEGORIES = [
    "gemm_qkv", "gemm_o", "gemm_gate_up", "gemm_down", "lm_head", "prefill_attention", "decode_attention",
    "kv_store", "attention_other", "norms", "rope/silu/residual/misc", "batch_building", "runner_python",
    "sampler", "scheduler+kv_bookkeeping",
]
GEMMS = ("gemm_qkv", "gemm_o", "gemm_gate_up", "gemm_down", "lm_head")


class Timers:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.flops: dict[str, float] = defaultdict(float)

    def wrap(self, name: str | Callable[..., str], fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            key = name(*args, **kwargs) if callable(name) else name
            self.seconds[key] += time.perf_counter() - t0
            return out

        return timed


class _Proxy:
    """Stands in for a module inside decoder.py: a few attributes replaced, the rest delegated."""

    def __init__(self, base: Any, **overrides: Any) -> None:
        self._base = base
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)


def instrument(llm: LLM, timers: Timers) -> Callable[[], None]:
    """Install the timers; returns the function that removes them."""
    runner = llm.engine.runner
    model = runner.model
    kinds: dict[int, str] = {id(t): "lm_head" for t in (model.lm_head, *model.lm_head_chunks) if t is not None}
    for layer in model.layers:
        kinds[id(layer.qkv_proj.weight)] = "gemm_qkv"
        kinds[id(layer.o_proj.weight)] = "gemm_o"
        kinds[id(layer.gate_up_proj.weight)] = "gemm_gate_up"
        kinds[id(layer.down_proj.weight)] = "gemm_down"

    plain_linear = decoder.linear

    # passes every other argument through untouched: a fixed copy of the signature broke the profile
    # the day `linear` grew a `residual=` argument
    def linear(x: torch.Tensor, w: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        kind = kinds.get(id(w), "other_linear")
        t0 = time.perf_counter()
        out = plain_linear(x, w, *args, **kwargs)
        timers.seconds[kind] += time.perf_counter() - t0
        timers.flops[kind] += 2.0 * x.numel() * w.shape[0]
        return out

    saved = (decoder.linear, unquantized.linear, decoder._rms_norm, decoder.ops, cpu_native.paged_decode, cpu_native.paged_prefill,
             reference.attend_prefill_chunks, runner._prepare, runner.model.forward)
    decoder.linear = unquantized.linear = linear  # the LM head's call, and every projection's
    decoder._rms_norm = timers.wrap("norms", decoder._rms_norm)
    attn = timers.wrap("attention_call", kernels.paged_attention)
    decoder.ops = _Proxy(kernels, paged_attention=attn, store_kv=timers.wrap("kv_store", kernels.store_kv))
    cpu_native.paged_decode = timers.wrap("decode_attention", cpu_native.paged_decode)
    # prefill chunks: the C kernel where it is built (it falls back to SDPA itself), else the torch reference
    if cpu_native.available():
        cpu_native.paged_prefill = timers.wrap("prefill_attention", cpu_native.paged_prefill)
    else:
        reference.attend_prefill_chunks = timers.wrap("prefill_attention", reference.attend_prefill_chunks)
    runner._prepare = timers.wrap("batch_building", runner._prepare)
    runner.model.forward = timers.wrap("model_forward", runner.model.forward)
    # the timers see the Python layers' calls: a decode step's layers in one native call (native_decode.py)
    # would hide them, so a profile splits the Python path's step
    native = getattr(model, "use_native_decode", False)
    model.use_native_decode = False

    def restore() -> None:
        model.use_native_decode = native
        (decoder.linear, unquantized.linear, decoder._rms_norm, decoder.ops, cpu_native.paged_decode, cpu_native.paged_prefill,
         reference.attend_prefill_chunks, runner._prepare, runner.model.forward) = saved
        del runner.model.forward, runner._prepare  # drop the instance attributes: class methods again

    return restore


def decode_entries(batch: int, context: int, block_size: int) -> list[SeqBatchEntry]:
    per_seq = -(-(context + 1) // block_size)
    return [
        SeqBatchEntry(token_ids=[100 + i], start_pos=context, block_table=list(range(i * per_seq, (i + 1) * per_seq)),
                      compute_logits=True)
        for i in range(batch)
    ]


def prefill_entries(num_seqs: int, length: int, block_size: int) -> list[SeqBatchEntry]:
    per_seq = -(-length // block_size)
    return [
        SeqBatchEntry(token_ids=[(100 + 7 * j + i) % 40000 for j in range(length)], start_pos=0,
                      block_table=list(range(i * per_seq, (i + 1) * per_seq)), compute_logits=True)
        for i in range(num_seqs)
    ]


def split_execute(timed: dict[str, float], execute_s: float) -> dict[str, float]:
    """The timers' seconds over one or more ``execute`` calls (``execute_s`` in all) as the profile's
    categories: the untimed rest of the forward is RoPE/SiLU/residual glue, of ``execute`` the runner's
    Python, and of the attention call what its kernels did not take."""
    s = dict(timed)
    forward = s.pop("model_forward", 0.0)
    call = s.pop("attention_call", 0.0)
    s["attention_other"] = max(0.0, call - s.get("decode_attention", 0.0) - s.get("prefill_attention", 0.0))
    in_model = sum(v for k, v in s.items() if k not in ("lm_head", "batch_building"))
    s["rope/silu/residual/misc"] = max(0.0, forward - in_model)
    s["runner_python"] = max(0.0, execute_s - forward - s.get("lm_head", 0.0) - s.get("batch_building", 0.0))
    return s


def profile_shape(llm: LLM, entries: list[SeqBatchEntry], repeat: int, sched_ms: float) -> dict[str, Any]:
    runner = llm.engine.runner
    sampler = llm.engine.sampler
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    runs: list[dict[str, float]] = []
    flops: dict[str, float] = {}
    for it in range(repeat + 1):  # the first run warms allocator and caches
        timers = Timers()
        restore = instrument(llm, timers)
        try:
            t0 = time.perf_counter()
            logits = runner.execute(entries)
            t_exec = time.perf_counter() - t0
        finally:
            restore()
        states = [SamplingState(params, e.token_ids, []) for e, _ in zip(entries, range(logits.shape[0]), strict=False)]
        t0 = time.perf_counter()
        sampler(logits, states)
        t_sample = time.perf_counter() - t0
        if it == 0:
            continue
        s = split_execute(timers.seconds, t_exec)
        s["sampler"] = t_sample
        s["scheduler+kv_bookkeeping"] = sched_ms / 1000
        runs.append(s)
        flops = dict(timers.flops)
    med = {k: statistics.median(r.get(k, 0.0) for r in runs) for k in CATEGORIES}
    total = sum(med.values())
    tokens = sum(len(e.token_ids) for e in entries)
    gemm_s = sum(med[k] for k in GEMMS)
    gemm_flops = sum(flops.get(k, 0.0) for k in GEMMS)
    return {
        "tokens": tokens,
        "step_ms": 1000 * total,
        "ms": {k: 1000 * v for k, v in med.items()},
        "pct": {k: 100 * v / total for k, v in med.items()},
        "gemm_gflops": {k: flops[k] / med[k] / 1e9 for k in flops if med.get(k)},
        "gemm_gflops_all": gemm_flops / gemm_s / 1e9 if gemm_s else 0.0,
        "tokens_per_s": tokens / total,
    }


# a whole run: the sampler and the scheduler are timed together, as the engine's own share
RUN_CATEGORIES = [*CATEGORIES[: CATEGORIES.index("sampler")], "engine"]


def profile_run(llm: LLM, work: list[tuple[list[int], int]]) -> dict[str, Any]:
    """Where a whole run's time goes: ``work`` (prompt ids, output tokens) through ``LLM.generate``, greedy
    with EOS ignored, once plain and once under the timers, each from an empty prefix cache."""
    prompts = [{"prompt_token_ids": p} for p, _ in work]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in work]
    runner = llm.engine.runner

    def generate() -> tuple[float, int]:
        llm.engine.reset_prefix_cache()
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outputs)

    plain_s, _ = generate()
    timers = Timers()
    restore = instrument(llm, timers)
    runner.execute = timers.wrap("execute", runner.execute)
    try:
        wall, output_tokens = generate()
    finally:
        restore()
        del runner.execute  # the class method again
    timed = dict(timers.seconds)
    execute = timed.pop("execute", 0.0)
    s = split_execute(timed, execute)
    s["engine"] = max(0.0, wall - execute)
    seconds = {k: s.get(k, 0.0) for k in RUN_CATEGORIES}
    gemm_s = sum(seconds[k] for k in GEMMS)
    return {
        "requests": len(work),
        "output_tokens": output_tokens,
        "plain_s": plain_s,
        "profiled_s": wall,
        "seconds": seconds,
        "pct": {k: 100 * v / wall for k, v in seconds.items()},
        "gemm_gflops": {k: timers.flops[k] / seconds[k] / 1e9 for k in GEMMS if seconds[k]},
        "gemm_gflops_all": sum(timers.flops[k] for k in GEMMS) / gemm_s / 1e9 if gemm_s else 0.0,
    }


def run_markdown(result: dict[str, Any]) -> str:
    run = result["run"]
    peak = result["matmul_peak"]
    rates = run["gemm_gflops"]
    lines = [
        f"# kvpilot run profile: {result['workload']} ({result['machine']['cpu']}, {result['machine']['threads']} "
        f"threads, {result.get('dtype', 'float32')}, {result['model']})",
        "",
        f"{run['requests']} requests, {run['output_tokens']} output tokens: {run['plain_s']:.2f} s without the "
        f"timers, {run['profiled_s']:.2f} s with them (the shares below are of the timed run). fp32 matmul "
        f"measured here: {peak['gflops']:.0f} GFLOP/s"
        + (f"; the cores' FMA peak {fma:.0f} GFLOP/s." if (fma := peak.get("fma_peak_gflops")) else "."),
        "",
        "| component | s | % | GFLOP/s |",
        "|---|---:|---:|---:|",
    ]
    lines.extend(f"| {k} | {run['seconds'][k]:.2f} | {run['pct'][k]:.1f} | "
                 + (f"{rates[k]:.0f}" if k in rates else "") + " |" for k in RUN_CATEGORIES)
    lines.append(f"| **all GEMMs** | {sum(run['seconds'][k] for k in rates):.2f} | "
                 f"{sum(run['pct'][k] for k in rates):.1f} | {run['gemm_gflops_all']:.0f} |")
    return "\n".join(lines) + "\n"


def machine(threads: int) -> dict[str, Any]:
    return {"cpu": cpu_name(), "threads": threads, "torch": torch.__version__,
            "cpu_attention": "native C" if cpu_native.available() else "torch reference"}


def main_run(workload: str, out: str, dtype: str = "float32", model: str = MODEL) -> None:
    """``--run``: one peers.py workload, warmed up as peers.py warms kvpilot."""
    torch.set_num_threads(cpu_threads())
    threads = torch.get_num_threads()
    work = make_workload(workload)
    llm = LLM(model=model, **{**KVPILOT_SETTINGS, "dtype": dtype})
    warm_up_kvpilot(llm, work[0][0])
    result = {
        "machine": machine(threads),
        "model": model,
        "dtype": dtype,
        "workload": workload,
        "run": profile_run(llm, work),
        "matmul_peak": matmul_peak(threads),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{out}.json").write_text(json.dumps(result, indent=2))
    md = run_markdown(result)
    (RESULTS / f"{out}.md").write_text(md)
    print(md)


def matmul_peak(threads: int) -> dict[str, float]:
    """The fp32 GEMM rate this box reaches on a large square matmul (the ceiling for the model's GEMMs)."""
    a = torch.randn(2048, 2048)
    b = torch.randn(2048, 2048)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    rate = 2 * 2048**3 / best / 1e9
    # torch's sgemm is no ceiling (on AMD hosts it stays well below the cores' FMA rate): that rate too
    return {"threads": threads, "gflops": rate, "gflops_per_core": rate / threads,
            "fma_peak_gflops": fma_peak_gflops(threads)}


def markdown(result: dict[str, Any]) -> str:
    shapes = result["shapes"]
    names = list(shapes)
    lines = [
        f"# kvpilot step profile ({result['machine']['cpu']}, {result['machine']['threads']} threads, "
        f"{result.get('dtype', 'float32')}, {result['model']})",
        "",
        f"Context {result['context']} tokens per decode sequence; median of {result['repeat']} runs. "
        f"fp32 matmul peak measured here: {result['matmul_peak']['gflops']:.0f} GFLOP/s "
        f"({result['matmul_peak']['gflops_per_core']:.0f} per core)"
        + (f"; the cores' FMA peak {fma:.0f} GFLOP/s." if (fma := result["matmul_peak"].get("fma_peak_gflops"))
           else "."),
        "",
        "Share of step time, % (ms in the last rows):",
        "",
        "| component | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    lines.extend(f"| {k} | " + " | ".join(f"{shapes[n]['pct'][k]:.1f}" for n in names) + " |" for k in CATEGORIES)
    lines.append("| **step ms** | " + " | ".join(f"{shapes[n]['step_ms']:.1f}" for n in names) + " |")
    lines.append("| tokens/s | " + " | ".join(f"{shapes[n]['tokens_per_s']:.0f}" for n in names) + " |")
    lines.append("| GEMM GFLOP/s | " + " | ".join(f"{shapes[n]['gemm_gflops_all']:.0f}" for n in names) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--context", type=int, default=192)
    ap.add_argument("--quick", action="store_true", help="one run, batches 4 and 16 and a 512 chunk only")
    ap.add_argument("--out", default=None, help="basename of the JSON/markdown files in bench/results")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="model dtype (bfloat16: for CPUs with AVX512-BF16 or AMX)")
    ap.add_argument("--run", choices=["w48", "w96"], default=None,
                    help="profile a whole bench/peers.py workload run instead of single steps")
    ap.add_argument("--model", default=MODEL, help="with --run: the model the workload runs on")
    args = ap.parse_args()
    if args.run:
        main_run(args.run, args.out or f"profile_run_{args.run}", args.dtype, args.model)
        return
    args.out = args.out or "profile"
    torch.set_num_threads(cpu_threads())
    threads = torch.get_num_threads()
    decode_sizes = [4, 16] if args.quick else [4, 16, 32, 96, 256]
    repeat = 1 if args.quick else args.repeat
    bs = 16
    blocks = max(256 * -(-(args.context + 1) // bs), 2 * 2048 // bs) + 8
    llm = LLM(model=MODEL, dtype=args.dtype, quantization="none", num_kv_blocks=blocks, max_num_seqs=256, max_num_batched_tokens=2048,
              enable_prefix_caching=False)
    # the cache's pages are mapped in on a background thread: profiling beside it timed that thread's
    # page faults too (a decode step of 96 at 728 ms against about 205 ms in a real run)
    llm.engine.wait_for_kv_cache_mapped()
    shapes: dict[str, Any] = {}
    for b in decode_sizes:
        sched_ms = bench_bookkeeping(num_running=b, steps=50)["mean_ms"]
        shapes[f"decode {b}"] = profile_shape(llm, decode_entries(b, args.context, bs), repeat, sched_ms)
        print(f"decode {b}:", json.dumps(shapes[f"decode {b}"]["ms"]), flush=True)
    chunks = [("prefill 512", 1, 512)] if args.quick else [
        ("prefill 512", 1, 512), ("prefill 2048", 1, 2048), ("prefill 8x256", 8, 256)]
    for name, n, length in chunks:
        shapes[name] = profile_shape(llm, prefill_entries(n, length, bs), repeat, bench_bookkeeping(
            num_running=n, steps=20)["mean_ms"])
        print(f"{name}:", json.dumps(shapes[name]["ms"]), flush=True)
    result = {
        "machine": machine(threads),
        "model": MODEL,
        "dtype": args.dtype,
        "context": args.context,
        "repeat": repeat,
        "matmul_peak": matmul_peak(threads),
        "shapes": shapes,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=2))
    md = markdown(result)
    (RESULTS / f"{args.out}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
