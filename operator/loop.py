"""The one autoscaling loop over kopf's in-memory index of InferenceDeployments.

kopf's per-object daemons and timers make kopf put a finalizer on every object, so deleting one would wait
for the operator. An index needs none. Each InferenceDeployment is ticked every metricsIntervalSeconds; a
per-object lock, shared with reconcile, keeps the operator the single writer of replicas.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvpilot.operator import kube, metrics
from kvpilot.operator.autoscaler import Autoscaler
from kvpilot.operator.tick import Cr, act, decide, observe, record

Key = tuple[str, str]
# Scaled to zero, a held request waits for the next tick: tick at least this often (only the routers answer).
ZERO_INTERVAL = 1.0
TICK_ERRORS = (TimeoutError, kube.KubeApiError, aiohttp.ClientError)


def index_entry(body: Mapping[str, Any]) -> dict[str, Any]:
    """What the index keeps of an object: a copy, since kopf reuses the body it passes."""
    return {"metadata": copy.deepcopy(dict(body.get("metadata") or {})),
            "spec": copy.deepcopy(dict(body.get("spec") or {}))}


def snapshot(index: Mapping[Key, Iterable[dict[str, Any]]]) -> dict[Key, Cr]:
    """The index's objects now, defaulted. kopf's index maps each key to a store of values (one here)."""
    out = {}
    for key in list(index):
        for body in index.get(key, ()):
            out[key] = Cr.from_body(body)
    return out


@dataclass
class Ticking:
    scaler: Autoscaler | None = None
    due: float = 0.0  # monotonic time of the next tick


@dataclass
class AutoscalingLoop:
    client: kube.KubeClient
    http: aiohttp.ClientSession
    index: Mapping[Key, Iterable[dict[str, Any]]]
    locks: dict[Key, asyncio.Lock]
    scrape_timeout: float
    period: float
    logger: logging.Logger
    paused: Callable[[], Awaitable[bool]] | None = None  # kopf's peering: another operator is active
    states: dict[Key, Ticking] = field(default_factory=dict)

    async def run(self) -> None:
        while True:
            try:
                await self.round(time.monotonic())
            except TICK_ERRORS as e:
                self.logger.warning("autoscaling round failed, retrying: %s", e)
            await asyncio.sleep(self.period)

    async def round(self, now: float) -> None:
        if self.paused is not None and await self.paused():
            self.states.clear()  # the active peer scales; a later resume starts with fresh history
            return
        crs = snapshot(self.index)
        for key in self.states.keys() - crs.keys():  # deleted: forget its history and its gauges
            del self.states[key]
            metrics.forget(*key)
        due = [cr for key, cr in crs.items() if self.states.setdefault(key, Ticking()).due <= now]
        await asyncio.gather(*(self.tick(cr, now) for cr in due))

    async def tick(self, cr: Cr, now: float) -> None:
        state = self.states[cr.key]
        state.due = now + cr.interval
        try:
            async with self.locks.setdefault(cr.key, asyncio.Lock()):
                observed = await observe(self.client, self.http, cr, self.scrape_timeout)
                if observed is None:
                    return  # invalid spec or no Deployment yet: reconcile's business
                plan, state.scaler = decide(observed, state.scaler, time.monotonic())
                record(observed, plan)
                await act(self.client, observed, plan, self.logger)
                if plan.enabled and plan.desired == 0:
                    state.due = now + min(cr.interval, ZERO_INTERVAL)
        except TICK_ERRORS as e:
            self.logger.warning("autoscaler tick of %s/%s failed, retrying next interval: %s", *cr.key, e)
        except Exception:  # a bug must not stop the scaling of every other object
            self.logger.exception("autoscaler tick of %s/%s crashed", *cr.key)
