"""Router overhead: short requests at a bounded rate, straight to a tiny real aiohttp upstream vs through
`kvpilot router` in front of it, all on loopback. Upstream and router run as their own processes; the
client alternates direct and routed requests so both see the same machine noise.

    .venv/bin/python bench/router_overhead.py [--requests 600] [--rate 50] [--tokenizer builtin://smollm2-135m]
        [--system-chars 4000] [--router-flags "--tokenize-threads 0"]

`--system-chars` makes the system prompt that long (4,000 characters is about 600 tokens), so that the
router encodes it on a tokenizer thread (router/tokenize_pool.py) instead of inline; the router's own
decision-time histogram, by where it tokenized, is recorded beside the end-to-end figures, and the CPU
time is the router process's, its tokenizer threads included.
Writes bench/results/router_overhead.json. Target: p50 added latency <= 2 ms (short prompts).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

RESULTS = Path(__file__).parent / "results" / "router_overhead.json"
BODY = {"model": "m", "max_tokens": 8, "messages": [
    {"role": "system", "content": "You are a helpful assistant that answers in one short sentence."},
    {"role": "user", "content": "What is the capital of France?"}]}


def _upstream(host: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the fake upstream lives there
    from support.router_fakes import FakeReplica

    async def run() -> None:
        rep = await FakeReplica(host=host, name="up").start()
        print(json.dumps({"port": rep.port}), flush=True)
        await asyncio.Event().wait()

    asyncio.run(run())


def _spawn(args: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})
    deadline = time.monotonic() + 180
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{args} exited with {proc.wait()}")
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if "port" in msg and msg.get("msg", "listening") == "listening":
            return proc, int(msg["port"])
    proc.kill()
    raise TimeoutError(f"{args} did not start")


def request_body(system_chars: int) -> dict:
    """The short two-message chat, or one whose system prompt is `system_chars` long (words, not one run
    of a character, so that it tokenizes like text)."""
    if not system_chars:
        return BODY
    words = ["the", "shop", "answers", "questions", "about", "orders", "returns", "prices", "and", "delivery"]
    text = " ".join(words[i % len(words)] + str(i % 7) for i in range(system_chars // 6))[:system_chars]
    return {**BODY, "messages": [{"role": "system", "content": text}, BODY["messages"][1]]}


async def _one(session: aiohttp.ClientSession, url: str, body: dict) -> float:
    t0 = time.perf_counter()
    async with session.post(url, json=body) as r:
        await r.read()
        assert r.status == 200, r.status
    return time.perf_counter() - t0


async def _measure(direct: str, routed: str, n: int, rate: float, body: dict) -> tuple[list[float], list[float]]:
    d, r = [], []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=8)) as s:
        for _ in range(20):  # warm both paths: connections, tokenizer caches
            await _one(s, direct, body)
            await _one(s, routed, body)
        start = time.perf_counter()
        for i in range(n):  # open loop at `rate` pairs per second, never faster
            await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
            first, second = (direct, routed) if i % 2 else (routed, direct)
            a = await _one(s, first, body)
            b = await _one(s, second, body)
            d.append(a if first == direct else b)
            r.append(b if first == direct else a)
    return d, r


def _cpu_seconds(pid: int) -> float:
    """User+system CPU time of a process (Linux): the router's cost, whatever else shares the machine."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _decision_ms(url: str) -> dict[str, dict[str, float]]:
    """The router's kvpilot:router_decision_seconds by its `tokenize` label: count and mean ms."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            where = smp.labels.get("tokenize")
            if smp.name == "kvpilot:router_decision_seconds_sum":
                sums[where] = smp.value
            elif smp.name == "kvpilot:router_decision_seconds_count":
                counts[where] = smp.value
    return {k: {"count": c, "mean_ms": round(sums.get(k, 0.0) / c * 1e3, 3)} for k, c in counts.items() if c}


def _stats(xs: list[float]) -> dict[str, float]:
    q = statistics.quantiles(xs, n=100)
    return {"p50_ms": round(statistics.median(xs) * 1e3, 3), "p90_ms": round(q[89] * 1e3, 3),
            "p99_ms": round(q[98] * 1e3, 3), "mean_ms": round(statistics.fmean(xs) * 1e3, 3)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=600, help="request pairs (one direct, one routed)")
    p.add_argument("--rate", type=float, default=50.0, help="pairs per second")
    p.add_argument("--tokenizer", default="", help="router --tokenizer ('' = UTF-8 bytes)")
    p.add_argument("--system-chars", type=int, default=0, help="system prompt length (0: the short one)")
    p.add_argument("--router-flags", default="", help="extra router flags, e.g. '--tokenize-threads 0'")
    p.add_argument("--role", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(RESULTS))
    ns = p.parse_args()
    if ns.role == "upstream":
        _upstream("127.0.0.2")
        return 0
    up, up_port = _spawn([__file__, "--role", "upstream"])
    upstream = f"http://127.0.0.2:{up_port}"
    router, r_port = _spawn(["-m", "kvpilot.router", "--host", "127.0.0.3", "--port", "0", "--endpoints", upstream,
                             "--tokenizer", ns.tokenizer, "--log-level", "info", *ns.router_flags.split()])
    try:
        cpu0 = {"router": _cpu_seconds(router.pid), "upstream": _cpu_seconds(up.pid)}
        body = request_body(ns.system_chars)
        d, r = asyncio.run(_measure(upstream + "/v1/chat/completions",
                                    f"http://127.0.0.3:{r_port}/v1/chat/completions", ns.requests, ns.rate, body))
        decision = _decision_ms(f"http://127.0.0.3:{r_port}")
        n_router, n_up = ns.requests + 20, 2 * (ns.requests + 20)  # the routed requests also reach the upstream
        cpu = {"router_cpu_ms_per_request": round((_cpu_seconds(router.pid) - cpu0["router"]) / n_router * 1e3, 3),
               "upstream_cpu_ms_per_request": round((_cpu_seconds(up.pid) - cpu0["upstream"]) / n_up * 1e3, 3)}
    finally:
        for proc in (router, up):
            proc.terminate()
            proc.wait(10)
    added = [b - a for a, b in zip(d, r, strict=True)]
    result = {
        "what": "p50 latency added by kvpilot router over a tiny aiohttp upstream on loopback",
        "requests": ns.requests, "rate_pairs_per_s": ns.rate, "tokenizer": ns.tokenizer or "bytes",
        "request": "non-streamed chat completion, 2 short messages" if not ns.system_chars else
                   f"non-streamed chat completion, a {ns.system_chars}-character system prompt",
        "router_flags": ns.router_flags, "router_decision_ms_by_tokenize": decision,
        "direct": _stats(d), "routed": _stats(r), "added_per_pair": _stats(added),
        "added_p50_ms": round((statistics.median(r) - statistics.median(d)) * 1e3, 3),
        **cpu, "target_p50_ms": 2.0,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                    "load_average_1m": round(os.getloadavg()[0], 2)},
    }
    result["meets_target"] = result["added_p50_ms"] <= result["target_p50_ms"]
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
