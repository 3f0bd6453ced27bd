"""The router in front of real `kvpilot serve` daemons, one serving a LoRA adapter: the router reads the
daemons' own /v1/models and vllm:lora_requests_info, and sends the adapter only where it is served."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import openai
import pytest

from kvpilot.common.model_source import resolve_model_path
from kvpilot.router.prompt import load_tokenizer
from kvpilot.router.server import RouterSettings, router_state
from support.daemon_process import DaemonProcess
from support.lora_adapters import write_adapter
from support.lora_daemon import Skeleton
from support.router_fakes import RouterServer, router_metric, until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "builtin://smollm2-135m"
ONE_THREAD = {"KVPILOT_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess, DaemonProcess]]:
    folder = write_adapter(tmp_path_factory.mktemp("router-lora") / "sql", Skeleton.of(resolve_model_path(MODEL)),
                           rank=8, targets=("q_proj", "v_proj"))
    common = ("--max-num-seqs", "4", "--kv-cache-memory", "64MiB", "--disable-log-requests")
    with DaemonProcess(*common, "--enable-lora", "--max-loras", "1", "--max-lora-rank", "8", "--lora-modules",
                       f"sql={Path(folder)}", env=ONE_THREAD, host="127.0.0.7") as lora, \
            DaemonProcess(*common, env=ONE_THREAD, host="127.0.0.6") as plain:  # first in name order: on ties
        # (both idle) a router that ignored the lists would send the adapter there
        yield lora, plain


@pytest.fixture
async def routed(daemons) -> AsyncIterator[RouterServer]:
    s = RouterSettings(endpoints=",".join(d.base_url for d in daemons), tokenizer=MODEL, scrape_interval=0.1,
                       models_interval=0.2)
    rs = await RouterServer(s, tokenizer=load_tokenizer(MODEL)).start()
    yield rs
    await rs.stop()




async def test_adapter_requests_reach_only_the_daemon_that_serves_the_adapter(daemons, routed):
    lora, plain = daemons
    lora_name, plain_name = f"{lora.host}:{lora.port}", f"{plain.host}:{plain.port}"
    assert routed.app is not None
    state = router_state(routed.app)
    assert state.models is not None and state.scraper is not None
    models, scraper = state.models, state.scraper
    await until(lambda: len(models.fresh()) == 2, "both daemons' /v1/models", timeout=30.0)
    lists = models.fresh()
    assert lists[lora_name].adapters == {"sql"} and "smollm2-135m" in lists[lora_name].bases
    assert lists[plain_name].adapters == frozenset() and "smollm2-135m" in lists[plain_name].bases
    c = openai.AsyncOpenAI(base_url=routed.url + "/v1", api_key="x", max_retries=0, timeout=120)
    try:
        for i in range(3):
            raw = await c.completions.with_raw_response.create(model="sql", prompt=f"SELECT {i} FROM", max_tokens=2)
            assert raw.headers["x-kvpilot-endpoint"] == lora_name
        served = sum([await router_metric(routed, "kvpilot:router_adapter_decisions_total", outcome=o)
                      for o in ("hit", "cold", "spill")])
        assert served == 3 and await router_metric(routed, "kvpilot:router_adapter_decisions_total", outcome="unlisted") == 0
        # while a long request for it runs, the daemon's lora metric shows the adapter hot, as the router reads it
        running = asyncio.create_task(c.completions.create(model="sql", prompt="SELECT name FROM", max_tokens=48,
                                                           extra_body={"ignore_eos": True}))

        def hot() -> bool:
            s = scraper.fresh(lora_name)
            return s is not None and s.lora is not None and "sql" in s.lora.hot

        await until(hot, "sql in the daemon's vllm:lora_requests_info", timeout=30.0)
        assert scraper.fresh(lora_name).lora.max_lora == 1  # type: ignore[union-attr]
        await running
        # the base model is served by both: the router routes it as before, counted under no adapter outcome
        for i in range(2):
            await c.completions.create(model="smollm2-135m", prompt=f"Hello {i}", max_tokens=2)
        assert await router_metric(routed, "kvpilot:router_adapter_decisions_total") == 4
    finally:
        await c.close()
