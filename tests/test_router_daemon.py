"""The router in front of a real `kvpilot serve` (builtin model): the router's tokens are the daemon's,
and what the router believes is cached is cached on the replica."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.router.prompt import load_tokenizer
from kvpilot.router.server import RouterSettings
from support.daemon_process import DaemonProcess
from support.router_fakes import RouterServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "builtin://smollm2-135m"
SYSTEM = ("You are the assistant of a hardware shop. Answer in one short sentence, be polite, never invent "
          "prices, and point customers to the returns desk for broken items. ")


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess("--max-num-seqs", "4", "--kv-cache-memory", "64MiB", "--disable-log-requests",
                      env={"KVPILOT_NUM_THREADS": "1"}, host="127.0.0.5")
    with d:
        yield d


@pytest.fixture
async def routed(daemon: DaemonProcess) -> AsyncIterator[RouterServer]:
    s = RouterSettings(endpoints=daemon.base_url, tokenizer=MODEL, block_size=16)
    rs = await RouterServer(s, tokenizer=load_tokenizer(MODEL)).start()
    yield rs
    await rs.stop()


async def scrape(url: str, name: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    return sum(smp.value for fam in text_string_to_metric_families(text) for smp in fam.samples
               if smp.name == name)


async def test_router_tokens_and_prefix_hits_match_the_daemon(daemon, routed):
    c = openai.AsyncOpenAI(base_url=routed.url + "/v1", api_key="x", max_retries=0, timeout=120)
    try:
        usages = []
        for question in ("Do you sell hammers?", "Can I return a broken drill?"):
            stream = await c.chat.completions.create(
                model=MODEL, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                max_tokens=4, temperature=0, stream=True, stream_options={"include_usage": True})
            chunks = [ch async for ch in stream]
            usages.append(chunks[-1].usage)
            if question.startswith("Do"):
                hits_before = await scrape(daemon.base_url, "vllm:prefix_cache_hits_total")
        # the router tokenized exactly what the daemon did (chat template included)
        assert await scrape(routed.url, "kvpilot:router_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
        # the second request shares the system prompt: the router expected hits, the daemon had at least those
        est = await scrape(routed.url, "kvpilot:router_prefix_hit_tokens_total")
        hits = await scrape(daemon.base_url, "vllm:prefix_cache_hits_total") - hits_before
        assert est >= 32  # the template header and system prompt fill two 16-token blocks
        assert hits >= est, (hits, est)
    finally:
        await c.close()
