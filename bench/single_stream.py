"""One request at a time, as a new CPU user first measures: kvpilot against llama.cpp (xllamacpp) on the
same Q4_1 GGUF (SmolLM2-135M-Instruct), a 32-token prompt and 128 greedy tokens, the same thread count.

kvpilot runs on the file's own blocks (float32 and bfloat16 activations) and, for comparison, on the
weights dequantized at load. Decode tok/s is the 127 tokens after the first over the time they took:
llama.cpp's own timings, and for kvpilot the difference between a 128-token and a 1-token request. The
peers run one after another, each in its own process, ``--repeats`` times; the best run of each counts
(the host is shared: a neighbour only ever slows a run down).

``--moe`` runs a mixture-of-experts GGUF instead: a Qwen3-MoE-shaped random model (bench/moe_model.py's shape:
hidden 1024, 12 layers, 8 experts, top-2, expert width 768; a 259-token vocabulary, the GGUF writer's), written
as llama.cpp's converter writes it (tests/support/gguf_files.py) with Q4_K_M's kinds of blocks (experts' gate and
up Q4_K, down Q6_K, the other projections Q8_0). kvpilot runs it with float32 activations (the native decode
loop and MoE kernel), with those two turned off (the per-expert Python loop), and with bfloat16 activations.

Usage: python bench/single_stream.py [--threads 2] [--repeats 3] [--peers kvpilot_q4,...,llamacpp] [--moe]
Writes bench/results/single_stream.json (``--moe``: single_stream_moe.json).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import RESULTS, _base_env, _run_script, ensure_venv, host_isa  # noqa: E402

MODEL = "builtin://smollm2-135m"
PROMPT_TOKENS, OUTPUT_TOKENS = 32, 128
# peer -> the engine settings that differ (kvpilot_*), run in the repo's environment
KVPILOT = {
    "kvpilot_q4": {"dtype": "float32"},
    "kvpilot_q4_bf16": {"dtype": "bfloat16"},
    "kvpilot_fp32": {"dtype": "float32", "quantization": "none"},
    "kvpilot_bf16": {"dtype": "bfloat16", "quantization": "none"},
}
PEERS = (*KVPILOT, "llamacpp")
KVPILOT_MOE = {
    "kvpilot_moe_q4": {"dtype": "float32"},
    "kvpilot_moe_q4_python": {"dtype": "float32", "python_layers": True},
    "kvpilot_moe_q4_bf16": {"dtype": "bfloat16"},
}
MOE_PEERS = (*KVPILOT_MOE, "llamacpp")
# the MoE GGUF's blocks by tensor: experts' gate|up Q4_K, down Q6_K, other projections Q8_0 (Q4_K_M's kinds)
_MOE_TYPES = {"experts.gate_up_proj": 12, "experts.down_proj": 14}

_LLAMACPP = r'''
import json, sys, time
import xllamacpp as xlc
prompt, gguf, threads, repeats, out = json.load(open(sys.argv[1])), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
p = xlc.CommonParams()
p.model.path = gguf
p.n_parallel = 1
p.n_ctx = 512
p.cpuparams.n_threads = threads
p.cpuparams_batch.n_threads = threads
server = xlc.Server(p)
req = {"prompt": prompt, "n_predict": @OUT@, "temperature": 0.0, "ignore_eos": True, "cache_prompt": False}
server.handle_completions({**req, "n_predict": 8})  # warm-up
runs = []
for _ in range(repeats):
    t0 = time.perf_counter()
    r = server.handle_completions(req)
    wall = time.perf_counter() - t0
    t = r["timings"]
    runs.append({"decode_tok_s": t["predicted_per_second"], "prompt_ms": t["prompt_ms"], "wall_s": wall,
                 "tokens": int(r["usage"]["completion_tokens"])})
json.dump({"runs": runs}, open(out, "w"))
'''


def build_moe_gguf(path: Path) -> None:
    """The ``--moe`` model (see the module docstring) written to ``path``."""
    import numpy as np
    import torch
    import transformers as tf

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from support.gguf_blocks import quantize
    from support.gguf_files import BPE_TOKENS, write_gguf

    cfg = tf.Qwen3MoeConfig(hidden_size=1024, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4,
                            head_dim=64, vocab_size=len(BPE_TOKENS), max_position_embeddings=2048, rms_norm_eps=1e-6,
                            tie_word_embeddings=False, bos_token_id=257, eos_token_id=259, pad_token_id=257,
                            intermediate_size=1536, moe_intermediate_size=768, num_experts=8, num_experts_per_tok=2,
                            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    torch.manual_seed(0)
    hf = tf.Qwen3MoeForCausalLM(cfg).float().eval()
    rng = np.random.default_rng(0)

    def blocks(name: str, data: np.ndarray) -> tuple[np.ndarray, int] | None:
        qtype = next((t for key, t in _MOE_TYPES.items() if name.endswith(key)), None)
        if qtype is None and (not name.endswith("_proj.weight") or data.shape[-1] % 32):
            return None
        flat = data.reshape(-1, data.shape[-1])
        return quantize(flat, qtype or 8, rng).reshape(*data.shape[:-1], -1), qtype or 8

    write_gguf(path, "qwen3moe", hf, blocks)


def kvpilot_child(settings: dict[str, Any], prompt: list[int], threads: int, repeats: int,
                  model: str = MODEL) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    from kvpilot.daemon.engine import LLM, SamplingParams

    settings = dict(settings)
    python_layers = settings.pop("python_layers", False)
    llm = LLM(model=model, max_num_seqs=1, max_model_len=512, num_kv_blocks=64, **settings)
    if python_layers:  # the layers through Python and each expert's GEMMs one call apiece, as before the kernels
        from kvpilot.kernels import gguf_moe

        llm.engine.runner.model.use_native_decode = False
        gguf_moe._native = lambda *_: None  # noqa: SLF001
    loaded = llm.engine.loaded

    def timed(tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        llm.engine.reset_prefix_cache()
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == tokens
        return time.perf_counter() - t0

    timed(OUTPUT_TOKENS)  # warm-up: first-call allocations, kernel builds
    runs = []
    for _ in range(repeats):
        first, full = timed(1), timed(OUTPUT_TOKENS)
        runs.append({"decode_tok_s": (OUTPUT_TOKENS - 1) / (full - first), "prompt_ms": 1000 * first,
                     "wall_s": full, "tokens": OUTPUT_TOKENS})
    return {"runs": runs, "quantization": loaded.quantization, "weight_bytes": loaded.weight_bytes,
            "dtype": str(loaded.dtype).removeprefix("torch.")}


def run_kvpilot(peer: str, prompt_file: Path, threads: int, repeats: int, model: str = MODEL) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvpilot-peer-") as tmp:
        out = Path(tmp) / "out.json"
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", peer, "--prompt-file",
                               str(prompt_file), "--child-out", str(out), "--threads", str(threads),
                               "--repeats", str(repeats), "--model", model], cwd=tmp,
                              env=_base_env(threads, keep_pythonpath=True), capture_output=True, text=True,
                              timeout=1800)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-2500:]}")
        return json.loads(out.read_text())


def run_llamacpp(prompt_file: Path, threads: int, repeats: int, gguf: Path | None = None) -> dict[str, Any]:
    from kvpilot.common.model_source import BUILTIN_MODELS, builtin_gguf

    venv = ensure_venv("xllamacpp")
    with tempfile.TemporaryDirectory() as tmp:
        path = gguf or builtin_gguf("smollm2-135m", Path(tmp))
        res = _run_script(venv / "bin" / "python", _LLAMACPP.replace("@OUT@", str(OUTPUT_TOKENS)),
                          [str(prompt_file), str(path), str(threads), str(repeats)], _base_env(threads), timeout=1800)
    res["file"] = path.name if gguf else BUILTIN_MODELS["smollm2-135m"].filename
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peers", default=None, help=f"default: {','.join(PEERS)} ({','.join(MOE_PEERS)} with --moe)")
    ap.add_argument("--moe", action="store_true", help="the mixture-of-experts GGUF (see above)")
    ap.add_argument("--child", choices=[*KVPILOT, *KVPILOT_MOE], help=argparse.SUPPRESS)
    ap.add_argument("--model", default=MODEL, help=argparse.SUPPRESS)
    ap.add_argument("--prompt-file", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        prompt = json.loads(Path(args.prompt_file).read_text())
        settings = {**KVPILOT, **KVPILOT_MOE}[args.child]
        Path(args.child_out).write_text(json.dumps(kvpilot_child(settings, prompt, args.threads, args.repeats,
                                                                 args.model)))
        return
    rng = random.Random(0)
    # token ids the model's vocabulary holds (the MoE GGUF's has 259)
    prompt = [rng.randint(3, 255) if args.moe else rng.randint(100, 49151) for _ in range(PROMPT_TOKENS)]
    peers = args.peers or ",".join(MOE_PEERS if args.moe else PEERS)
    result: dict[str, Any] = {"model": "qwen3-moe-shaped random GGUF (see --moe)" if args.moe else MODEL,
                              "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS,
                              "threads": args.threads, "repeats": args.repeats, "host_isa": host_isa(),
                              "run_id": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), "peers": {}}
    with tempfile.TemporaryDirectory(prefix="kvpilot-work-") as tmp:
        prompt_file = Path(tmp) / "prompt.json"
        prompt_file.write_text(json.dumps(prompt))
        gguf = None
        if args.moe:
            gguf = Path(tmp) / "qwen3-moe-q4km.gguf"
            build_moe_gguf(gguf)
            result["file_bytes"] = gguf.stat().st_size
        model = str(gguf) if gguf else MODEL
        for peer in peers.split(","):
            print(f"running {peer} ...", flush=True)
            try:
                r = run_llamacpp(prompt_file, args.threads, args.repeats, gguf) if peer == "llamacpp" \
                    else run_kvpilot(peer, prompt_file, args.threads, args.repeats, model)
                r["best_decode_tok_s"] = max(run["decode_tok_s"] for run in r["runs"])
            except Exception as e:  # recorded, never dropped
                r = {"error": f"{type(e).__name__}: {e}"}
            result["peers"][peer] = r
            print(peer, json.dumps(r)[:300], flush=True)
    base = result["peers"].get("llamacpp", {}).get("best_decode_tok_s")
    if base:
        result["vs_llamacpp"] = {p: round(r["best_decode_tok_s"] / base, 2) for p, r in result["peers"].items()
                                 if "best_decode_tok_s" in r}
        print(json.dumps(result["vs_llamacpp"]))
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "single_stream_moe.json" if args.moe else "single_stream.json"
    (RESULTS / name).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
