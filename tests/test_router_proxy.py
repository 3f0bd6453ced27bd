"""The router over real HTTP: tiny aiohttp replicas on 127.0.0.x, the router app, the official openai client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest

from kvpilot.router.endpoints import Endpoint
from kvpilot.router.picker import PickerConfig
from kvpilot.router.prompt import ByteTokenizer
from kvpilot.router.proxy import ProxyConfig
from kvpilot.router.server import ENDPOINTS_KEY, RouterSettings, router_state
from support.router_fakes import FakeReplica, RouterServer, SlowTokenizer, router_metric

pytestmark = pytest.mark.timeout(60)

SYSTEM = {"role": "system", "content": "You are the support assistant of a large shop. Be brief. " * 3}


def chat(user: str) -> list[dict[str, str]]:
    return [SYSTEM, {"role": "user", "content": user}]


async def replicas(n: int) -> list[FakeReplica]:
    return [await FakeReplica(host=f"127.0.0.{i + 2}", name=f"r{i}").start() for i in range(n)]


async def router(reps: list[FakeReplica], **kw) -> RouterServer:
    picker = kw.pop("picker", PickerConfig())
    proxy = kw.pop("proxy", ProxyConfig(connect_timeout=1.0))
    endpoints = kw.pop("endpoints", ",".join(r.url for r in reps))
    tokenizer = kw.pop("tokenizer", None) or ByteTokenizer()
    s = RouterSettings(endpoints=endpoints, picker=picker, proxy=proxy, scrape_interval=0.1, **kw)
    return await RouterServer(s, tokenizer=tokenizer).start()


@pytest.fixture
async def three() -> AsyncIterator[list[FakeReplica]]:
    reps = await replicas(3)
    yield reps
    for r in reps:
        await r.stop()


_clients: list[openai.AsyncOpenAI] = []


@pytest.fixture(autouse=True)
async def _close_clients() -> AsyncIterator[None]:
    yield
    while _clients:
        await _clients.pop().close()


def client(rs: RouterServer) -> openai.AsyncOpenAI:
    c = openai.AsyncOpenAI(base_url=rs.url + "/v1", api_key="x", max_retries=0, timeout=20)
    _clients.append(c)
    return c



def served(reps: list[FakeReplica]) -> list[int]:
    return [len(r.requests) for r in reps]


async def test_shared_prefix_sticks_and_two_routers_agree(three):
    r1, r2 = await router(three), await router(three)
    try:
        c1, c2 = client(r1), client(r2)
        first = await c1.chat.completions.with_raw_response.create(model="m", messages=chat("hello"))
        owner = first.headers["x-kvpilot-endpoint"]
        assert first.headers["x-kvpilot-route"] == "hash"
        for i in range(4):
            c = c1 if i % 2 else c2
            raw = await c.chat.completions.with_raw_response.create(model="m", messages=chat(f"question {i}"))
            assert raw.headers["x-kvpilot-endpoint"] == owner
        assert sorted(served(three)) == [0, 0, 5]
        assert await router_metric(r1, "kvpilot:router_decisions_total", reason="prefix") == 2
        assert await router_metric(r1, "kvpilot:router_prefix_hit_tokens_total") > 0
    finally:
        await r1.stop()
        await r2.stop()


async def test_prefix_off_spreads_by_load(three):
    rs = await router(three, picker=PickerConfig(prefix=False))
    try:
        c = client(rs)

        async def one(i: int) -> None:
            async with c.chat.completions.stream(model="m", messages=chat(f"q{i}")) as s:
                await s.until_done()

        for r in three:
            r.behaviour.chunk_delay = 0.05
        await asyncio.gather(*(one(i) for i in range(6)))
        assert served(three) == [2, 2, 2]
    finally:
        await rs.stop()


async def test_stream_passes_through_unbuffered(three):
    gate = asyncio.Event()
    for r in three:
        r.behaviour.gate = gate
    rs = await router(three)
    try:
        stream = await client(rs).chat.completions.create(model="m", messages=chat("hi"), stream=True)
        it = stream.__aiter__()
        first = await asyncio.wait_for(it.__anext__(), 5)  # the replica holds chunk 2 until the gate opens
        assert first.choices[0].delta.content.endswith("-0 ")
        gate.set()
        rest = [c async for c in it]
        assert [c.choices[0].finish_reason for c in rest][-1] == "stop"
    finally:
        await rs.stop()


async def test_503_draining_is_retried_once_on_another_replica(three):
    rs = await router(three)
    try:
        c = client(rs)
        first = await c.chat.completions.with_raw_response.create(model="m", messages=chat("x"))
        owner = next(r for r in three if r.requests)
        owner.behaviour.status = 503
        raw = await c.chat.completions.with_raw_response.create(model="m", messages=chat("y"), stream=False)
        assert raw.headers["x-kvpilot-endpoint"] != first.headers["x-kvpilot-endpoint"]
        assert await router_metric(rs, "kvpilot:router_retries_total", cause="503") == 1
        for r in three:
            r.behaviour.status = 503
        with pytest.raises(openai.APIStatusError) as err:
            await c.chat.completions.create(model="m", messages=chat("z"))
        assert err.value.status_code == 503 and err.value.response.headers.get("retry-after")
        assert sum(served(three)) == 1 + 2 + 2  # ok, 503+ok, 503+503: one retry only
    finally:
        await rs.stop()


async def test_connect_error_is_retried(three):
    dead = FakeReplica(host="127.0.0.1", name="dead")  # sorts first: the least-loaded tie goes to it
    await dead.start()
    dead_url = dead.url
    await dead.stop()  # a closed port: connection refused
    rs = await router(three, endpoints=",".join([dead_url, *(r.url for r in three)]),
                      picker=PickerConfig(prefix=False))
    try:
        c = client(rs)
        for i in range(8):
            raw = await c.completions.with_raw_response.create(model="m", prompt=f"{i} distinct prompt " * 3)
            assert raw.headers["x-kvpilot-endpoint"] != dead_url.removeprefix("http://")
        # tried once, then cooled down
        assert await router_metric(rs, "kvpilot:router_retries_total", cause="connect_error") == 1
    finally:
        await rs.stop()


async def test_stream_cut_by_replica_ends_with_an_error_event(three):
    for r in three:
        r.behaviour.die_after = 1
    rs = await router(three)
    try:
        stream = await client(rs).chat.completions.create(model="m", messages=chat("hi"), stream=True)
        got = []
        with pytest.raises(openai.APIError, match="replica"):
            async for chunk in stream:
                got.append(chunk)  # noqa: PERF401 - keep what arrived before the error
        assert len(got) == 1  # the chunk the replica did send arrived; then the error, not silence
        assert await router_metric(rs, "kvpilot:router_stream_errors_total") == 1
        assert sum(served(three)) == 1  # a stream that started is never retried
    finally:
        await rs.stop()


async def test_a_replica_dying_before_the_first_token_is_retried(three):
    # The daemon sends headers and a role chunk as soon as it queues a request: dying then loses nothing.
    for r in three:
        r.behaviour.role_chunk = True
    rs = await router(three)
    try:
        first = await client(rs).chat.completions.create(model="m", messages=chat("hi"), stream=True)
        owner = [r for r in three if r.requests][0]
        _ = [c async for c in first]
        owner.behaviour.die_after = 0  # the replica that has this prefix now dies right after the role chunk
        stream = await client(rs).chat.completions.create(model="m", messages=chat("hi"), stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text and owner.name not in text  # another replica answered, in full
        assert await router_metric(rs, "kvpilot:router_retries_total", cause="connect_error") == 1
        assert await router_metric(rs, "kvpilot:router_stream_errors_total") == 0
    finally:
        await rs.stop()


async def test_429_from_every_replica_is_429_with_retry_after(three):
    for i, r in enumerate(three):
        r.behaviour.status, r.behaviour.retry_after = 429, str(3 + i)
    rs = await router(three)
    try:
        with pytest.raises(openai.RateLimitError) as err:
            await client(rs).chat.completions.create(model="m", messages=chat("hi"))
        assert err.value.response.headers["retry-after"] == "3"
        assert served(three) == [1, 1, 1]
        three[2].behaviour.status = None  # one has room: it serves
        out = await client(rs).chat.completions.create(model="m", messages=chat("hi"))
        assert out.choices[0].message.content == "hi from r2"
    finally:
        await rs.stop()


async def test_no_replica_holds_then_serves_or_times_out(three):
    rs = await router(three, proxy=ProxyConfig(hold_timeout=1.5, hold_max=2, retry_after=7))
    try:
        assert rs.app is not None
        eps = rs.app[ENDPOINTS_KEY]
        eps.replace([])
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as err:
            await client(rs).chat.completions.create(model="m", messages=chat("hi"))
        assert err.value.status_code == 503 and err.value.response.headers["retry-after"] == "7"
        assert time.monotonic() - t0 >= 1.4
        held = [asyncio.create_task(client(rs).chat.completions.create(model="m", messages=chat(f"h{i}")))
                for i in range(3)]
        for _ in range(40):  # until all three arrived: two held, the third found the queue full
            if await router_metric(rs, "kvpilot:router_held_timeouts_total", reason="full") == 1:
                break
            await asyncio.sleep(0.02)
        assert await router_metric(rs, "kvpilot:router_held_requests") == 2
        eps.replace([Endpoint(three[0].url.removeprefix("http://"), three[0].url)])
        results = await asyncio.gather(*held, return_exceptions=True)
        assert sum(not isinstance(r, Exception) for r in results) == 2
        assert await router_metric(rs, "kvpilot:router_held_requests") == 0
    finally:
        await rs.stop()


async def test_scraped_load_steers_new_prefixes_away_from_a_full_replica(three):
    three[0].behaviour.kv = 0.99
    three[1].behaviour.waiting = 30
    rs = await router(three)
    try:
        assert rs.app is not None
        scraper = router_state(rs.app).scraper
        assert scraper is not None
        for _ in range(50):
            if len(scraper.samples) == 3:
                break
            await asyncio.sleep(0.05)
        c = client(rs)
        for i in range(6):
            await c.completions.create(model="m", prompt=f"prompt number {i} " * 4)
        assert served(three)[0] == 0 and served(three)[1] == 0 and served(three)[2] == 6
    finally:
        await rs.stop()


async def test_session_mode_keys_on_user(three):
    rs = await router(three, picker=PickerConfig(prefix=False, session=True), session_source="user")
    try:
        c = client(rs)
        seen = set()
        for i in range(4):
            raw = await c.chat.completions.with_raw_response.create(
                model="m", messages=[{"role": "user", "content": f"turn {i}"}], user="alice")
            seen.add(raw.headers["x-kvpilot-endpoint"])
        assert len(seen) == 1
        assert await router_metric(rs, "kvpilot:router_decisions_total", reason="session") == 3
    finally:
        await rs.stop()


async def test_models_and_probes(three):
    rs = await router(three)
    try:
        models = await client(rs).models.list()
        assert [m.id for m in models.data] == ["m"]
        async with aiohttp.ClientSession() as s:
            for path in ("/health", "/ready"):
                async with s.get(rs.url + path) as r:
                    assert r.status == 200
        assert await router_metric(rs, "kvpilot:router_ready_endpoints") == 3
    finally:
        await rs.stop()


async def test_client_going_away_closes_the_upstream_stream(three):
    gate = asyncio.Event()  # never set: the replica would hold the stream open forever
    for r in three:
        r.behaviour.gate = gate
    rs = await router(three)
    try:
        async with aiohttp.ClientSession() as s:
            resp = await s.post(rs.url + "/v1/chat/completions",
                                json={"model": "m", "messages": chat("hi"), "stream": True})
            assert b"-0 " in await resp.content.readany()
            assert rs.app is not None
            st = router_state(rs.app)
            assert sum(st.inflight.values()) == 1
            resp.close()  # the client hangs up mid-stream
        for _ in range(100):
            if sum(st.inflight.values()) == 0:
                break
            await asyncio.sleep(0.02)
        assert sum(st.inflight.values()) == 0  # the router let go of the replica too
        for _ in range(100):
            if sum(r.cancelled for r in three):
                break
            await asyncio.sleep(0.02)
        assert sum(r.cancelled for r in three) == 1  # and the replica saw the hang-up (it frees the KV there)
    finally:
        gate.set()
        await rs.stop()


async def test_a_refusing_replica_cools_down_for_new_requests(three):
    rs = await router(three, picker=PickerConfig(prefix=False))
    try:
        three[0].behaviour.status = 503
        c = client(rs)
        for i in range(6):
            await c.completions.create(model="m", prompt=f"p{i}")
        assert len(three[0].requests) == 1  # asked once, then skipped while cooling
        assert await router_metric(rs, "kvpilot:router_retries_total", cause="503") == 1
    finally:
        await rs.stop()


async def test_gzip_bodies_are_decoded_once_and_bad_ones_are_a_400(three):
    import gzip
    import json

    rs = await router(three)
    body = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 2}).encode()
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(rs.url + "/v1/completions", data=gzip.compress(body), headers=headers) as r:
                assert r.status == 200, await r.text()
            assert sum(served(three)) == 1  # the replica got plain JSON, not a gzip label on decoded bytes
            async with s.post(rs.url + "/v1/completions", data=b"not gzip at all", headers=headers) as r:
                assert r.status == 400
                assert (await r.json())["error"]["type"] == "invalid_request_error"
    finally:
        await rs.stop()


async def _stream_arrivals(s: aiohttp.ClientSession, rs: RouterServer, out: list[float]) -> None:
    async with s.post(rs.url + "/v1/chat/completions",
                      json={"model": "m", "messages": chat("stream on"), "stream": True}) as resp:
        async for _ in resp.content.iter_any():
            out.append(time.monotonic())  # noqa: PERF401 - the caller reads `out` while this runs


@pytest.mark.parametrize("inline_chars", [1024, 10**9], ids=["offloaded", "all-inline-control"])
async def test_a_slow_tokenization_does_not_stall_other_streams(three, inline_chars):
    """One client's long prompt takes a second to tokenize; another client's stream must keep flowing
    meanwhile. The control run encodes every prompt inline and shows the stall this test detects."""
    tok = SlowTokenizer(delay=1.0, slow_chars=4000)
    for r in three:
        r.behaviour.chunks, r.behaviour.chunk_delay = 40, 0.05  # a 2 s stream, a chunk every 50 ms
    rs = await router(three, tokenizer=tok, tokenize_inline_chars=inline_chars)
    try:
        arrivals: list[float] = []
        async with aiohttp.ClientSession() as s:
            reader = asyncio.create_task(_stream_arrivals(s, rs, arrivals))
            while len(arrivals) < 3:  # the stream is flowing
                await asyncio.sleep(0.01)
            t0 = time.monotonic()
            async with s.post(rs.url + "/v1/chat/completions",
                              json={"model": "m", "messages": chat("long " * 1000)}) as r:
                assert r.status == 200
            t1 = time.monotonic()
            await reader
        assert len(tok.slow_threads) == 1 and t1 - t0 >= 1.0  # the slow tokenization did run, in that time
        during = [t for t in arrivals if t0 <= t <= t1]
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
        if inline_chars == 1024:
            assert tok.slow_threads[0].startswith("kvpilot-tokenize")
            assert len(during) >= 10 and max(gaps) < 0.5, gaps  # chunks kept coming every ~50 ms
        else:
            assert tok.slow_threads[0] == "MainThread" and max(gaps) >= 0.9  # the whole loop stood still
        assert await router_metric(rs, "kvpilot:router_decision_seconds_count",
                            tokenize="pool" if inline_chars == 1024 else "inline") >= 1
    finally:
        await rs.stop()


async def test_a_queued_replica_spills_its_tenant_to_a_second_replica(three):
    rs = await router(three)
    try:
        c = client(rs)
        first = await c.chat.completions.with_raw_response.create(model="m", messages=chat("q0"))
        home = next(r for r in three if r.requests)
        assert first.headers["x-kvpilot-route"] == "hash"
        home.behaviour.running, home.behaviour.waiting = 4, 2  # the home now has a queue; the others are idle
        assert rs.app is not None
        scraper = router_state(rs.app).scraper
        assert scraper is not None
        for _ in range(50):
            s = scraper.fresh(first.headers["x-kvpilot-endpoint"])
            if s is not None and s.waiting == 2:
                break
            await asyncio.sleep(0.05)
        routes = []
        for i in range(4):
            raw = await c.chat.completions.with_raw_response.create(model="m", messages=chat(f"q{i + 1}"))
            routes.append((raw.headers["x-kvpilot-endpoint"], raw.headers["x-kvpilot-route"]))
        second = routes[0][0]
        assert second != first.headers["x-kvpilot-endpoint"] and routes[0][1] == "spill"
        # the second replica now holds the tenant's prefix too: it is a home, no longer a spill
        assert routes[1:] == [(second, "prefix")] * 3
        assert sorted(served(three)) == [0, 1, 4]  # the third replica was never needed
        assert await router_metric(rs, "kvpilot:router_decisions_total", reason="spill") == 1
        assert router_state(rs.app).slots == 4  # learned from the queue: a replica runs 4 at once
    finally:
        await rs.stop()


async def test_a_shed_prompt_routes_on_load_and_is_counted(three):
    """With no room on the tokenizer threads (here: none at all) a long prompt is not tokenized: it is
    answered at once, routed by load, and counted."""
    tok = SlowTokenizer(delay=5.0, slow_chars=4000)  # were it encoded, the request would take 5 s
    rs = await router(three, tokenizer=tok, tokenize_max_pending=0)
    try:
        c = client(rs)
        t0 = time.monotonic()
        r = await c.chat.completions.create(model="m", messages=chat("long " * 1000))
        assert r.choices[0].message.content.startswith("hi from") and time.monotonic() - t0 < 2.0
        assert tok.slow_threads == []
        await c.chat.completions.create(model="m", messages=chat("short"))  # short prompts are encoded inline
        assert await router_metric(rs, "kvpilot:router_tokenize_shed_total") == 1
        assert await router_metric(rs, "kvpilot:router_decision_seconds_count", tokenize="shed") == 1
        assert await router_metric(rs, "kvpilot:router_decisions_total", reason="load") == 1
    finally:
        await rs.stop()
