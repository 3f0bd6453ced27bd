"""A Qwen3-MoE-shaped model on the CPU: kvpilot's MoE decode step against a dense model with the same active
parameters, and kvpilot against HF transformers and vLLM's CPU build on the MoE model.

Models (random weights, float32, built with transformers' config classes and saved with save_pretrained into a
temporary folder, with SmolLM2's tokenizer: every peer is fed token ids): Qwen3-MoE with hidden 1024, 12 layers,
16 query / 4 KV heads of 64, 8 experts, top-2, moe_intermediate_size 768, vocabulary 16384 (about 290M
parameters); and a dense Qwen3 with the same attention and intermediate_size = top_k * 768 = 1536, that is the
MoE model's active parameters per token (less the router's 8K per layer).

(a) kvpilot MoE against kvpilot dense: decode step time at batch 1 and 16 (B prompts of 32 tokens; a request
    of 17 tokens less one of 1 token, over 16 steps), and throughput on the workload below. The MoE model runs
    twice: as the engine runs it, its experts packed into panels for the native MoE kernel
    (``MoEBlock.prepack_experts``), and with dense expert stacks (per-expert torch GEMMs). All three engines live
    in one process and are timed in interleaved rounds (``--rounds``; the workload in the first two); the best
    round counts (a shared host only slows runs down).
(b) kvpilot against HF transformers ``generate`` on the MoE model: the same workload, greedy, same max tokens
    (EOS ignored), both on ``--threads`` threads, HF in its own process, one batch left-padded.
(c) vLLM's CPU build (bench/peers.py's venv and offline script) on the MoE model and the same workload.

Workload: 16 requests, prompts of 32-128 random token ids, 32 output tokens each.

Step times are wall time and this process's CPU time (all its threads', spin-waits included): on a shared host
time-slicing inflates the first, not the second; with ``--threads 1`` the CPU time is the step's own cost.

``--dtype bfloat16`` runs every peer in bfloat16 (the models are saved in float32 either way).

Usage: python bench/moe_model.py [--threads 2] [--rounds 5] [--peers kvpilot,hf,vllm] [--dtype float32]
       [--extra-run]
Writes bench/results/moe_model.json, or moe_model_bf16.json (``--extra-run``: adds the run to the file's
``extra_runs``).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import _base_env, _run_script, ensure_venv, vllm_env  # noqa: E402

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 1024, 12, 16, 4, 64, 16384
EXPERTS, TOP_K, MOE_INTER = 8, 2, 768
STEP_PROMPT, STEP_TOKENS, STEP_BATCHES = 32, 17, (1, 16)
WORK_REQUESTS, WORK_OUT = 16, 32
WORK_ROUNDS = 2  # the workload in the first rounds only (the step times in all)
RESULTS = Path(__file__).resolve().parent / "results" / "moe_model.json"


def _common() -> dict[str, Any]:
    return {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "vocab_size": VOCAB, "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
            "pad_token_id": 0}


def build_models(root: Path) -> dict[str, Any]:
    import torch
    import transformers as tf

    from kvpilot.common.model_source import resolve_model_path

    builtin = resolve_model_path("builtin://smollm2-135m")
    info = {}
    for name, cfg, cls in (
        ("moe", tf.Qwen3MoeConfig(**_common(), intermediate_size=TOP_K * MOE_INTER, moe_intermediate_size=MOE_INTER,
                                  num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True,
                                  decoder_sparse_step=1, mlp_only_layers=[]), tf.Qwen3MoeForCausalLM),
        ("dense", tf.Qwen3Config(**_common(), intermediate_size=TOP_K * MOE_INTER), tf.Qwen3ForCausalLM),
    ):
        torch.manual_seed(0)
        model = cls(cfg).to(torch.float32).eval()
        total = sum(p.numel() for p in model.parameters())
        if name == "moe":
            experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
            active = total - experts + experts * TOP_K // EXPERTS
        else:
            active = total
        folder = root / name
        model.save_pretrained(folder)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (folder / f).write_bytes((builtin / f).read_bytes())
        info[name] = {"path": str(folder), "parameters": total, "active_parameters": active,
                      "architecture": cls.__name__}
        del model
    return info


def workload(seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, VOCAB) for _ in range(rng.randrange(32, 129))], WORK_OUT) for _ in range(WORK_REQUESTS)]


# ------------------------------------------------------------------------------------------------ kvpilot


def kvpilot_child(models: dict[str, Any], work: list[tuple[list[int], int]], threads: int,
                  rounds: int, dtype: str = "float32") -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    from kvpilot.daemon.engine import LLM, SamplingParams
    from kvpilot.daemon.engine.models.moe import MoEBlock

    real_prepack_experts = MoEBlock.prepack_experts
    pack_experts = True

    # the packed variant as the engine packs (float32 SiLU experts: panels), the other kept dense
    def prepack_experts(self: Any, keep_panels: bool = False, **_: Any) -> bool:
        return real_prepack_experts(self, keep_panels=keep_panels, force_float32=True) if pack_experts else False

    MoEBlock.prepack_experts = prepack_experts  # type: ignore[method-assign]

    engines: dict[str, Any] = {}
    loaded: dict[str, Any] = {}
    for variant, model, packed in (("moe_packed", "moe", True), ("moe_dense_experts", "moe", False),
                                   ("dense", "dense", True)):
        pack_experts = packed
        llm = LLM(model=models[model]["path"], dtype=dtype, max_model_len=512, num_kv_blocks=1024,
                  max_num_seqs=64, max_num_batched_tokens=2048, enable_prefix_caching=False)
        layers = llm.engine.runner.model.layers
        moes = [layer.moe for layer in layers if layer.moe is not None]
        loaded[variant] = {"experts_packed": bool(moes) and all(m.experts_packed for m in moes),
                           "expert_layout": (("panels" if moes[0].w13.panels is not None else "onednn")
                                             if moes and moes[0].experts_packed else "dense" if moes else None),
                           "weight_bytes": llm.engine.loaded.weight_bytes}
        engines[variant] = llm

    rng = random.Random(1)
    step_prompts = [[rng.randrange(3, VOCAB) for _ in range(STEP_PROMPT)] for _ in range(max(STEP_BATCHES))]

    def gen2(llm: Any, prompts: list[list[int]], tokens: list[int]) -> tuple[float, float]:
        """(wall seconds, this process's CPU seconds) of one generate call."""
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in tokens]
        t0, c0 = time.perf_counter(), time.process_time()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        sec, cpu = time.perf_counter() - t0, time.process_time() - c0
        assert [len(o.outputs[0].token_ids) for o in outs] == tokens
        return sec, cpu

    def gen(llm: Any, prompts: list[list[int]], tokens: list[int]) -> float:
        return gen2(llm, prompts, tokens)[0]

    def step_ms(llm: Any, batch: int) -> tuple[float, float]:
        """(wall, CPU) milliseconds per decode step: the CPU time is what time-slicing on a shared host
        cannot inflate (all threads' time, spin-waits included)."""
        prompts = step_prompts[:batch]
        (w1, c1), (w0, c0) = gen2(llm, prompts, [STEP_TOKENS] * batch), gen2(llm, prompts, [1] * batch)
        return 1e3 * (w1 - w0) / (STEP_TOKENS - 1), 1e3 * (c1 - c0) / (STEP_TOKENS - 1)

    prompts, tokens = [p for p, _ in work], [m for _, m in work]
    for llm in engines.values():  # warm-up: first-call allocations, oneDNN's kernel choices
        step_ms(llm, max(STEP_BATCHES))
        gen(llm, prompts[:8], [8] * 8)
    steps: dict[str, dict[int, list[float]]] = {v: {b: [] for b in STEP_BATCHES} for v in engines}
    steps_cpu: dict[str, dict[int, list[float]]] = {v: {b: [] for b in STEP_BATCHES} for v in engines}
    work_s: dict[str, list[float]] = {v: [] for v in engines}
    for r in range(rounds):  # interleaved: drift on a shared host hits every variant alike
        for variant, llm in engines.items():
            for b in STEP_BATCHES:
                wall, cpu = step_ms(llm, b)
                steps[variant][b].append(wall)
                steps_cpu[variant][b].append(cpu)
            if r < WORK_ROUNDS:
                work_s[variant].append(gen(llm, prompts, tokens))
    first = engines["moe_packed"].generate([{"prompt_token_ids": p} for p in prompts[:4]],
                                           SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                                           use_tqdm=False)
    out_tokens = sum(tokens)
    return {
        "variants": {v: {**loaded[v],
                         "step_ms": {str(b): min(steps[v][b]) for b in STEP_BATCHES},
                         "step_ms_rounds": {str(b): steps[v][b] for b in STEP_BATCHES},
                         "step_cpu_ms": {str(b): min(steps_cpu[v][b]) for b in STEP_BATCHES},
                         "step_cpu_ms_rounds": {str(b): steps_cpu[v][b] for b in STEP_BATCHES},
                         "workload_s": min(work_s[v]), "workload_s_rounds": work_s[v],
                         "output_tokens_per_s": out_tokens / min(work_s[v])} for v in engines},
        "first_tokens": [list(o.outputs[0].token_ids) for o in first],
    }


# ------------------------------------------------------------------------------------------------ HF

def hf_child(models: dict[str, Any], work: list[tuple[list[int], int]], threads: int,
             dtype: str = "float32") -> dict[str, Any]:
    import torch
    import transformers as tf

    torch.set_num_threads(threads)
    model = tf.AutoModelForCausalLM.from_pretrained(models["moe"]["path"], dtype=getattr(torch, dtype)).eval()
    longest = max(len(p) for p, _ in work)
    ids = torch.zeros(len(work), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, _) in enumerate(work):  # left padding: every row's last prompt token at the end
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    new = work[0][1]
    assert all(m == new for _, m in work)

    def run(rows: int, tokens: int) -> tuple[float, torch.Tensor]:
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids[:rows], attention_mask=mask[:rows], max_new_tokens=tokens,
                                 min_new_tokens=tokens, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t0, out

    run(2, 2)  # warm-up
    sec, out = run(len(work), new)
    generated = out[:, longest:]
    assert generated.shape == (len(work), new)
    return {"seconds": sec, "output_tokens": int(generated.numel()), "output_tokens_per_s": generated.numel() / sec,
            "first_tokens": generated[:4, :8].tolist(), "transformers": tf.__version__, "batch": len(work)}


# ------------------------------------------------------------------------------------------------ vLLM

_VLLM = r'''
import json, sys, time
work, model_dir, threads, dtype = json.load(open(sys.argv[1])), sys.argv[2], int(sys.argv[3]), sys.argv[4]
out = sys.argv[5]
t0 = time.perf_counter()
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=model_dir, dtype=dtype, max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=512,
          enable_prefix_caching=False, seed=0)
start_s = time.perf_counter() - t0
prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in work]
params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in work]
llm.generate(prompts[:8], [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)] * 8, use_tqdm=False)
runs = []
for _ in range(2):
    t0 = time.perf_counter()
    res = llm.generate(prompts, params, use_tqdm=False)
    runs.append(time.perf_counter() - t0)
tok = sum(len(r.outputs[0].token_ids) for r in res)
sec = min(runs)
import vllm
json.dump({"seconds": sec, "seconds_runs": runs, "output_tokens": tok, "output_tokens_per_s": tok / sec,
           "start_s": start_s, "first_tokens": [list(r.outputs[0].token_ids[:8]) for r in res[:4]],
           "vllm": vllm.__version__}, open(out, "w"))
'''


def run_vllm(models: dict[str, Any], work_file: Path, threads: int, timeout: int,
             dtype: str = "float32") -> dict[str, Any]:
    venv = ensure_venv("vllm")
    env = vllm_env(venv, threads)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return _run_script(venv / "bin" / "python", _VLLM, [str(work_file), models["moe"]["path"], str(threads), dtype],
                       env, timeout=timeout)


# ------------------------------------------------------------------------------------------------ driver

def _child(kind: str, models: dict[str, Any], work_file: Path, threads: int, rounds: int, timeout: int,
           dtype: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvpilot-moe-") as tmp:
        out = Path(tmp) / "out.json"
        models_file = Path(tmp) / "models.json"
        models_file.write_text(json.dumps(models))
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", kind, "--models",
                               str(models_file), "--work", str(work_file), "--child-out", str(out), "--threads",
                               str(threads), "--rounds", str(rounds), "--dtype", dtype], cwd=tmp,
                              env=_base_env(threads, keep_pythonpath=True), capture_output=True, text=True,
                              timeout=timeout)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-2500:]}")
        return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--peers", default="kvpilot,hf,vllm")
    ap.add_argument("--vllm-timeout", type=int, default=1200)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the peers' dtype (bfloat16 writes moe_model_bf16.json)")
    ap.add_argument("--extra-run", action="store_true",
                    help="keep the results file's main run and add this one under 'extra_runs'")
    ap.add_argument("--child")
    ap.add_argument("--models")
    ap.add_argument("--work")
    ap.add_argument("--child-out")
    args = ap.parse_args()
    if args.child:
        models = json.loads(Path(args.models).read_text())
        work = [tuple(w) for w in json.loads(Path(args.work).read_text())]
        res = kvpilot_child(models, work, args.threads, args.rounds, args.dtype) if args.child == "kvpilot" \
            else hf_child(models, work, args.threads, args.dtype)
        Path(args.child_out).write_text(json.dumps(res))
        return
    peers = args.peers.split(",")
    work = workload()
    out: dict[str, Any] = {
        "command": f"python bench/moe_model.py --threads {args.threads} --rounds {args.rounds} --peers {args.peers}"
                   + (f" --dtype {args.dtype}" if args.dtype != "float32" else "")
                   + (" --extra-run" if args.extra_run else ""),
        "run": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), "threads": args.threads,
        "machine": platform.processor() or platform.machine(),
        "shape": {"hidden": HIDDEN, "layers": LAYERS, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                  "vocab": VOCAB, "experts": EXPERTS, "top_k": TOP_K, "moe_intermediate": MOE_INTER,
                  "dense_intermediate": TOP_K * MOE_INTER, "dtype": args.dtype},
        "step": {"prompt_tokens": STEP_PROMPT, "tokens": STEP_TOKENS, "batches": list(STEP_BATCHES)},
        "workload": {"requests": WORK_REQUESTS, "prompt_tokens": [len(p) for p, _ in work][:WORK_REQUESTS],
                     "output_tokens_each": WORK_OUT},
    }
    with tempfile.TemporaryDirectory(prefix="kvpilot-moe-models-") as tmp:
        t0 = time.perf_counter()
        models = build_models(Path(tmp))
        print(f"models built in {time.perf_counter() - t0:.0f}s: "
              + ", ".join(f"{k} {v['parameters'] / 1e6:.0f}M ({v['active_parameters'] / 1e6:.0f}M active)"
                          for k, v in models.items()), flush=True)
        out["models"] = {k: {kk: vv for kk, vv in v.items() if kk != "path"} for k, v in models.items()}
        work_file = Path(tmp) / "work.json"
        work_file.write_text(json.dumps(work))
        for peer in peers:
            t0 = time.perf_counter()
            try:
                if peer == "kvpilot":
                    res = _child("kvpilot", models, work_file, args.threads, args.rounds, 3600, args.dtype)
                elif peer == "hf":
                    res = _child("hf", models, work_file, args.threads, args.rounds, 3600, args.dtype)
                elif peer == "vllm":
                    res = run_vllm(models, work_file, args.threads, args.vllm_timeout, args.dtype)
                else:
                    raise ValueError(peer)
            except (RuntimeError, subprocess.SubprocessError, OSError) as e:
                res = {"error": str(e)[-3000:]}
            res["wall_s"] = time.perf_counter() - t0
            out[peer] = res
            print(f"{peer}: {json.dumps(res)[:1500]}", flush=True)
    kv = out.get("kvpilot", {}).get("variants")
    ratios: dict[str, Any] = {}
    if kv:
        for b in STEP_BATCHES:
            ratios[f"moe_step_over_dense_b{b}"] = kv["moe_packed"]["step_ms"][str(b)] / kv["dense"]["step_ms"][str(b)]
            ratios[f"moe_dense_experts_step_over_dense_b{b}"] = \
                kv["moe_dense_experts"]["step_ms"][str(b)] / kv["dense"]["step_ms"][str(b)]
            ratios[f"packing_speedup_step_b{b}"] = \
                kv["moe_dense_experts"]["step_ms"][str(b)] / kv["moe_packed"]["step_ms"][str(b)]
            ratios[f"moe_step_cpu_over_dense_b{b}"] = \
                kv["moe_packed"]["step_cpu_ms"][str(b)] / kv["dense"]["step_cpu_ms"][str(b)]
            ratios[f"packing_speedup_step_cpu_b{b}"] = \
                kv["moe_dense_experts"]["step_cpu_ms"][str(b)] / kv["moe_packed"]["step_cpu_ms"][str(b)]
        ratios["moe_workload_tok_s_over_dense"] = \
            kv["moe_packed"]["output_tokens_per_s"] / kv["dense"]["output_tokens_per_s"]
        moe_tps = kv["moe_packed"]["output_tokens_per_s"]
        for peer in ("hf", "vllm"):
            tps = out.get(peer, {}).get("output_tokens_per_s")
            if tps:
                ratios[f"kvpilot_over_{peer}_tok_s"] = moe_tps / tps
    out["ratios"] = ratios
    out["targets"] = {"moe_step_over_dense": "<= 1.5", "kvpilot_over_hf_tok_s": ">= 4", "kvpilot_over_vllm_tok_s": ">= 1"}
    print(json.dumps(ratios, indent=1))
    results = RESULTS if args.dtype == "float32" else RESULTS.with_name("moe_model_bf16.json")
    if args.extra_run and results.exists():
        main_run = json.loads(results.read_text())
        main_run.setdefault("extra_runs", []).append(out)
        out = main_run
    results.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {results}")


if __name__ == "__main__":
    main()
