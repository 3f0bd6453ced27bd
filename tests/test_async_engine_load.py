"""The daemon under load: 32 concurrent streams, metrics that rise and fall, disconnects, and overload 429s."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.daemon_process import DaemonProcess

MAX_SEQS = 16
MAX_QUEUED = 40

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def daemon():
    d = DaemonProcess("--max-num-seqs", str(MAX_SEQS), "--max-queued-requests", str(MAX_QUEUED),
                      "--kv-cache-memory", "128MiB", "--served-model-name", "smollm2",
                      env={"KVPILOT_NUM_THREADS": "1"})
    with d:
        yield d


async def scrape(s: aiohttp.ClientSession, d: DaemonProcess) -> dict[str, float]:
    async with s.get(d.url("/metrics")) as r:
        text = await r.text()
    out = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name.endswith(("_bucket", "_created", "_sum")):
                continue
            out[smp.name] = out.get(smp.name, 0.0) + smp.value
    return out


async def read_sse(resp: aiohttp.ClientResponse) -> list:
    events = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line[6:]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def stream_completion(s, d, prompt: str, max_tokens: int) -> list:
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    async with s.post(d.url("/v1/completions"), json=body) as r:
        assert r.status == 200, await r.text()
        return await read_sse(r)


async def test_32_concurrent_streams_and_metrics_rise_and_fall(daemon):
    samples: list[dict[str, float]] = []
    done = asyncio.Event()

    async with aiohttp.ClientSession() as s:
        async def poll():
            while not done.is_set():
                samples.append(await scrape(s, daemon))
                await asyncio.sleep(0.05)

        poller = asyncio.create_task(poll())
        prompts = [f"Request number {i}: tell me about the number {i}." for i in range(32)]
        results = await asyncio.gather(*[stream_completion(s, daemon, p, 8) for p in prompts])
        done.set()
        await poller
        after = await scrape(s, daemon)
        # the same prompt alone: its text must match what it got in the crowd (fp32 greedy)
        alone = await stream_completion(s, daemon, prompts[5], 8)

    def text_of(events):
        return "".join(e["choices"][0]["text"] for e in events[:-1] if isinstance(e, dict) and e["choices"])

    for events in results:
        assert events[-1] == "[DONE]"
        usage = events[-2]["usage"]
        assert events[-2]["choices"] == [] and usage["completion_tokens"] == 8
        finals = [e["choices"][0]["finish_reason"] for e in events[:-2] if e["choices"][0]["finish_reason"]]
        assert finals == ["length"]
        assert text_of(events)
    assert text_of(results[5]) == text_of(alone)
    running = [m["vllm:num_requests_running"] for m in samples]
    waiting = [m["vllm:num_requests_waiting"] + m["kvpilot:num_requests_queued"] for m in samples]
    assert max(running) >= 2 and max(running) <= MAX_SEQS
    assert max(waiting) >= 1, "32 requests on 16 slots must queue"
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
    assert after["kvpilot:num_requests_queued"] == 0 and after["vllm:kv_cache_usage_perc"] == 0
    assert after["vllm:e2e_request_latency_seconds_count"] >= 32


async def test_client_disconnect_frees_kv_blocks(daemon):
    async with aiohttp.ClientSession() as s:
        before = await scrape(s, daemon)
        body = {"prompt": "Write a very long story about a dragon.", "max_tokens": 400, "stream": True,
                "ignore_eos": True}
        resp = await s.post(daemon.url("/v1/completions"), json=body, headers={"X-Request-Id": "walk-away"})
        got = 0
        async for raw in resp.content:
            if raw.startswith(b"data: "):
                got += 1
                if got == 3:
                    break
        mid = await scrape(s, daemon)
        assert mid["vllm:kv_cache_usage_perc"] > 0 and mid["vllm:num_requests_running"] == 1
        resp.close()  # the client goes away mid-stream
        deadline = time.monotonic() + 10
        while True:
            now = await scrape(s, daemon)
            if now["vllm:kv_cache_usage_perc"] == 0 and now["vllm:num_requests_running"] == 0:
                break
            assert time.monotonic() < deadline, f"KV blocks not freed: {now}"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        later = await scrape(s, daemon)
    generated = later["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert generated < 200, f"generation went on after the disconnect ({generated} tokens)"
    recs = [r for r in daemon.log_records() if r.get("request_id") == "walk-away"]
    assert len(recs) == 1 and recs[0]["outcome"] == "client_disconnected"


async def test_overload_gets_429_and_admitted_requests_complete(daemon):
    async def one(s, i):
        body = {"prompt": f"Overload {i}", "max_tokens": 2, "ignore_eos": True}
        async with s.post(daemon.url("/v1/completions"), json=body) as r:
            return r.status, r.headers.get("Retry-After"), await r.json()

    async with aiohttp.ClientSession() as s:
        results = await asyncio.gather(*[one(s, i) for i in range(90)])
        async with s.get(daemon.url("/ready")) as r:
            status = r.status
        after = await scrape(s, daemon)
    codes = [r[0] for r in results]
    assert set(codes) <= {200, 429}
    assert codes.count(429) >= 1 and codes.count(200) >= MAX_QUEUED
    for code, retry_after, body in results:
        if code == 429:
            assert int(retry_after) >= 1
            assert body["error"]["code"] == "rate_limit_exceeded" and body["error"]["type"] == "rate_limit_error"
        else:
            assert body["usage"]["completion_tokens"] == 2 and body["choices"][0]["finish_reason"] == "length"
    assert status == 200
    assert after["kvpilot:requests_rejected_total"] >= codes.count(429)
    assert after["kvpilot:num_requests_queued"] == 0
