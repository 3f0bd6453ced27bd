"""One request at a time, as a new CPU user first measures: kvpilot against llama.cpp (xllamacpp) on the
same Q4_1 GGUF (SmolLM2-135M-Instruct), a 32-token prompt and 128 greedy tokens, the same thread count.

kvpilot runs on the file's own blocks (float32 and bfloat16 activations) and, for comparison, on the
weights dequantized at load. Decode tok/s is the 127 tokens after the first over the time they took:
llama.cpp's own timings, and for kvpilot the difference between a 128-token and a 1-token request. The
peers run one after another, each in its own process, ``--repeats`` times; the best run of each counts
(the host is shared: a neighbour only ever slows a run down).

Usage: python bench/single_stream.py [--threads 2] [--repeats 3] [--peers kvpilot_q4,...,llamacpp]
Writes bench/results/single_stream.json.
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


def kvpilot_child(settings: dict[str, Any], prompt: list[int], threads: int, repeats: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    from kvpilot.daemon.engine import LLM, SamplingParams

    llm = LLM(model=MODEL, max_num_seqs=1, max_model_len=512, num_kv_blocks=64, **settings)
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


def run_kvpilot(peer: str, prompt_file: Path, threads: int, repeats: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvpilot-peer-") as tmp:
        out = Path(tmp) / "out.json"
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", peer, "--prompt-file",
                               str(prompt_file), "--child-out", str(out), "--threads", str(threads),
                               "--repeats", str(repeats)], cwd=tmp, env=_base_env(threads, keep_pythonpath=True),
                              capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-2500:]}")
        return json.loads(out.read_text())


def run_llamacpp(prompt_file: Path, threads: int, repeats: int) -> dict[str, Any]:
    from kvpilot.common.model_source import BUILTIN_MODELS, builtin_gguf

    venv = ensure_venv("xllamacpp")
    with tempfile.TemporaryDirectory() as tmp:
        gguf = builtin_gguf("smollm2-135m", Path(tmp))
        res = _run_script(venv / "bin" / "python", _LLAMACPP.replace("@OUT@", str(OUTPUT_TOKENS)),
                          [str(prompt_file), str(gguf), str(threads), str(repeats)], _base_env(threads), timeout=1800)
    res["file"] = BUILTIN_MODELS["smollm2-135m"].filename
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--child", choices=list(KVPILOT), help=argparse.SUPPRESS)
    ap.add_argument("--prompt-file", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        prompt = json.loads(Path(args.prompt_file).read_text())
        Path(args.child_out).write_text(json.dumps(kvpilot_child(KVPILOT[args.child], prompt, args.threads,
                                                                 args.repeats)))
        return
    rng = random.Random(0)
    prompt = [rng.randint(100, 49151) for _ in range(PROMPT_TOKENS)]
    result: dict[str, Any] = {"model": MODEL, "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS,
                              "threads": args.threads, "repeats": args.repeats, "host_isa": host_isa(),
                              "run_id": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), "peers": {}}
    with tempfile.TemporaryDirectory(prefix="kvpilot-work-") as tmp:
        prompt_file = Path(tmp) / "prompt.json"
        prompt_file.write_text(json.dumps(prompt))
        for peer in args.peers.split(","):
            print(f"running {peer} ...", flush=True)
            try:
                r = run_llamacpp(prompt_file, args.threads, args.repeats) if peer == "llamacpp" \
                    else run_kvpilot(peer, prompt_file, args.threads, args.repeats)
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
    (RESULTS / "single_stream.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
