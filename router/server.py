"""The router's aiohttp application: /v1/* proxied, /health, /ready, /metrics; discovery, load scrape and
/v1/models poll tasks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from kvpilot.listen import start_app

from .endpoints import EndpointSet, SliceWatcher, parse_static
from .kube import KubeClient, current_namespace
from .metrics import CONTENT_TYPE, RouterMetrics
from .models_poll import ModelsPoller
from .picker import Picker, PickerConfig
from .prompt import PromptHasher, Tokenizer, load_tokenizer
from .proxy import Proxy, ProxyConfig
from .state import RouterState
from .tokenize_pool import INLINE_CHARS, TokenizePool
from .upstream_metrics import LoadScraper

log = logging.getLogger("kvpilot.router")


@dataclass
class RouterSettings:
    host: str = "0.0.0.0"
    port: int = 8000
    endpoints: str | None = None  # static list; else EndpointSlices of `service`
    service: str | None = None
    namespace: str | None = None
    port_name: str | None = None
    tokenizer: str = ""  # a model URI; '' routes on UTF-8 bytes
    block_size: int = 16
    picker: PickerConfig = field(default_factory=PickerConfig)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    index_blocks: int = 200_000
    session_source: str | None = None  # "user" or "header:<Name>"
    session_capacity: int = 100_000
    scrape_interval: float = 1.0
    scrape_timeout: float = 1.0
    metrics_path: str = "/metrics"
    models_interval: float = 5.0  # seconds between polls of each replica's /v1/models (its LoRA adapters)
    tokenize_threads: int = 2  # worker threads that encode long prompts off the event loop (0: inline)
    tokenize_inline_chars: int = INLINE_CHARS  # shorter texts are encoded inline
    tokenize_max_pending: int | None = None  # long texts on the pool at most, then shed (None: per thread)


STATE_KEY = web.AppKey("router_state", RouterState)
PROXY_KEY = web.AppKey("router_proxy", Proxy)
SETTINGS_KEY = web.AppKey("router_settings", RouterSettings)
ENDPOINTS_KEY = web.AppKey("router_endpoints", EndpointSet)
METRICS_KEY = web.AppKey("router_metrics", RouterMetrics)
HASHER_KEY = web.AppKey("router_hasher", PromptHasher)


def build_app(settings: RouterSettings, tokenizer: Tokenizer | None = None) -> web.Application:
    """The application; discovery and scraping start with it (on_startup) and stop with it."""
    if not settings.endpoints and not settings.service:
        raise ValueError("give --endpoints or --service")
    endpoints = EndpointSet()
    metrics = RouterMetrics()
    hasher = PromptHasher(tokenizer if tokenizer is not None else load_tokenizer(settings.tokenizer),
                          settings.block_size)
    hasher.warm()
    app = web.Application(client_max_size=32 * 1024 * 1024)
    app[SETTINGS_KEY] = settings
    app[ENDPOINTS_KEY] = endpoints
    app[METRICS_KEY] = metrics
    app[HASHER_KEY] = hasher
    app.cleanup_ctx.append(_background)
    app.router.add_get("/health", _health)
    app.router.add_get("/ready", _ready)
    app.router.add_get("/metrics", _metrics)
    app.router.add_route("*", "/v1/{tail:.*}", _proxy)
    return app


async def _background(app: web.Application):
    """Client session, endpoint discovery, the load scrape and the models poll: alive exactly as long as the app."""
    s: RouterSettings = app[SETTINGS_KEY]
    endpoints: EndpointSet = app[ENDPOINTS_KEY]
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
    # bytes pass through as they are; the router keeps no cookies of its own
    session = aiohttp.ClientSession(connector=connector, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar())
    scraper = LoadScraper(endpoints, session, s.scrape_interval, s.scrape_timeout, s.metrics_path) \
        if s.picker.load else None
    models = ModelsPoller(endpoints, session, s.models_interval, s.scrape_timeout) if s.picker.adapter else None
    tokens = TokenizePool(app[HASHER_KEY], s.tokenize_threads, s.tokenize_inline_chars, s.tokenize_max_pending)
    state = RouterState(endpoints, Picker(s.picker), app[HASHER_KEY], app[METRICS_KEY], scraper, s.index_blocks,
                        s.session_source, s.session_capacity, tokens, models)
    app[STATE_KEY] = state
    app[PROXY_KEY] = Proxy(state, session, s.proxy)
    tasks: list[asyncio.Task] = []
    kube: KubeClient | None = None
    if s.endpoints:
        endpoints.replace(parse_static(s.endpoints))
    else:
        assert s.service
        kube = KubeClient.from_environment()
        ns = s.namespace or current_namespace()
        tasks.append(asyncio.create_task(SliceWatcher(kube, ns, s.service, endpoints, s.port_name).run()))
    if scraper is not None:
        tasks.append(asyncio.create_task(scraper.run()))
    if models is not None:
        tasks.append(asyncio.create_task(models.run()))
    try:
        yield
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await session.close()
        tokens.close()
        if kube is not None:
            await kube.close()


async def _proxy(request: web.Request) -> web.StreamResponse:
    return await request.app[PROXY_KEY].handle(request)


async def _health(request: web.Request) -> web.Response:  # noqa: ARG001 - aiohttp handler signature
    return web.json_response({"status": "ok"})


async def _ready(request: web.Request) -> web.Response:
    # Ready even with no replica: scale-from-zero needs the router to take (and hold) requests.
    return web.json_response({"status": "ready", "endpoints": len(request.app[ENDPOINTS_KEY])})


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS_KEY].render(), headers={"Content-Type": CONTENT_TYPE})


def router_state(app: web.Application) -> RouterState:
    return app[STATE_KEY]


async def serve(settings: RouterSettings) -> int:
    """Run until SIGTERM/SIGINT."""
    app = build_app(settings)
    runner, port = await start_app(app, settings.host, settings.port, shutdown_timeout=10.0)
    log.info("listening", extra={"fields": {"host": settings.host, "port": port}})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        with contextlib.suppress(Exception):
            await runner.cleanup()
        log.info("stopped")
    return 0
