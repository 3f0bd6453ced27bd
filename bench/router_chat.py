"""Issue 12's routing benchmark: a multi-tenant chat workload through the router vs plain round-robin.

Three real `kvpilot serve` daemons on 127.0.0.2-4 (one thread each, few sequences, a KV cache too small to
hold every tenant's system prompt, so that prefixes compete). The same seeded workload (N system prompts,
conversations of several turns, Poisson conversation arrivals, think time between turns) runs
1. through `python -m kvpilot.router` (prefix + load scoring on), then
2. round-robin: a trivial client-side rotation over the three daemons (strict per-request round-robin;
   the router with --no-prefix --no-load is least-in-flight, not round-robin, so it is not used here),
with the daemons restarted between the modes so both start cold. Streamed with the official openai client
(max_retries=0: the client must not hide a lost request).
Measured: the engines' prefix-cache hit rate (vllm:prefix_cache_hits_total / queries_total deltas, summed
over replicas), TTFT p50/p99, TPOT p50, output tokens/s, per-replica request counts (max / mean).
Also two failure checks (scale from zero runs first, the kill check last):
- kill: one replica is SIGKILLed mid-load behind the router; every request is classified as completed,
  clear error (an SSE error event or HTTP error), lost before streaming, or silently truncated;
- scale from zero: the router discovers replicas from EndpointSlices served by the kmock Kubernetes
  emulator (the operator path; a static --endpoints list cannot start empty); requests are sent while
  the Service has no ready endpoint, then one daemon starts and its slice is posted.
Also recorded per phase: the router's decisions by reason (hash, prefix, spill, ...) and its decision time
by where it tokenized, and each replica's load (running, waiting, KV usage) scraped every second, with
the routes and TTFT of the requests it served: where queues formed, not only how many requests went where.
Usage: python bench/router_chat.py [--preset full|small|quick] [--prompts 8 --prompt-tokens 600
       --conversations 40 --turns 4 ...] [--modes router,router_nospill,round_robin] [--router-flags
       "--load-cap 1.0"] [--skip-kill] [--skip-zero]
The default (full) workload is 8 tenants' ~600-token system prompts, 40 conversations of 4 turns, Poisson
arrivals (an estimated 15-25 minutes in all on the 2-core CI host; not yet run at this size). `--preset
small` is the earlier 15 x 3 one; `--preset quick` a smoke of the script (one router phase, no failure
checks, bench/results/router_chat_quick.json; about 2 minutes, most of it loading the daemons).
Writes bench/results/router_chat.json and prints a markdown summary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from serving import pct  # noqa: E402 - bench/serving.py, beside this script

from support.daemon_process import DaemonProcess  # noqa: E402 - the tests' helper, not part of the product

RESULTS = ROOT / "bench" / "results"
MODEL = "builtin://smollm2-135m"
HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
ONE_THREAD = {"OMP_NUM_THREADS": "1", "KVPILOT_NUM_THREADS": "1"}


# ---- helpers -------------------------------------------------------------------------------------------


def metric_sums(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sum of each named series over its labels, from Prometheus text."""
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            with contextlib.suppress(ValueError):
                out[name] += float(line.rsplit(" ", 1)[1])
    return out


def metric_by_label(text: str, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{") and f'{label}="' in line:
            value = line.split(f'{label}="', 1)[1].split('"', 1)[0]
            out[value] = out.get(value, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


CACHE_NAMES = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
               "vllm:generation_tokens_total", "vllm:num_preemptions_total")


async def scrape(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
        return await r.text()


LOAD_NAMES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


class LoadSampler:
    """Each replica's running / waiting / KV usage, scraped every `interval` s while a phase runs: where
    the queues formed, which the request counts alone do not show."""

    def __init__(self, http: aiohttp.ClientSession, urls: list[str], interval: float) -> None:
        self.http, self.urls, self.interval = http, urls, interval
        self.series: dict[str, list[list[float]]] = {u: [] for u in urls}  # [t, running, waiting, kv]
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        t0 = time.perf_counter()
        while True:
            texts = await asyncio.gather(*(scrape(self.http, u) for u in self.urls), return_exceptions=True)
            t = round(time.perf_counter() - t0, 2)
            for u, text in zip(self.urls, texts, strict=True):
                if isinstance(text, str):
                    m = metric_sums(text, LOAD_NAMES)
                    self.series[u].append([t, *(round(m[n], 3) for n in LOAD_NAMES)])
            await asyncio.sleep(self.interval)

    def start(self) -> LoadSampler:
        self._task = asyncio.create_task(self._run())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def summary(self, url: str) -> dict[str, Any]:
        rows = self.series[url]
        if not rows:
            return {"samples": 0}
        running, waiting, kv = ([r[i] for r in rows] for i in (1, 2, 3))
        return {"samples": len(rows), "running_mean": statistics.fmean(running), "running_max": max(running),
                "waiting_mean": statistics.fmean(waiting), "waiting_max": max(waiting),
                "queued_share": sum(w > 0 for w in waiting) / len(rows),
                "kv_usage_mean": statistics.fmean(kv), "kv_usage_max": max(kv)}


def start_daemons(args: argparse.Namespace, hosts: tuple[str, ...] = HOSTS) -> list[DaemonProcess]:
    serve = [MODEL, "--max-num-seqs", str(args.max_num_seqs), "--kv-cache-memory", args.kv_cache_memory,
             "--dtype", args.dtype, "--disable-log-requests"]
    daemons = [DaemonProcess(*serve, env=ONE_THREAD, host=h) for h in hosts]
    with ThreadPoolExecutor(len(daemons)) as pool:  # the three load their weights at the same time
        list(pool.map(lambda d: d.start(timeout=300), daemons))
    return daemons


def stop_all(daemons: list[DaemonProcess]) -> None:
    for d in daemons:
        with contextlib.suppress(Exception):
            d.stop(timeout=15)


class RouterProcess:
    """`python -m kvpilot.router` on loopback, port 0; the port comes from its `listening` log line."""

    def __init__(self, *flags: str, env: dict[str, str] | None = None) -> None:
        self.flags = list(flags)
        self.env = {**os.environ, **(env or {})}
        fd, name = tempfile.mkstemp(prefix="kvpilot-router-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> RouterProcess:
        cmd = [sys.executable, "-m", "kvpilot.router", "--host", "127.0.0.1", "--port", "0", *self.flags]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         stdin=subprocess.DEVNULL, cwd=ROOT)
        deadline = time.monotonic() + timeout
        while self.port is None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
            for line in self.log_path.read_text(errors="replace").splitlines():
                with contextlib.suppress(ValueError):
                    rec = json.loads(line) if line.startswith("{") else {}
                    if rec.get("msg") == "listening":
                        self.port = int(rec["port"])
            if time.monotonic() > deadline:
                raise TimeoutError(f"router did not listen in {timeout}s:\n{self.log_path.read_text()}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


# ---- workload -----------------------------------------------------------------------------------------


def make_workload(args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    """Seeded tenants and conversations: the same for every mode."""
    rng = random.Random(args.seed)
    vocab = len(tokenizer)

    def text(n_tokens: int) -> str:
        return tokenizer.decode([rng.randint(1000, vocab - 1) for _ in range(n_tokens)])

    systems = [f"You are the assistant of tenant {i}. Policy follows. " + text(args.prompt_tokens)
               for i in range(args.prompts)]
    convs = []
    t = 0.0
    for c in range(args.conversations):
        t += rng.expovariate(args.rate)  # Poisson conversation arrivals
        convs.append({"start": t, "system": c % args.prompts,
                      "users": [text(rng.randint(16, 32)) for _ in range(args.turns)],
                      "outs": [rng.randint(args.min_out, args.max_out) for _ in range(args.turns)],
                      "think": [rng.expovariate(1.0 / args.think) for _ in range(args.turns)]})
    sys_tokens = [len(tokenizer.encode(s, add_special_tokens=False)) for s in systems]
    return {"systems": systems, "convs": convs, "system_tokens": sys_tokens}


async def one_turn(client: openai.AsyncOpenAI, messages: list[dict[str, str]], max_tokens: int,
                   target: str | None) -> dict[str, Any]:
    """One streamed chat request. Classified: completed, error_before_stream, error_in_stream, truncated."""
    t0 = time.perf_counter()
    rec: dict[str, Any] = {"target": target, "ttft": None, "tokens": 0, "content_chunks": 0, "text": ""}
    try:
        raw = await client.chat.completions.with_raw_response.create(
            model="smollm2-135m", messages=messages, max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    except openai.APIError as exc:  # no response head: nothing streamed
        rec.update(outcome="error_before_stream", error=f"{type(exc).__name__}: {exc}"[:300],
                   e2e=time.perf_counter() - t0)
        return rec
    rec["target"] = raw.headers.get("x-kvpilot-endpoint", target)
    rec["route"] = raw.headers.get("x-kvpilot-route")
    finished = False
    try:
        stream = raw.parse()
        if inspect.isawaitable(stream):  # openai versions differ on whether a streamed parse() is awaited
            stream = await stream
        async for chunk in stream:
            if chunk.usage is not None:
                rec["tokens"] = chunk.usage.completion_tokens
                rec["prompt_tokens"] = chunk.usage.prompt_tokens
            for ch in chunk.choices:
                if ch.delta.content:
                    if rec["ttft"] is None:
                        rec["ttft"] = time.perf_counter() - t0
                    rec["content_chunks"] += 1
                    rec["text"] += ch.delta.content
                if ch.finish_reason is not None:
                    finished = True
    except (openai.APIError, aiohttp.ClientError, OSError) as exc:  # the router's SSE error event lands here
        rec.update(outcome="error_in_stream", error=f"{type(exc).__name__}: {exc}"[:300],
                   e2e=time.perf_counter() - t0)
        return rec
    rec["e2e"] = time.perf_counter() - t0
    rec["outcome"] = "completed" if finished else "truncated"  # truncated: ended with no finish and no error
    return rec


async def run_conversation(conv: dict[str, Any], systems: list[str], send, t_start: float,
                           stop_at: float) -> list[dict[str, Any]]:
    await asyncio.sleep(max(0.0, t_start + conv["start"] - time.perf_counter()))
    messages = [{"role": "system", "content": systems[conv["system"]]}]
    out = []
    for turn, user in enumerate(conv["users"]):
        if time.perf_counter() > stop_at:
            break
        messages.append({"role": "user", "content": user})
        rec = await send(list(messages), conv["outs"][turn])
        rec.update(turn=turn, tenant=conv["system"])
        out.append(rec)
        if rec["outcome"] != "completed":
            break  # a conversation does not go on after a failed turn
        messages.append({"role": "assistant", "content": rec["text"]})
        await asyncio.sleep(conv["think"][turn])
    return out


def summarize(recs: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    done = [r for r in recs if r["outcome"] == "completed"]
    ttft = [r["ttft"] for r in done if r["ttft"] is not None]
    tpot = [(r["e2e"] - r["ttft"]) / (r["tokens"] - 1) for r in done if r["ttft"] is not None and r["tokens"] > 1]
    tokens = sum(r["tokens"] for r in done)
    outcomes: dict[str, int] = {}
    for r in recs:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    return {"requests": len(recs), "outcomes": outcomes, "wall_s": wall,
            "ttft_s": {"p50": pct(ttft, 0.5), "p99": pct(ttft, 0.99), "mean": statistics.fmean(ttft) if ttft else None},
            "tpot_s": {"p50": pct(tpot, 0.5), "p99": pct(tpot, 0.99)},
            "e2e_s": {"p50": pct([r["e2e"] for r in done], 0.5)},
            "output_tokens": tokens, "output_tokens_per_s": tokens / wall if wall else None,
            "requests_per_s": len(done) / wall if wall else None}


async def run_workload(work: dict[str, Any], send, limit_s: float) -> tuple[list[dict[str, Any]], float]:
    t0 = time.perf_counter()
    tasks = [asyncio.create_task(run_conversation(c, work["systems"], send, t0, t0 + limit_s))
             for c in work["convs"]]
    done, pending = await asyncio.wait(tasks, timeout=limit_s + 60)  # bounded: a stuck request cannot hang us
    for t in pending:
        t.cancel()
    recs = [r for t in done if not t.cancelled() and t.exception() is None for r in t.result()]
    # a bug in this script must show as such, not as a smaller run
    recs.extend({"outcome": "bench_exception", "target": None, "error": repr(t.exception())[:300]}
                for t in done if not t.cancelled() and t.exception() is not None)
    if pending:
        recs.extend({"outcome": "unfinished_at_limit", "target": None} for _ in pending)
    return recs, time.perf_counter() - t0


def clients_for(urls: list[str]) -> list[openai.AsyncOpenAI]:
    return [openai.AsyncOpenAI(base_url=u + "/v1", api_key="none", max_retries=0, timeout=600.0) for u in urls]


def replica_summary(d: DaemonProcess, b: dict[str, float], a: dict[str, float], recs: list[dict[str, Any]],
                    load: dict[str, Any]) -> dict[str, Any]:
    """One replica's share of a phase: requests and how they were routed there, cache hits, load, TTFT."""
    name = f"{d.host}:{d.port}"
    mine = [r for r in recs if r.get("target") in (name, d.host)]
    routes: dict[str, int] = {}
    for r in mine:
        if r.get("route"):
            routes[r["route"]] = routes.get(r["route"], 0) + 1
    q = a["vllm:prefix_cache_queries_total"] - b["vllm:prefix_cache_queries_total"]
    h = a["vllm:prefix_cache_hits_total"] - b["vllm:prefix_cache_hits_total"]
    ttft = [r["ttft"] for r in mine if r.get("ttft") is not None]
    tenants = sorted({r["tenant"] for r in mine if "tenant" in r})
    return {"replica": name, "requests": len(mine), "routes": routes, "tenants": tenants,
            "prefix_queries": q, "prefix_hits": h, "hit_rate": h / q if q else None,
            "prompt_tokens": a["vllm:prompt_tokens_total"] - b["vllm:prompt_tokens_total"],
            "preemptions": a["vllm:num_preemptions_total"] - b["vllm:num_preemptions_total"],
            "ttft_s": {"p50": pct(ttft, 0.5), "p99": pct(ttft, 0.99)}, "load": load}


def router_figures(text: str) -> dict[str, Any]:
    """The router's own view of a phase: decisions by reason, and its per-request decision time by where
    the prompt was tokenized (inline on the event loop, or on a tokenizer thread)."""
    sums = metric_by_label(text, "kvpilot:router_decision_seconds_sum", "tokenize")
    counts = metric_by_label(text, "kvpilot:router_decision_seconds_count", "tokenize")
    return {"router_decisions": metric_by_label(text, "kvpilot:router_decisions_total", "reason"),
            "router_decision_ms": {k: {"count": counts[k], "mean_ms": 1e3 * sums.get(k, 0.0) / counts[k]}
                                   for k in counts if counts[k]},
            "router_retries": metric_by_label(text, "kvpilot:router_retries_total", "cause")}


# router phases: the router's flags on top of --router-flags. router_nospill is the picker before issue 38's
# queue-balancing spill (it only spilled over the load cap, or when another replica had a free slot)
ROUTER_MODES: dict[str, tuple[str, ...]] = {
    "router": (),
    "router_nospill": ("--spill-margin", "inf", "--spill-kv-margin", "inf"),
}


async def sender(name: str, args: argparse.Namespace, urls: list[str]) -> tuple[Any, RouterProcess | None]:
    """The phase's send(messages, max_tokens): through a router process, or strict round-robin."""
    if name in ROUTER_MODES:
        router = RouterProcess("--endpoints", ",".join(urls), "--tokenizer", MODEL, "--log-level", "info",
                               *args.router_flags.split(), *ROUTER_MODES[name])
        await asyncio.to_thread(router.start)
        (client,) = clients_for([router.url])

        async def via_router(messages, max_tokens):
            return await one_turn(client, messages, max_tokens, None)

        return via_router, router
    clients = clients_for(urls)
    counter = iter(range(10**9))

    async def round_robin(messages, max_tokens):
        i = next(counter) % len(clients)  # strict per-request rotation
        return await one_turn(clients[i], messages, max_tokens, HOSTS[i])

    return round_robin, None


async def mode(name: str, args: argparse.Namespace, work: dict[str, Any], http: aiohttp.ClientSession) -> dict:
    print(f"[{time.strftime('%H:%M:%S')}] {name}: starting 3 cold daemons", flush=True)
    daemons = start_daemons(args)
    router: RouterProcess | None = None
    try:
        urls = [d.base_url for d in daemons]
        before = [metric_sums(await scrape(http, u), CACHE_NAMES) for u in urls]
        send, router = await sender(name, args, urls)
        print(f"[{time.strftime('%H:%M:%S')}] {name}: workload", flush=True)
        sampler = LoadSampler(http, urls, args.sample_interval).start()
        try:
            recs, wall = await run_workload(work, send, args.mode_limit)
        finally:
            await sampler.stop()
        after = [metric_sums(await scrape(http, u), CACHE_NAMES) for u in urls]
        res = summarize(recs, wall)
        per = [replica_summary(d, b, a, recs, sampler.summary(d.base_url))
               for d, b, a in zip(daemons, before, after, strict=True)]
        q, h = sum(p["prefix_queries"] for p in per), sum(p["prefix_hits"] for p in per)
        counts = [p["requests"] for p in per]
        mean = statistics.fmean(counts) if counts else 0
        res.update(replicas=per, prefix_hit_rate=h / q if q else None,
                   load_max_over_mean=max(counts) / mean if mean else None,
                   load_series={p["replica"]: sampler.series[d.base_url] for p, d in zip(per, daemons, strict=True)})
        if router is not None:
            res.update(router_figures(await scrape(http, router.url)))
        res["requests_detail"] = [{k: r.get(k) for k in ("tenant", "turn", "target", "route", "outcome", "ttft",
                                                         "e2e", "tokens", "prompt_tokens", "error")} for r in recs]
        return res
    finally:
        if router is not None:
            router.stop()
        stop_all(daemons)


# ---- failure checks -----------------------------------------------------------------------------------


async def kill_check(args: argparse.Namespace, work: dict[str, Any]) -> dict[str, Any]:
    print(f"[{time.strftime('%H:%M:%S')}] kill: starting 3 daemons + router", flush=True)
    daemons = start_daemons(args)
    router = RouterProcess("--endpoints", ",".join(d.base_url for d in daemons), "--tokenizer", MODEL,
                           "--log-level", "info")
    try:
        router.start()
        (client,) = clients_for([router.url])

        async def send(messages, max_tokens):
            return await one_turn(client, messages, max_tokens, None)

        by_name = {f"{d.host}:{d.port}": d for d in daemons}
        killed: dict[str, Any] = {}

        async def killer(t0: float) -> None:
            # the replica with the most streams in flight (router's gauge), once it has two or more: the
            # check must cut live streams, not only refuse new connections
            await asyncio.sleep(args.kill_at)
            async with aiohttp.ClientSession() as http:
                deadline = time.perf_counter() + 30
                while True:
                    inflight = metric_by_label(await scrape(http, router.url), "kvpilot:router_endpoint_inflight",
                                               "endpoint")
                    name, n = max(inflight.items(), key=lambda kv: kv[1], default=("", 0.0))
                    if (n >= 2 and name in by_name) or time.perf_counter() > deadline:
                        break
                    await asyncio.sleep(0.25)
            name = name if name in by_name else next(iter(by_name))
            by_name[name].proc.kill()  # type: ignore[union-attr]  # SIGKILL: no drain, cut connections
            killed.update(name=name, inflight_at_kill=n, t=time.perf_counter() - t0)

        t0 = time.perf_counter()
        kt = asyncio.create_task(killer(t0))
        recs, wall = await run_workload(work, send, args.kill_limit)
        await kt
        async with aiohttp.ClientSession() as http:
            rm = await scrape(http, router.url)
        vname = killed.get("name")
        on_victim = [r for r in recs if r.get("target") == vname]
        outcomes: dict[str, int] = {}
        for r in recs:
            key = r["outcome"]
            if key == "error_in_stream":  # did the client see any content before the error?
                key += "_after_content" if r["content_chunks"] else "_before_content"
            outcomes[key] = outcomes.get(key, 0) + 1
        return {"killed": vname, "killed_at_s": killed.get("t"), "inflight_at_kill": killed.get("inflight_at_kill"),
                "wall_s": wall, "requests": len(recs),
                "outcomes": outcomes, "requests_on_victim": len(on_victim),
                "lost_before_streaming": outcomes.get("error_before_stream", 0),
                "silently_truncated": outcomes.get("truncated", 0),
                "router_retries": metric_by_label(rm, "kvpilot:router_retries_total", "cause"),
                "router_stream_errors": metric_sums(rm, ("kvpilot:router_stream_errors_total",))[
                    "kvpilot:router_stream_errors_total"],
                "errors": sorted({r["error"] for r in recs if r.get("error")})[:5]}
    finally:
        router.stop()
        stop_all(daemons)


async def scale_from_zero_check(args: argparse.Namespace, work: dict[str, Any]) -> dict[str, Any]:
    """EndpointSlices from kmock; the Service starts with no ready endpoint, then one daemon comes up."""
    import kmock
    import yaml

    print(f"[{time.strftime('%H:%M:%S')}] scale-from-zero: emulator + router with no replica", flush=True)
    emulator = kmock.KubernetesEmulator()
    emulator.resources["discovery.k8s.io/v1/endpointslices"] = dict(
        kind="EndpointSlice", singular="endpointslice", namespaced=True,
        verbs=["list", "watch", "get", "patch", "create", "delete"])
    slices = "/apis/discovery.k8s.io/v1/namespaces/bench/endpointslices"
    tmp = Path(tempfile.mkdtemp(prefix="kvpilot-bench-"))
    async with emulator, kmock.Server(emulator) as server, aiohttp.ClientSession() as http:
        api = str(server.url).rstrip("/")
        cfg = {"apiVersion": "v1", "kind": "Config", "current-context": "k",
               "clusters": [{"name": "k", "cluster": {"server": api}}], "users": [{"name": "k", "user": {"token": "t"}}],
               "contexts": [{"name": "k", "context": {"cluster": "k", "user": "k"}}]}
        (tmp / "kubeconfig").write_text(yaml.safe_dump(cfg))
        router = RouterProcess("--service", "llm", "--namespace", "bench", "--port-name", "http", "--tokenizer", MODEL,
                               "--hold-timeout", "240", "--log-level", "info",
                               env={"KUBECONFIG": str(tmp / "kubeconfig"), "KUBERNETES_SERVICE_HOST": ""})
        daemon = DaemonProcess(MODEL, "--max-num-seqs", str(args.max_num_seqs), "--kv-cache-memory",
                               args.kv_cache_memory, "--dtype", args.dtype, "--disable-log-requests",
                               env=ONE_THREAD, host="127.0.0.5")
        try:
            await asyncio.to_thread(router.start)
            (client,) = clients_for([router.url])
            conv = work["convs"]
            n = args.zero_requests
            t0 = time.perf_counter()
            reqs = [asyncio.create_task(one_turn(client, [{"role": "system", "content": work["systems"][i % len(
                work["systems"])]}, {"role": "user", "content": conv[i]["users"][0]}], 8, None)) for i in range(n)]
            await asyncio.sleep(1.0)
            async with http.get(router.url + "/metrics") as r:
                held = metric_sums(await r.text(), ("kvpilot:router_held_requests",))["kvpilot:router_held_requests"]
            await asyncio.to_thread(daemon.start, 300)  # the "pod" starts and turns ready
            ready_at = time.perf_counter() - t0
            body = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
                    "metadata": {"name": "llm-a", "namespace": "bench",
                                 "labels": {"kubernetes.io/service-name": "llm"}},
                    "ports": [{"name": "http", "port": daemon.port, "protocol": "TCP"}],
                    "endpoints": [{"addresses": [daemon.host], "conditions": {"ready": True},
                                   "targetRef": {"kind": "Pod", "name": "llm-0", "namespace": "bench"}}]}
            async with http.post(api + slices, json=body) as r:
                assert r.status < 400, await r.text()
            sliced_at = time.perf_counter() - t0
            recs = await asyncio.wait_for(asyncio.gather(*reqs), 300)
            outcomes: dict[str, int] = {}
            for r in recs:
                outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
            ttfts = sorted(r["ttft"] for r in recs if r["ttft"] is not None)
            return {"requests": n, "held_while_empty": held, "replica_ready_s": ready_at,
                    "slice_posted_s": sliced_at, "outcomes": outcomes,
                    "lost": n - outcomes.get("completed", 0),
                    "first_token_s": {"first": ttfts[0] if ttfts else None, "last": ttfts[-1] if ttfts else None},
                    "first_token_after_slice_s": (ttfts[0] - sliced_at) if ttfts else None,
                    "errors": sorted({r["error"] for r in recs if r.get("error")})[:3]}
        finally:
            router.stop()
            daemon.stop(15)


# ---- main ---------------------------------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def markdown(res: dict[str, Any]) -> str:
    r, b = res["router"], res["round_robin"]

    def f(x: float | None, nd: int = 3) -> str:
        return "-" if x is None else f"{x:.{nd}f}"

    def waits(phase: dict[str, Any]) -> str:
        return str([f((p.get("load") or {}).get("waiting_mean"), 2) for p in phase["replicas"]])

    lines = ["| | router (prefix+load) | round-robin | ratio |", "|---|---|---|---|",
             f"| prefix-cache hit rate | {f(r['prefix_hit_rate'])} | {f(b['prefix_hit_rate'])} | "
             f"{f(ratio(r['prefix_hit_rate'], b['prefix_hit_rate']), 2)}x |",
             f"| TTFT p50 s | {f(r['ttft_s']['p50'])} | {f(b['ttft_s']['p50'])} | "
             f"{f(ratio(b['ttft_s']['p50'], r['ttft_s']['p50']), 2)}x better |",
             f"| TTFT p99 s | {f(r['ttft_s']['p99'])} | {f(b['ttft_s']['p99'])} | "
             f"{f(ratio(b['ttft_s']['p99'], r['ttft_s']['p99']), 2)}x better |",
             f"| TPOT p50 s | {f(r['tpot_s']['p50'])} | {f(b['tpot_s']['p50'])} | |",
             f"| output tok/s | {f(r['output_tokens_per_s'], 2)} | {f(b['output_tokens_per_s'], 2)} | "
             f"{f(ratio(r['output_tokens_per_s'], b['output_tokens_per_s']), 2)}x |",
             f"| requests (outcomes) | {r['outcomes']} | {b['outcomes']} | |",
             f"| per-replica requests | {[p['requests'] for p in r['replicas']]} | "
             f"{[p['requests'] for p in b['replicas']]} | |",
             f"| max/mean replica load | {f(r['load_max_over_mean'], 2)} | {f(b['load_max_over_mean'], 2)} | |",
             f"| per-replica mean waiting | {waits(r)} | {waits(b)} | |",
             f"\nrouter decisions {r.get('router_decisions')}; decision time {r.get('router_decision_ms')}"]
    if "router_nospill" in res:
        n = res["router_nospill"]
        lines.append(f"router without the queue-balancing spill: TTFT p50 {f(n['ttft_s']['p50'])} s, p99 "
                     f"{f(n['ttft_s']['p99'])} s, hit rate {f(n['prefix_hit_rate'])}, per-replica requests "
                     f"{[p['requests'] for p in n['replicas']]}, mean waiting {waits(n)}, decisions "
                     f"{n.get('router_decisions')}")
    if "kill" in res:
        k = res["kill"]
        lines.append(f"\nkill one replica at {f(k.get('killed_at_s'), 1)} s: {k.get('outcomes')}; lost before "
                     f"streaming {k.get('lost_before_streaming')}, silently truncated {k.get('silently_truncated')}")
    if "scale_from_zero" in res:
        z = res["scale_from_zero"]
        lines.append(f"scale from zero: {z.get('outcomes')}, lost {z.get('lost')}; replica ready at "
                     f"{f(z.get('replica_ready_s'), 1)} s, first token at {f((z.get('first_token_s') or {}).get('first'), 1)} s")
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    def save(res: dict[str, Any]) -> None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")

    from kvpilot.router.prompt import load_tokenizer

    tok = load_tokenizer(MODEL)
    work = make_workload(args, tok)
    res: dict[str, Any] = {
        "benchmark": "router_chat", "model": MODEL,
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "load_average_at_start": list(os.getloadavg())},
        "workload": {k: getattr(args, k) for k in ("preset", "prompts", "prompt_tokens", "conversations", "turns",
                                                   "rate", "think", "min_out", "max_out", "seed", "mode_limit")},
        "system_prompt_tokens": work["system_tokens"],
        "daemon_args": {"max_num_seqs": args.max_num_seqs, "kv_cache_memory": args.kv_cache_memory,
                        "dtype": args.dtype, "threads": 1},
        "round_robin_is": "client-side strict per-request rotation over the three daemons",
        "router_flags": args.router_flags,
    }
    if not args.skip_zero:
        # first, in a fresh process state: after the kill check the in-process emulator stopped answering
        # list calls in one run (cause not found), so it runs before the load phases, bounded in time
        try:
            res["scale_from_zero"] = await asyncio.wait_for(scale_from_zero_check(args, work), 420)
        except TimeoutError:
            res["scale_from_zero"] = {"status": "timed out after 420 s"}
        save(res)
    async with aiohttp.ClientSession() as http:
        for name in args.modes.split(",") if not args.skip_modes else ():
            res[name] = await mode(name, args, work, http)
            print(f"[{time.strftime('%H:%M:%S')}] {name}: hit {res[name]['prefix_hit_rate']} "
                  f"ttft p50 {res[name]['ttft_s']['p50']} {res[name]['outcomes']}", flush=True)
            save(res)  # each stage on disk as it ends: a later failure keeps the earlier figures
    if not args.skip_kill:
        # three times the arrival rate, so that several streams are in flight when the replica dies
        kconvs = [dict(c, start=c["start"] / 3) for c in work["convs"][: args.kill_conversations]]
        res["kill"] = await kill_check(args, dict(work, convs=kconvs))
        save(res)
    if args.skip_modes or "router" not in res or "round_robin" not in res:
        return res
    r, b = res["router"], res["round_robin"]
    res["targets"] = {
        "hit_rate_ratio": ratio(r["prefix_hit_rate"], b["prefix_hit_rate"]),
        "hit_rate_ratio_ok": (ratio(r["prefix_hit_rate"], b["prefix_hit_rate"]) or 0) >= 2.0,
        "ttft_p50_speedup": ratio(b["ttft_s"]["p50"], r["ttft_s"]["p50"]),
        "ttft_p50_ok": (ratio(b["ttft_s"]["p50"], r["ttft_s"]["p50"]) or 0) >= 1.5,
        "ttft_p99_speedup": ratio(b["ttft_s"]["p99"], r["ttft_s"]["p99"]),
        "ttft_p99_ok": (ratio(b["ttft_s"]["p99"], r["ttft_s"]["p99"]) or 0) >= 1.0,  # no worse than round-robin
        "router_load_max_over_mean": r["load_max_over_mean"],
        "load_ok": (r["load_max_over_mean"] or 99) <= 1.5,
    }
    res["machine"]["load_average_at_end"] = list(os.getloadavg())
    return res


# Workload presets; explicit flags win. full: the issue's workload. small: the one measured before it
# (bench/results/router_chat.json up to the spill rule), kept for comparison. quick: a smoke of the script
# itself (three daemons still start, so it takes a minute or two, most of it loading them).
PRESETS: dict[str, dict[str, Any]] = {
    "full": {},
    "small": {"conversations": 15, "turns": 3, "mode_limit": 240.0},
    "quick": {"prompts": 2, "prompt_tokens": 100, "conversations": 3, "turns": 2, "rate": 2.0, "think": 0.2,
              "min_out": 2, "max_out": 4, "mode_limit": 20.0, "modes": "router", "skip_kill": True,
              "skip_zero": True, "out": str(RESULTS / "router_chat_quick.json")},
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = ap.add_argument
    a("--preset", choices=sorted(PRESETS), default="full", help="workload size (flags given as well win)")
    a("--prompts", type=int, default=8, help="tenants (system prompts)")
    a("--prompt-tokens", type=int, default=600, help="system prompt length (random tokens)")
    a("--conversations", type=int, default=40)
    a("--turns", type=int, default=4)
    a("--rate", type=float, default=0.25, help="conversation arrivals per second (Poisson)")
    a("--think", type=float, default=2.0, help="mean seconds between a reply and the next turn")
    a("--min-out", type=int, default=8)
    a("--max-out", type=int, default=16)
    a("--seed", type=int, default=0)
    a("--max-num-seqs", type=int, default=4)
    a("--kv-cache-memory", default="128MiB")
    a("--dtype", default="float32")
    a("--mode-limit", type=float, default=480.0, help="no new turn starts after this many seconds")
    a("--sample-interval", type=float, default=1.0, help="seconds between scrapes of the replicas' load")
    a("--kill-conversations", type=int, default=12)
    a("--kill-at", type=float, default=15.0, help="seconds into the kill run")
    a("--kill-limit", type=float, default=90.0, help="no new turn starts after this many seconds (kill run)")
    a("--zero-requests", type=int, default=4)
    a("--skip-modes", action="store_true", help="only the failure checks (debugging)")
    a("--modes", default="router,round_robin", help="which load phases to run (router, router_nospill: the "
      "router without the queue-balancing spill, round_robin)")
    a("--router-flags", default="", help="extra router flags for the router phase, e.g. '--load-cap 0.5'")
    a("--skip-kill", action="store_true")
    a("--skip-zero", action="store_true")
    a("--out", default=str(RESULTS / "router_chat.json"))
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    preset = ap.parse_known_args(argv)[0].preset
    ap.set_defaults(**PRESETS[preset])
    return ap.parse_args(argv)


def summary_only(res: dict[str, Any]) -> dict[str, Any]:
    """The result without its per-request and per-second detail (for the terminal; the JSON has it all)."""
    drop = ("requests_detail", "load_series")
    return {k: {kk: vv for kk, vv in v.items() if kk not in drop} if isinstance(v, dict) else v
            for k, v in res.items()}


def main() -> int:
    args = parse_args()
    res = asyncio.run(main_async(args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(markdown(res) if "targets" in res else json.dumps(summary_only(res), indent=1)[-3000:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
