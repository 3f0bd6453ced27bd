"""Scraping the daemons' /metrics over real HTTP on 127.0.0.x, and parsing with prometheus_client."""

from __future__ import annotations

import asyncio

import aiohttp
import aiohttp.web
import pytest

from kvpilot.common.metrics_text import DEFAULT_NAMES, ScrapeError, parse_metrics
from kvpilot.operator.autoscaler import PodSample, RouterSample
from kvpilot.operator.scrape import (
    Target,
    parse_pod_metrics,
    parse_router_metrics,
    scrape,
    scrape_routers,
    split_pods,
)
from operator_support.harness import MetricsServer
from support.web_app import serving

PAGE = """# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} 0.42
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 3
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 5
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{model_name="m"} 1000
"""


def test_parse_default_names():
    s = parse_metrics(PAGE, DEFAULT_NAMES)
    assert (s.kv_cache_usage, s.waiting, s.running) == (0.42, 3.0, 5.0)


def test_renamed_metric_is_unknown_not_zero():
    renamed = PAGE.replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    with pytest.raises(ScrapeError, match="vllm:kv_cache_usage_perc"):
        parse_metrics(renamed, DEFAULT_NAMES)
    names = {**DEFAULT_NAMES, "kvCacheUsage": "vllm:gpu_cache_usage_perc"}  # configurable per CR
    assert parse_metrics(renamed, names).kv_cache_usage == 0.42


def test_several_series_sum_waiting_and_take_the_fullest_cache():
    page = PAGE + 'vllm:num_requests_waiting{model_name="n"} 2\nvllm:kv_cache_usage_perc{model_name="n"} 0.9\n'
    s = parse_metrics(page, DEFAULT_NAMES)
    assert (s.kv_cache_usage, s.waiting) == (0.9, 5.0)


def test_the_operator_reads_a_pod_as_the_common_parser_does():
    assert parse_pod_metrics(PAGE, DEFAULT_NAMES) == PodSample(kv_cache_usage=0.42, waiting=3.0, running=5.0)


def pod(name, ip, ready=True, phase="Running", deleting=False, port=None):
    meta = {"name": name, "annotations": {"kvpilot.io/metrics-port": str(port)} if port else {}}
    if deleting:
        meta["deletionTimestamp"] = "2024-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"phase": phase, "podIP": ip,
                                         "conditions": [{"type": "Ready", "status": str(ready)}]}}


def test_split_pods_ready_targets_and_capacity_on_its_way():
    pods = [pod("a", "10.0.0.1"), pod("b", "10.0.0.2", ready=False), pod("c", None, ready=False),
            pod("d", "10.0.0.4", phase="Failed"), pod("e", "10.0.0.5", deleting=True), pod("f", "fd00::1", port=9000)]
    targets, not_ready = split_pods(pods, 8000)
    assert [t.url for t in targets] == ["http://10.0.0.1:8000/metrics", "http://[fd00::1]:9000/metrics"]
    assert not_ready == 2


async def test_scrape_concurrently_with_failures_and_timeouts():
    async def slow(request):
        await asyncio.sleep(5)
        return aiohttp.web.Response(text=PAGE)

    app = aiohttp.web.Application()
    app.router.add_get("/metrics", slow)
    async with serving(app, "127.0.0.4") as slow_port, MetricsServer("127.0.0.2") as ok, \
            MetricsServer("127.0.0.3") as broken, aiohttp.ClientSession() as session:
        ok.kv, ok.waiting = 0.5, 2
        broken.fail = True
        targets = [Target("ok", f"http://127.0.0.2:{ok.port}/metrics"),
                   Target("broken", f"http://127.0.0.3:{broken.port}/metrics"),
                   Target("slow", f"http://127.0.0.4:{slow_port}/metrics"),
                   Target("closed", "http://127.0.0.5:9/metrics")]
        loop = asyncio.get_running_loop()
        started = loop.time()
        result = await scrape(session, targets, not_ready=1, names=DEFAULT_NAMES, timeout=0.5)
        assert loop.time() - started < 2.0  # concurrent, bounded by the timeout
    o = result.observation
    assert [s.kv_cache_usage for s in o.samples] == [0.5]
    assert (o.failed, o.not_ready, o.ready) == (3, 1, 4)
    assert set(result.errors) == {"broken", "slow", "closed"}
    assert "HTTP 500" in result.errors["broken"]



def router_page(held: int = 0, inflight: dict[str, int] | None = None) -> str:
    """The router's own /metrics page (router/metrics.py), so that a rename there fails here."""
    from kvpilot.router.metrics import RouterMetrics
    m = RouterMetrics()
    m.held.set(held)
    for endpoint, n in (inflight or {}).items():
        m.set_inflight(endpoint, n)
    return m.render().decode()


def test_parse_the_routers_own_page():
    assert parse_router_metrics(router_page()) == RouterSample(held=0.0, inflight=0.0)
    assert parse_router_metrics(router_page(3, {"pod-a": 2, "pod-b": 1})) == RouterSample(held=3.0, inflight=3.0)


def test_a_router_page_without_the_held_gauge_is_an_error():
    with pytest.raises(ScrapeError, match="kvpilot:router_held_requests"):
        parse_router_metrics(PAGE)


async def test_scrape_routers_over_http():
    page = router_page(2)

    async def handler(_request):
        return aiohttp.web.Response(text=page, content_type="text/plain")

    app = aiohttp.web.Application()
    app.router.add_get("/metrics", handler)
    async with serving(app, "127.0.0.3") as port, aiohttp.ClientSession() as session:
        samples, errors = await scrape_routers(session, [
            Target("router-a", f"http://127.0.0.3:{port}/metrics"),
            Target("router-b", f"http://127.0.0.3:{port}/nothing"),
        ], timeout=2.0)
    assert samples == (RouterSample(held=2.0, inflight=0.0),)
    assert list(errors) == ["router-b"] and "404" in errors["router-b"]
