"""Periodic scrape of each replica's /metrics (KV usage, waiting, running, adapter slots), kept with its age.

The parsing is kvpilot.common.metrics_text's, as the operator's (operator/scrape.py): both read the daemons
the same way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import aiohttp

from kvpilot.common.metrics_text import DEFAULT_NAMES, ScrapeError, parse_metrics

from .adapters import LoraInfo, parse_lora_info
from .endpoints import Endpoint, EndpointSet

log = logging.getLogger("kvpilot.router.scrape")


@dataclass(frozen=True)
class Sample:
    kv_usage: float
    waiting: float
    running: float
    at: float  # time.monotonic() of the scrape
    lora: LoraInfo | None = None  # vllm:lora_requests_info (None: the page has none)


class LoadScraper:
    def __init__(self, endpoints: EndpointSet, session: aiohttp.ClientSession, interval: float = 1.0,
                 timeout: float = 1.0, path: str = "/metrics") -> None:
        self.endpoints = endpoints
        self.session = session
        self.interval = interval
        self.timeout = timeout
        self.path = path
        self.samples: dict[str, Sample] = {}
        self.errors: dict[str, str] = {}
        endpoints.on_removed.append(self._forget)

    def _forget(self, ep: Endpoint) -> None:
        self.samples.pop(ep.name, None)
        self.errors.pop(ep.name, None)

    def fresh(self, name: str, now: float | None = None) -> Sample | None:
        """The endpoint's sample if it is recent (three intervals); a stale number is worse than none."""
        s = self.samples.get(name)
        now = time.monotonic() if now is None else now
        return s if s is not None and now - s.at <= 3 * self.interval else None

    async def scrape_one(self, ep: Endpoint) -> None:
        try:
            async with self.session.get(ep.url + self.path,
                                        timeout=aiohttp.ClientTimeout(total=self.timeout)) as resp:
                if resp.status != 200:
                    raise ScrapeError(f"HTTP {resp.status}")
                text = await resp.text()
            ps = parse_metrics(text, DEFAULT_NAMES)
            lora = parse_lora_info(text)
        except (ScrapeError, TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            self.errors[ep.name] = f"{type(exc).__name__}: {exc}"
            self.samples.pop(ep.name, None)  # no data beats old data
            return
        self.errors.pop(ep.name, None)
        if self.endpoints.get(ep.name) == ep:  # it may have left while we waited
            self.samples[ep.name] = Sample(ps.kv_cache_usage, ps.waiting, ps.running, time.monotonic(), lora)

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self.scrape_one(ep) for ep in self.endpoints.all()))

    async def run(self) -> None:
        while True:
            started = time.monotonic()
            await self.scrape_all()
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))
