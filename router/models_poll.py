"""Periodic GET of each replica's /v1/models: which LoRA adapters it lists (router/adapters.py reads them).

A list changes only when an adapter is loaded or unloaded, so it is polled less often than the load, but
a replica with no list yet (new, or its last poll failed) is polled on the next tick.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp

from .adapters import ReplicaModels, parse_models
from .endpoints import Endpoint, EndpointSet

log = logging.getLogger("kvpilot.router.models")

TICK = 1.0  # seconds between looks for replicas whose list is due


class ModelsPoller:
    def __init__(self, endpoints: EndpointSet, session: aiohttp.ClientSession, interval: float = 5.0,
                 timeout: float = 2.0, path: str = "/v1/models") -> None:
        if interval <= 0:
            raise ValueError(f"interval must be > 0, got {interval}")
        self.endpoints = endpoints
        self.session = session
        self.interval = interval
        self.timeout = timeout
        self.path = path
        self.lists: dict[str, tuple[ReplicaModels, float]] = {}  # endpoint -> its list, monotonic time read
        self.errors: dict[str, str] = {}
        # every request reads the fresh lists, which change only with a poll or an expiry: built once
        self._fresh: tuple[dict[str, ReplicaModels], frozenset[str], float] | None = None
        endpoints.on_removed.append(self._forget)

    def _forget(self, ep: Endpoint) -> None:
        self.lists.pop(ep.name, None)
        self.errors.pop(ep.name, None)
        self._fresh = None

    def fresh(self, now: float | None = None) -> dict[str, ReplicaModels]:
        """The lists read in the last three intervals. An older one is dropped: an adapter it names may
        have been unloaded since, and a request sent there would get a 404."""
        return self._current(now)[0]

    def adapters(self, now: float | None = None) -> frozenset[str]:
        """Every adapter some fresh list names."""
        return self._current(now)[1]

    def _current(self, now: float | None) -> tuple[dict[str, ReplicaModels], frozenset[str], float]:
        now = time.monotonic() if now is None else now
        if self._fresh is None or now > self._fresh[2]:
            limit = 3 * self.interval
            kept = {n: (m, at) for n, (m, at) in self.lists.items() if now - at <= limit}
            until = min((at + limit for _, at in kept.values()), default=float("inf"))
            names = frozenset().union(*(m.adapters for m, _ in kept.values()))
            self._fresh = ({n: m for n, (m, _) in kept.items()}, names, until)
        return self._fresh

    async def poll_one(self, ep: Endpoint) -> None:
        try:
            async with self.session.get(ep.url + self.path,
                                        timeout=aiohttp.ClientTimeout(total=self.timeout)) as resp:
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}")
                models = parse_models(json.loads(await resp.read()))
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            err = f"{type(exc).__name__}: {exc}"
            if self.errors.get(ep.name) != err:  # once per new error, not every tick
                log.warning("models poll failed", extra={"fields": {"endpoint": ep.name, "error": err}})
            self.errors[ep.name] = err
            return  # the last list stands until it is too old (fresh)
        self.errors.pop(ep.name, None)
        if self.endpoints.get(ep.name) == ep:  # it may have left while we waited
            self.lists[ep.name] = (models, time.monotonic())
            self._fresh = None

    def due(self, now: float) -> list[Endpoint]:
        """Replicas whose list is missing or an interval old."""
        return [ep for ep in self.endpoints.all()
                if ep.name not in self.lists or now - self.lists[ep.name][1] >= self.interval]

    async def poll_due(self) -> None:
        await asyncio.gather(*(self.poll_one(ep) for ep in self.due(time.monotonic())))

    async def run(self) -> None:
        while True:
            started = time.monotonic()
            await self.poll_due()
            await asyncio.sleep(max(0.0, min(TICK, self.interval) - (time.monotonic() - started)))
