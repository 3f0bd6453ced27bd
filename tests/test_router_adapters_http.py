"""Adapter affinity over real HTTP: fake replicas that list LoRA adapters in /v1/models and report them in
vllm:lora_requests_info, the router app polling and scraping them, the official openai client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest

from kvpilot.router.endpoints import Endpoint, EndpointSet
from kvpilot.router.models_poll import ModelsPoller
from kvpilot.router.picker import PickerConfig
from kvpilot.router.prompt import ByteTokenizer
from kvpilot.router.proxy import ProxyConfig
from kvpilot.router.server import RouterSettings, router_state
from support.router_fakes import FakeReplica, RouterServer, router_metric, until

pytestmark = pytest.mark.timeout(60)

SYSTEM = {"role": "system", "content": "You translate questions into SQL for the shop's database. " * 3}


@pytest.fixture
async def three() -> AsyncIterator[list[FakeReplica]]:
    reps = [await FakeReplica(host=f"127.0.0.{i + 2}", name=f"r{i}").start() for i in range(3)]
    yield reps
    for r in reps:
        await r.stop()




async def test_adapter_requests_go_where_the_adapter_is_and_spill_when_it_queues(three):
    r0, r1, r2 = three
    r0.behaviour.adapters, r0.behaviour.max_lora, r0.behaviour.lora_running = ("sql",), 2, ("sql",)
    r1.behaviour.adapters, r1.behaviour.max_lora = ("sql", "chat"), 2  # r2 lists none
    s = RouterSettings(endpoints=",".join(r.url for r in three), picker=PickerConfig(),
                       proxy=ProxyConfig(connect_timeout=1.0), scrape_interval=0.1, models_interval=0.1)
    rs = await RouterServer(s, tokenizer=ByteTokenizer()).start()
    c = openai.AsyncOpenAI(base_url=rs.url + "/v1", api_key="x", max_retries=0, timeout=20)
    name = {r.name: f"{r.host}:{r.port}" for r in three}
    try:
        assert rs.app is not None
        state = router_state(rs.app)
        assert state.models is not None and state.scraper is not None
        await until(lambda: len(state.models.fresh()) == 3, "the three /v1/models lists")  # type: ignore[union-attr]
        await until(lambda: all(state.scraper.fresh(n) for n in name.values()), "scrapes")  # type: ignore[union-attr]

        async def ask(model: str, user: str) -> tuple[str, str]:
            raw = await c.chat.completions.with_raw_response.create(
                model=model, messages=[SYSTEM, {"role": "user", "content": user}])
            return raw.headers["x-kvpilot-endpoint"], raw.headers["x-kvpilot-route"]

        # chat: only r1 lists it, and it is hot nowhere (r1 loads it); never the idle replicas
        for i in range(3):
            assert (await ask("chat", f"orders of customer {i}"))[0] == name["r1"]
        # sql is hot on r0: every sql prompt goes there, whatever its hash says
        for i in range(4):
            assert (await ask("sql", f"sales in week {i}"))[0] == name["r0"]
        assert await router_metric(rs, "kvpilot:router_adapter_decisions_total", outcome="cold") == 3
        assert await router_metric(rs, "kvpilot:router_adapter_decisions_total", outcome="hit") == 4
        # r0 now queues: the next sql request spills to r1, which lists sql and has room
        r0.behaviour.running, r0.behaviour.waiting = 4, 3
        scraper = state.scraper
        await until(lambda: getattr(scraper.fresh(name["r0"]), "waiting", None) == 3, "r0's queue")
        assert await ask("sql", "sales in week 9") == (name["r1"], "spill")
        assert await router_metric(rs, "kvpilot:router_adapter_decisions_total", outcome="spill") == 1
        assert all(b.get("model") not in ("sql", "chat") for b in r2.requests)  # a 404 there, never sent
        # a name no replica lists is forwarded as any model's; the replica's own 404 reaches the client
        with pytest.raises(openai.NotFoundError) as err:
            await ask("nope", "hello")
        assert "`nope` does not exist" in str(err.value)
        assert await router_metric(rs, "kvpilot:router_adapter_decisions_total", outcome="unlisted") == 1
        # the base model routes as before, counted under no adapter outcome
        assert (await ask("m", "hello"))[1] in ("hash", "prefix", "spill")
        assert await router_metric(rs, "kvpilot:router_adapter_decisions_total") == 9
    finally:
        await c.close()
        await rs.stop()


async def test_models_poll_keeps_a_list_through_a_failed_poll_then_drops_it(three):
    r0 = three[0]
    r0.behaviour.adapters = ("sql",)
    eps = EndpointSet()
    eps.replace([Endpoint("r0", r0.url)])
    async with aiohttp.ClientSession() as session:
        poller = ModelsPoller(eps, session, interval=0.2, timeout=0.5)
        await poller.poll_due()
        assert poller.fresh()["r0"].adapters == {"sql"} and poller.fresh()["r0"].bases == {"m"}
        assert poller.due(time.monotonic()) == []  # polled just now: not due before the interval
        await r0.stop()  # the replica goes away: its last list stands for three intervals, then it is unknown
        await asyncio.sleep(0.25)
        await poller.poll_due()
        assert "r0" in poller.errors and "r0" in poller.fresh()
        await asyncio.sleep(0.4)
        assert poller.fresh() == {}
        eps.replace([])  # removed from the set: forgotten at once
        assert poller.lists == {} and poller.errors == {}
