"""SIGTERM drain on a real subprocess: /ready goes 503, new work gets 503, in-flight work finishes, exit 0."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import aiohttp
import pytest

from support.daemon_process import DaemonProcess

pytestmark = pytest.mark.slow


async def stream(s: aiohttp.ClientSession, url: str, max_tokens: int, started: asyncio.Event | None = None):
    body = {"prompt": "Tell me a story about a lighthouse keeper.", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    events = []
    async with s.post(url, json=body) as r:
        assert r.status == 200
        async for raw in r.content:
            line = raw.decode().strip()
            if line.startswith("data: "):
                events.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
                if started is not None:
                    started.set()
    return events


def finish_reasons(events) -> list[str]:
    return [e["choices"][0]["finish_reason"] for e in events if isinstance(e, dict) and e["choices"]
            and e["choices"][0]["finish_reason"]]


async def test_sigterm_drains_inflight_streams_aborts_at_the_timeout_and_exits_0():
    d = DaemonProcess("--max-num-seqs", "8", "--kv-cache-memory", "128MiB", "--shutdown-timeout", "12",
                      env={"KVPILOT_NUM_THREADS": "1"}).start()
    try:
        url = d.url("/v1/completions")
        async with aiohttp.ClientSession() as s:
            starts = [asyncio.Event() for _ in range(4)]
            lengths = [8, 8, 8, 1500]  # the last one cannot finish within --shutdown-timeout
            tasks = [asyncio.create_task(stream(s, url, n, ev)) for n, ev in zip(lengths, starts, strict=True)]
            await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in starts)), 120)
            t0 = time.monotonic()
            d.signal(signal.SIGTERM)
            # while draining: not ready, still alive, and new requests get 503 with an OpenAI error body
            deadline = time.monotonic() + 5
            while d.get("/ready")[0] != 503:
                assert time.monotonic() < deadline, "/ready never went 503"
                await asyncio.sleep(0.02)
            async with s.post(url, json={"prompt": "late", "max_tokens": 2}) as r:
                assert r.status == 503
                assert (await r.json())["error"]["code"] == "draining"
            assert d.get("/health")[0] == 200
            results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        code = await asyncio.to_thread(d.wait, 60)
        elapsed = time.monotonic() - t0
        assert code == 0, d.logs()[-3000:]
        for events in results[:3]:  # in flight and short: finished normally
            assert events[-1] == "[DONE]"
            assert events[-2]["usage"]["completion_tokens"] == 8
            assert finish_reasons(events) == ["length"]
        long = results[3]  # cut off at the timeout, but still a well-formed stream
        assert finish_reasons(long) == ["abort"] and long[-1] == "[DONE]"
        assert 0 < long[-2]["usage"]["completion_tokens"] < 1500
        assert 12 <= elapsed < 30, elapsed
    finally:
        d.stop()
