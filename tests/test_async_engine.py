"""The engine thread in-process (aiohttp test server): sleeping when idle, and what a crash of the loop does.

A crash cannot be caused through the API (that is the point of the validation), so the last test arms a
fault in the real engine's step(): the one way to see /health turn 503 and in-flight requests fail cleanly.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer

from kvpilot.daemon.args import parse_serve_args
from kvpilot.daemon.async_engine import AsyncEngine
from kvpilot.daemon.server import build_app, server_state, start_engine

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


class FaultSwitch:
    """Builds the real LLMEngine; once `armed`, its next step() raises."""

    def __init__(self) -> None:
        self.armed = threading.Event()
        self.steps = 0
        self.engine = None

    def __call__(self, config):
        from kvpilot.daemon.engine import LLMEngine

        engine = LLMEngine(config)
        real_step = engine.step

        def step():
            self.steps += 1
            if self.armed.is_set():
                raise RuntimeError("injected fault in step()")
            return real_step()

        engine.step = step
        self.engine = engine
        return engine


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def app_client():
    args = parse_serve_args(["--max-num-seqs", "4", "--kv-cache-memory", "64MiB"], environ={})
    switch = FaultSwitch()
    engine = AsyncEngine(args.engine_config(), max_queued_requests=8, engine_factory=switch)
    app = build_app(args, engine)
    client = TestClient(TestServer(app))
    await client.start_server()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVPILOT_NUM_THREADS", "1")  # this process is also the client: keep one core for it
        await start_engine(app)
    try:
        yield client, app, switch
    finally:
        await client.close()
        await server_state(app).engine.shutdown()


async def test_loop_sleeps_when_idle_and_serves_after(app_client):
    client, app, switch = app_client
    r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
    assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 3
    before = switch.steps
    await asyncio.sleep(0.5)
    assert switch.steps == before, "the engine loop must not step while there is no work"
    assert server_state(app).engine.num_active == 0 and server_state(app).engine.num_queued == 0
    r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 2})
    assert r.status == 200


async def test_queued_token_limit_answers_429(app_client):
    client, app, switch = app_client
    engine = server_state(app).engine
    prompt = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen"
    engine.max_queued_tokens = 30  # about two of these prompts
    try:
        rs = await asyncio.gather(*[client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
                                    for _ in range(6)])
        codes = [r.status for r in rs]
        bodies = [await r.json() for r in rs]
    finally:
        engine.max_queued_tokens = None
    assert codes.count(200) >= 1 and codes.count(429) >= 1 and set(codes) <= {200, 429}
    for r, body in zip(rs, bodies, strict=True):
        if r.status == 429:
            assert int(r.headers["Retry-After"]) >= 1 and body["error"]["code"] == "rate_limit_exceeded"
    assert engine.num_queued == 0 and engine.num_queued_tokens == 0


async def test_engine_crash_fails_requests_and_turns_health_503(app_client):
    client, app, switch = app_client
    assert (await client.get("/health")).status == 200
    stream = await client.post("/v1/completions", json={"prompt": "Tell me a story", "max_tokens": 500,
                                                        "stream": True, "ignore_eos": True})
    assert stream.status == 200
    await stream.content.readline()  # the stream is running
    switch.armed.set()
    body = (await stream.read()).decode()
    assert '"code":"engine_dead"' in body and body.rstrip().endswith("data: [DONE]")
    deadline = time.monotonic() + 5
    while (await client.get("/health")).status != 503:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    assert (await client.get("/ready")).status == 503
    r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
    assert r.status == 503 and (await r.json())["error"]["code"] == "engine_dead"
    assert (await client.get("/metrics")).status == 200
