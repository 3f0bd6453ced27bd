"""Online serving benchmark: Poisson arrivals against `kvpilot serve` (and `transformers serve` as a peer).

Each rate sends a workload drawn as bench/throughput.py draws it (prompts of 32-512 random tokens,
outputs of 16-256 tokens, EOS ignored where the server allows it), with fresh prompts per rate (seeded,
identical for both servers) so that a prefix cache cannot carry one rate into the next; streamed over
SSE with aiohttp. Measured per request: TTFT (first content), TPOT ((e2e - TTFT) / (tokens - 1)), e2e latency;
per rate: p50/p99 of each, output tokens/s and requests/s over the run's wall time.

Usage: python bench/serving.py [--rates 0.5,1,2] [--num-prompts 16] [--num-threads 1] [--quick] [--skip-peer]
       [--base-url http://127.0.0.1:8000]   # measure a daemon that is already running instead
The peer needs FastAPI and Uvicorn, which kvpilot does not depend on; to keep them out of the project's
venv: `pip install --target /tmp/peer fastapi uvicorn`, then `--peer-pythonpath /tmp/peer`. Without them
the JSON records the peer as not run, with the reason.
Writes bench/results/serving.json.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "builtin://smollm2-135m"


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


async def one_request(s: aiohttp.ClientSession, url: str, model: str | None, prompt: str, max_tokens: int,
                      extra: dict, count_chunks: bool) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    if model:
        body["model"] = model
    t0 = time.perf_counter()
    ttft = None
    tokens = 0
    chunks = 0
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
                for c in ev.get("choices") or []:
                    if c.get("text"):
                        chunks += 1
                        if ttft is None:
                            ttft = time.perf_counter() - t0
    except (TimeoutError, aiohttp.ClientError) as exc:
        return {"ok": False, "status": 0, "error": f"{type(exc).__name__}: {exc}"}
    e2e = time.perf_counter() - t0
    if not tokens and count_chunks:
        tokens = chunks
    tpot = (e2e - ttft) / (tokens - 1) if ttft is not None and tokens > 1 else None
    return {"ok": True, "ttft": ttft, "tpot": tpot, "e2e": e2e, "tokens": tokens, "end": time.perf_counter()}


async def run_rate(url: str, model: str | None, work: list[tuple[str, int]], rate: float, seed: int, extra: dict,
                   count_chunks: bool = False) -> dict:
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as s:
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

    def stats(key: str) -> dict:
        vals = [r[key] for r in ok if r.get(key) is not None]
        return {"mean": statistics.fmean(vals) if vals else None, "p50": pct(vals, 0.5), "p99": pct(vals, 0.99)}

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
        "ttft_s": stats("ttft"),
        "tpot_s": stats("tpot"),
        "e2e_s": stats("e2e"),
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


async def bench_server(name: str, url: str, model: str | None, works, rates, seed, extra, count_chunks=False) -> dict:
    """`works[0]` warms the server up; `works[i + 1]` runs at `rates[i]` (fresh prompts per rate, so that a
    prefix cache cannot serve one rate from the previous one)."""
    await run_rate(url, model, works[0], math.inf, seed, extra, count_chunks)
    runs = []
    for rate, work in zip(rates, works[1:], strict=True):
        r = await run_rate(url, model, work, rate, seed, extra, count_chunks)
        print(f"[{name}] rate={r['request_rate']}: {r['completed']}/{r['num_requests']} ok, "
              f"{r['output_tokens_per_s'] or 0:.1f} tok/s, TTFT p50 {fmt(r['ttft_s']['p50'])} "
              f"p99 {fmt(r['ttft_s']['p99'])}, TPOT p50 {fmt(r['tpot_s']['p50'])}, "
              f"e2e p50 {fmt(r['e2e_s']['p50'])} p99 {fmt(r['e2e_s']['p99'])}", flush=True)
        runs.append(r)
    return {"status": "ok", "runs": runs}


def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}ms"


def run_peer(works, rates, seed, model_dir: str, timeout: float, dtype: str, pythonpath: str | None,
             continuous_batching: bool, num_threads: int | None = None) -> dict:
    """HF transformers' own OpenAI server, if it can run here (it needs the `serving` extra and no network)."""
    if pythonpath:  # e.g. a `pip install --target DIR fastapi uvicorn` kept out of the project's venv
        sys.path.insert(0, pythonpath)
        importlib.invalidate_caches()
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    exe = shutil.which("transformers") or str(Path(sys.executable).parent / "transformers")
    if missing:
        return {"status": "not_run", "reason": f"`transformers serve` needs {' and '.join(missing)} "
                                               "(pip install 'transformers[serving]'), not installed here"}
    if not Path(exe).exists():
        return {"status": "not_run", "reason": "the `transformers` CLI is not installed"}
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # stays open for the server process to write to; closed when the server is stopped
    log = tempfile.NamedTemporaryFile(prefix="transformers-serve-", suffix=".log", delete=False)  # noqa: SIM115
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if num_threads:
        env["OMP_NUM_THREADS"] = str(num_threads)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    cmd = [exe, "serve", model_dir, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
           "--continuous-batching" if continuous_batching else "--no-continuous-batching"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        if not asyncio.run(wait_http(url, "/health", timeout, proc)):
            tail = Path(log.name).read_text(errors="replace")[-1500:]
            return {"status": "failed", "reason": f"`{' '.join(cmd)}` did not come up", "log_tail": tail}
        res = asyncio.run(bench_server("transformers serve", url, model_dir, works, rates, seed, {}, True))
        res["command"] = " ".join(cmd)
        res["note"] = "no ignore_eos: outputs may end early at EOS; throughput counts the tokens actually produced"
        if all(r["completed"] == 0 for r in res["runs"]):
            res["status"] = "failed"
            res["reason"] = "every request failed"
        return res
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="0.5,1,2", help="requests/s, comma separated ('inf' = all at once)")
    ap.add_argument("--num-prompts", type=int, default=16, help="per rate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-len", default="32,512")
    ap.add_argument("--output-len", default="16,256")
    ap.add_argument("--quick", action="store_true", help="a small smoke run: 8 short requests at two rates")
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--peer-pythonpath", default=os.environ.get("KVPILOT_BENCH_PEER_PYTHONPATH"),
                    help="extra import path holding fastapi/uvicorn for `transformers serve`")
    ap.add_argument("--peer-no-continuous-batching", action="store_true",
                    help="run `transformers serve` without --continuous-batching")
    ap.add_argument("--num-threads", type=int, default=None,
                    help="intra-op CPU threads for both servers (KVPILOT_NUM_THREADS / OMP_NUM_THREADS); "
                         "1 keeps a shared 2-core box from stalling at OpenMP barriers")
    ap.add_argument("--dtype", default="float32", help="for both servers (float32: what a CPU without bf16 runs)")
    ap.add_argument("--base-url", default=None, help="benchmark this running daemon instead of starting one")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--output", default=str(RESULTS / "serving.json"))
    return ap.parse_args()


def _run_kvpilot(args: argparse.Namespace, works: list, rates: list[float], result: dict) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test helper lives there
    from support.daemon_process import DaemonProcess

    daemon = None
    url = args.base_url
    if url is None:
        env = {"KVPILOT_NUM_THREADS": str(args.num_threads)} if args.num_threads else {}
        daemon = DaemonProcess("--max-num-seqs", str(args.max_num_seqs), "--kv-cache-memory", args.kv_cache_memory,
                               "--dtype", args.dtype, "--disable-log-requests", env=env).start(timeout=600)
        url = daemon.base_url
        result["kvpilot_args"] = daemon.serve_args
    try:
        result["kvpilot"] = asyncio.run(bench_server("kvpilot", url, None, works, rates, args.seed,
                                                     {"ignore_eos": True}))
    finally:
        if daemon is not None:
            daemon.stop()


def main() -> int:
    args = _parse_args()
    if args.quick:
        args.rates, args.num_prompts, args.prompt_len, args.output_len = "1,inf", 8, "16,64", "8,32"
    rates = [float(r) for r in args.rates.split(",")]
    prompt_range = tuple(int(x) for x in args.prompt_len.split(","))
    out_range = tuple(int(x) for x in args.output_len.split(","))

    from transformers import AutoTokenizer

    from kvpilot.daemon.engine.loader import resolve_model_path

    model_dir = str(resolve_model_path(MODEL))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    works = [make_workload(1, args.seed + 1000, tokenizer, (16, 16), (4, 4))]  # warm-up
    works += [make_workload(args.num_prompts, args.seed + i, tokenizer, prompt_range, out_range)
              for i in range(len(rates))]

    from kvpilot.version import __version__

    result: dict = {
        "benchmark": "serving",
        "kvpilot_version": __version__,
        "model": MODEL,
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_average_at_start": os.getloadavg()},
        "workload": {"num_prompts": args.num_prompts, "prompt_len": prompt_range, "output_len": out_range,
                     "seed": args.seed, "prompts_per_rate": "fresh (seed + rate index)", "rates": args.rates, "temperature": 0.0, "stream": True,
                     "dtype": args.dtype, "num_threads": args.num_threads},
    }
    _run_kvpilot(args, works, rates, result)
    if args.skip_peer:
        result["transformers_serve"] = {"status": "skipped", "reason": "--skip-peer"}
    else:
        result["transformers_serve"] = run_peer(works, rates, args.seed, model_dir, timeout=600, dtype=args.dtype,
                                                pythonpath=args.peer_pythonpath, num_threads=args.num_threads,
                                                continuous_batching=not args.peer_no_continuous_batching)
        if result["transformers_serve"]["status"] != "ok":
            print(f"[transformers serve] {result['transformers_serve']['status']}: "
                  f"{result['transformers_serve']['reason']}", flush=True)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
