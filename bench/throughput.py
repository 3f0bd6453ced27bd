"""Offline throughput: kvpilot's engine vs HF transformers `generate` (static batches) and `generate_batch`.

All peers run in this process on the same plain (dequantized) weights and dtype, on the same workload:
128 requests with prompts of 32-512 random tokens and outputs of 16-256 tokens, EOS ignored, so that
every system produces exactly the same number of useful tokens. Also: a shared-prefix workload with
prefix caching on vs off, the KV waste, and scheduler + KV bookkeeping time per step at 256 running.

Usage: python bench/throughput.py [--num-requests 128] [--skip-hf] [--quick]
Writes bench/results/throughput.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from host import cpu_name

from kvpilot.common.model_source import resolve_model_path
from kvpilot.daemon.engine import LLM, EngineConfig, SamplingParams
from kvpilot.daemon.engine.runner import cpu_threads
from kvpilot.daemon.engine.scheduler import Scheduler
from kvpilot.daemon.engine.sequence import Sequence, SequenceStatus
from kvpilot.kernels import cpu_native

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "builtin://smollm2-135m"



def make_workload(n: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    work = []
    for _ in range(n):
        prompt_len = rng.randint(32, 512)
        out_len = rng.randint(16, 256)
        # Token ids from the common range of the vocabulary (skip the special tokens at the start).
        work.append(([rng.randint(100, vocab - 1) for _ in range(prompt_len)], out_len))
    return work


def bench_kvpilot(llm: LLM, work: list[tuple[list[int], int]]) -> dict:
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in work]
    prompts = [{"prompt_token_ids": p} for p, _ in work]
    llm.engine.reset_prefix_cache()
    waste_samples: list[float] = []
    steps = 0
    start = time.perf_counter()
    for prompt, p in zip(prompts, params, strict=True):
        llm.engine.add_request(f"t{steps}-{len(waste_samples)}-{id(p)}", prompt, p)
    produced = 0
    while llm.engine.has_unfinished_requests():
        outs = llm.engine.step()
        steps += 1
        stats = llm.engine.scheduler.kv_stats()
        if stats.num_allocated_slots:
            waste_samples.append(stats.waste)
        produced += sum(len(o.outputs[0].token_ids) for o in outs if o.finished)
    elapsed = time.perf_counter() - start
    expected = sum(m for _, m in work)
    assert produced == expected, f"kvpilot produced {produced} tokens, expected {expected}"
    return {
        "seconds": elapsed,
        "output_tokens": produced,
        "output_tokens_per_s": produced / elapsed,
        "steps": steps,
        "kv_waste_mean_pct": 100 * statistics.mean(waste_samples),
        "kv_waste_max_pct": 100 * max(waste_samples),
        "preemptions": llm.engine.get_stats().num_preempted_total,
    }


def load_hf(dtype: torch.dtype, model_uri: str = MODEL):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(model_uri), dtype=dtype)
    model.eval()
    return model


def bench_hf_static(model, work: list[tuple[list[int], int]], batch_size: int) -> dict:
    """Static batches of `batch_size`: left-padded prompts; every row runs until the batch's longest output.
    On the model's device (bench/gpu_engine.py runs it on a GPU)."""
    useful = 0
    start = time.perf_counter()
    for i in range(0, len(work), batch_size):
        chunk = work[i : i + batch_size]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (p, _) in enumerate(chunk):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        new = max(m for _, m in chunk)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(model.device),
                attention_mask=mask.to(model.device),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        assert out.shape[1] == width + new
        useful += sum(m for _, m in chunk)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tokens": useful, "output_tokens_per_s": useful / elapsed,
            "batch_size": batch_size}


def bench_hf_generate_batch(model, work: list[tuple[list[int], int]]) -> dict:
    """HF's own continuous batching, with each request's own output length and EOS disabled."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    # Left alone, HF sizes its cache from free memory (14 GB here: OOM-killed) and batches up to
    # 2048 query tokens against every running request's keys through one dense mask, which on the
    # CPU never finished a request. Bounded to 16 requests per step (the static batch size) and
    # 512 query tokens per step, it runs; 128 pages of 256 tokens hold 16 full-length requests.
    cb_cfg = ContinuousBatchingConfig(num_blocks=128, max_batch_tokens=512, max_requests_per_batch=16)
    cfg = GenerationConfig(max_new_tokens=max(m for _, m in work), do_sample=False, eos_token_id=-1,
                           pad_token_id=0)
    start = time.perf_counter()
    produced = 0
    with model.continuous_batching_context_manager(
        generation_config=cfg, continuous_batching_config=cb_cfg, block=True, timeout=30
    ) as manager:
        ids = [manager.add_request(p, max_new_tokens=m, eos_token_id=-1) for p, m in work]
        pending = set(ids)
        deadline = time.perf_counter() + 1800
        while pending and time.perf_counter() < deadline:
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished() and result.request_id in pending:
                pending.discard(result.request_id)
                produced += len(result.generated_tokens)
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tokens": produced, "output_tokens_per_s": produced / elapsed,
            "unfinished": len(pending)}


def bench_shared_prefix(num_requests: int, prefix_len: int, vocab: int, seed: int) -> dict:
    rng = random.Random(seed)
    prefix = [rng.randint(100, vocab - 1) for _ in range(prefix_len)]
    prompts = [prefix + [rng.randint(100, vocab - 1) for _ in range(16)] for _ in range(num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    out = {}
    for enabled in (True, False):
        llm = LLM(model=MODEL, enable_prefix_caching=enabled, num_kv_blocks=4096)
        llm.generate([{"prompt_token_ids": prefix + [5]}], SamplingParams(max_tokens=1), use_tqdm=False)  # warm
        llm.engine.reset_prefix_cache()
        start = time.perf_counter()
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        stats = llm.engine.get_stats()
        out["on" if enabled else "off"] = {
            "seconds": elapsed,
            "requests_per_s": num_requests / elapsed,
            "prefix_hit_rate": stats.prefix_cache_hits_total / max(1, stats.prefix_cache_queries_total),
            "output_tokens": sum(len(r.outputs[0].token_ids) for r in res),
        }
        del llm
        gc.collect()
    out["speedup"] = out["off"]["seconds"] / out["on"]["seconds"]
    return out


def bench_bookkeeping(num_running: int = 256, steps: int = 200) -> dict:
    """Scheduler + KV manager time per decode step with `num_running` requests, no model in the loop."""
    config = EngineConfig(max_num_seqs=num_running, max_num_batched_tokens=8192)
    sched = Scheduler(config, num_blocks=num_running * 64)
    rng = random.Random(0)
    for i in range(num_running):
        sched.add_sequence(Sequence(f"r{i}", [rng.randint(0, 49151) for _ in range(rng.randint(32, 512))],
                                    SamplingParams(max_tokens=1000)))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.sequences.values()):
        out = sched.schedule()  # prefill everyone, in chunks under the token budget
        sched.update_after_step(out)
        for e in out.scheduled:
            if e.completes_sequence:
                e.seq.append_output_token(1)
    timings = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        sched.update_after_step(out)
        timings.append(time.perf_counter() - t0)
        for e in out.scheduled:  # the "model": one new token per request, outside the timed region
            e.seq.append_output_token(rng.randint(0, 49151))
        assert len(out.scheduled) == num_running
    for s in list(sched.sequences.values()):
        sched.finish_sequence(s, SequenceStatus.FINISHED_ABORTED)
    kv = sched.kv_stats()
    assert kv.num_free_blocks == kv.num_total_blocks
    return {"num_running": num_running, "steps": steps, "mean_ms": 1000 * statistics.mean(timings),
            "p99_ms": 1000 * sorted(timings)[int(0.99 * len(timings))]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--quick", action="store_true", help="32 requests, for a smoke run")
    args = ap.parse_args()
    n = 32 if args.quick else args.num_requests
    torch.manual_seed(args.seed)

    # every system gets the same intra-op threads (the engine's rule) and runs alone, one after another
    torch.set_num_threads(cpu_threads())
    results: dict = {
        "machine": {"cpu": cpu_name(), "cpu_threads": torch.get_num_threads(), "torch": torch.__version__,
                    "python": platform.python_version(),
                    "cpu_attention": "native C decode kernel" if cpu_native.available() else "torch reference"},
        "workload": {"num_requests": n, "prompt_tokens": "32-512", "output_tokens": "16-256", "seed": args.seed},
    }
    results["bookkeeping_256_running"] = bench_bookkeeping()
    print("bookkeeping:", results["bookkeeping_256_running"], flush=True)

    llm = LLM(model=MODEL, max_num_seqs=256, max_num_batched_tokens=2048, num_kv_blocks=8192)
    vocab = llm.engine.vocab_size
    dtype = llm.engine.runner.dtype if hasattr(llm.engine.runner, "dtype") else torch.bfloat16
    results["dtype"] = str(dtype)
    work = make_workload(n, args.seed, vocab)
    llm.generate([{"prompt_token_ids": work[0][0]}], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    results["kvpilot"] = bench_kvpilot(llm, work)
    print("kvpilot:", results["kvpilot"], flush=True)
    del llm
    gc.collect()

    if not args.skip_hf:
        model = load_hf(dtype)
        results["hf_generate_static16"] = bench_hf_static(model, work, batch_size=16)
        print("hf static:", results["hf_generate_static16"], flush=True)
        try:
            results["hf_generate_batch"] = bench_hf_generate_batch(model, work)
        except Exception as exc:  # report, don't hide: the peer may not run on this CPU build
            results["hf_generate_batch"] = {"error": f"{type(exc).__name__}: {exc}"}
        print("hf generate_batch:", results["hf_generate_batch"], flush=True)
        del model
        gc.collect()
        ours = results["kvpilot"]["output_tokens_per_s"]
        results["ratios"] = {
            "vs_hf_static16": ours / results["hf_generate_static16"]["output_tokens_per_s"],
        }
        if "output_tokens_per_s" in results["hf_generate_batch"]:
            results["ratios"]["vs_hf_generate_batch"] = ours / results["hf_generate_batch"]["output_tokens_per_s"]

    results["shared_prefix"] = bench_shared_prefix(64 if not args.quick else 16, 384, vocab, args.seed)
    print("shared prefix:", results["shared_prefix"], flush=True)

    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / ("throughput_quick.json" if args.quick else "throughput.json")
    path.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
