"""Multi-LoRA serving on SmolLM2-135M: the 96-request workload of bench/peers.py spread over 4 adapters,
against the base model alone, in the same run.

Three kinds of run, each in a fresh process (one engine per process), alternating so that drift on this
shared machine hits them alike: the base with LoRA off; the base with LoRA on (max_loras 4), which shows the
cost of merely enabling it; and each request on one of 4 rank-16 adapters of all seven projections
(round-robin). Greedy, EOS ignored: every run computes the
same number of tokens. Also the memory: the adapters and their device slots, against 4 merged copies of the
model served as 4 deployments.

Usage: python bench/lora.py [--reps 2] [--rank 16] [--threads 2] [--dtype float32] [--out bench/results/lora.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from peers import make_workload, warm_up_kvpilot  # noqa: E402

MODEL = "builtin://smollm2-135m"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapters(model_dir: Path, out: Path, count: int, rank: int) -> list[Path]:
    """``count`` PEFT adapters of ``rank`` on every projection of the Llama-shaped model in ``model_dir``,
    random weights (PEFT starts B at zero, which would change nothing)."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes = {"self_attn.q_proj": (hidden, q), "self_attn.k_proj": (hidden, kv), "self_attn.v_proj": (hidden, kv),
              "self_attn.o_proj": (q, hidden), "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter),
              "mlp.down_proj": (inter, hidden)}
    folders = []
    for i in range(count):
        gen = torch.Generator().manual_seed(i)
        tensors = {}
        for layer in range(layers):
            for module, (fan_in, fan_out) in shapes.items():
                key = f"base_model.model.model.layers.{layer}.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.01
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
        folder = out / f"adapter{i}"
        folder.mkdir(parents=True)
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
             "bias": "none", "base_model_name_or_path": MODEL}))
        folders.append(folder)
    return folders


RUNS = ("base_lora_off", "base_lora_on", "four_adapters")


def child(run: str, adapters_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One timed run in a fresh process (one engine per process: kernel settings are the process's)."""
    import torch

    from kvpilot.daemon.engine import LLM, LoRARequest, SamplingParams

    torch.set_num_threads(args.threads)
    settings: dict[str, Any] = {"dtype": args.dtype, "quantization": "none", "max_num_seqs": 256,
                                "max_num_batched_tokens": 2048}
    if run != "base_lora_off":
        settings.update(enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank)
    work = make_workload("w96")
    llm = LLM(MODEL, **settings)
    warm_up_kvpilot(llm, work[0][0])
    loras: list[Any] = [None] * len(work)
    result: dict[str, Any] = {}
    if run == "four_adapters":
        adapters = [LoRARequest(f"adapter{i}", i + 1, str(adapters_dir / f"adapter{i}")) for i in range(args.adapters)]
        llm.generate([{"prompt_token_ids": work[0][0]}] * len(adapters), use_tqdm=False, lora_request=adapters)
        llm.engine.reset_prefix_cache()
        loras = [adapters[i % len(adapters)] for i in range(len(work))]
        manager = llm.engine.runner.lora
        result["adapter_host_bytes"] = sum(a.nbytes for a in manager.cpu.values())
        result["slot_bytes"] = sum(t.numel() * t.element_size() for sl in manager.layers.values()
                                   for t in (sl.a, sl.b) if t is not None)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in work]
    t0 = time.perf_counter()
    res = llm.generate([{"prompt_token_ids": p} for p, _ in work], params, use_tqdm=False, lora_request=loras)
    sec = time.perf_counter() - t0
    tok = sum(len(r.outputs[0].token_ids) for r in res)
    return {**result, "seconds": sec, "output_tokens": tok, "output_tokens_per_s": tok / sec,
            "base_weight_bytes": llm.engine.loaded.weight_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/lora.json")
    ap.add_argument("--child", choices=RUNS, help=argparse.SUPPRESS)
    ap.add_argument("--adapters-dir", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.adapters_dir, args)))
        return

    from kvpilot.common.model_source import resolve_model_path

    runs: dict[str, list[dict[str, Any]]] = {run: [] for run in RUNS}
    with tempfile.TemporaryDirectory() as tmp:
        write_adapters(resolve_model_path(MODEL), Path(tmp), args.adapters, args.rank)
        for _ in range(args.reps):  # alternating, so drift hits every kind of run alike
            for run in RUNS:
                cmd = [sys.executable, __file__, "--child", run, "--adapters-dir", tmp, "--rank", str(args.rank),
                       "--adapters", str(args.adapters), "--threads", str(args.threads), "--dtype", args.dtype]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                runs[run].append(json.loads(out.strip().splitlines()[-1]))
                print(run, f"{runs[run][-1]['output_tokens_per_s']:.1f} tok/s", flush=True)
    rate = {k: statistics.median(r["output_tokens_per_s"] for r in v) for k, v in runs.items()}
    four = runs["four_adapters"][0]
    weights, adapter_bytes, slots = four["base_weight_bytes"], four["adapter_host_bytes"], four["slot_bytes"]
    result = {
        "model": MODEL, "dtype": args.dtype, "threads": args.threads, "workload": "w96", "adapters": args.adapters,
        "rank": args.rank, "targets": list(TARGETS), "runs": runs, "median_output_tokens_per_s": rate,
        "four_adapters_vs_base": rate["four_adapters"] / rate["base_lora_off"],
        "lora_on_base_vs_lora_off": rate["base_lora_on"] / rate["base_lora_off"],
        "memory": {"base_weight_bytes": weights, "adapter_host_bytes": adapter_bytes, "slot_bytes": slots,
                   "one_deployment_with_adapters": weights + adapter_bytes + slots,
                   "merged_models_as_deployments": args.adapters * weights,
                   "saved_fraction": 1 - (weights + adapter_bytes + slots) / (args.adapters * weights)},
        "command": "python bench/lora.py " + " ".join(sys.argv[1:]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("median_output_tokens_per_s", "four_adapters_vs_base",
                                              "lora_on_base_vs_lora_off", "memory")}, indent=2))


if __name__ == "__main__":
    main()
