"""Concurrent scrape of the daemons' and the routers' /metrics. The daemons' pages are read by
kvpilot.common.metrics_text (as the router reads them); the routers' by parse_router_metrics here."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

from kvpilot.common.metrics_text import ScrapeError, parse_metrics, sample_values
from kvpilot.operator.autoscaler import Observation, PodSample, RouterSample

log = logging.getLogger(__name__)
T = TypeVar("T")
S = TypeVar("S")  # a sample type: PodSample or RouterSample

METRICS_PORT_ANNOTATION = "kvpilot.io/metrics-port"
METRICS_PATH_ANNOTATION = "kvpilot.io/metrics-path"

# The router's own series (router/metrics.py): fixed, since the operator deploys that router itself.
ROUTER_HELD = "kvpilot:router_held_requests"
ROUTER_INFLIGHT = "kvpilot:router_endpoint_inflight"


@dataclass(frozen=True)
class Target:
    pod: str
    url: str  # http://ip:port/metrics


def parse_pod_metrics(text: str, names: dict[str, str]) -> PodSample:
    """One pod's page -> a sample. A missing KV or waiting series is an error, never zero load."""
    load = parse_metrics(text, names)
    return PodSample(kv_cache_usage=load.kv_cache_usage, waiting=load.waiting, running=load.running)


def parse_router_metrics(text: str) -> RouterSample:
    """One router's page. The held gauge is always there; in-flight has a series per endpoint once used."""
    values = sample_values(text, (ROUTER_HELD, ROUTER_INFLIGHT))
    if ROUTER_HELD not in values:
        raise ScrapeError(f"series missing: {ROUTER_HELD}")
    return RouterSample(held=sum(values[ROUTER_HELD]), inflight=sum(values.get(ROUTER_INFLIGHT, []), 0.0))


async def scrape_one(session: aiohttp.ClientSession, target: Target, names: dict[str, str],
                     timeout: float) -> PodSample:
    return await fetch(session, target, timeout, lambda text: parse_pod_metrics(text, names))


async def fetch(session: aiohttp.ClientSession, target: Target, timeout: float, parse: Callable[[str], T]) -> T:
    try:
        async with session.get(target.url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                raise ScrapeError(f"HTTP {resp.status}")
            text = await resp.text()
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        raise ScrapeError(f"{type(e).__name__}: {e}") from e
    try:
        return parse(text)
    except ScrapeError:
        raise
    except Exception as e:  # the parser raises ValueError and friends on garbage
        raise ScrapeError(f"unparsable metrics: {e}") from e


@dataclass(frozen=True)
class ScrapeResult:
    observation: Observation
    errors: dict[str, str]  # pod -> why its scrape failed


async def _gather(targets: list[Target], fetch_one: Callable[[Target], Awaitable[Any]],
                  kind: type[S]) -> tuple[list[S], dict[str, str]]:
    """Every target at once; the samples, and pod -> why its scrape failed (a ScrapeError: a pod problem)."""
    results = await asyncio.gather(*(fetch_one(t) for t in targets), return_exceptions=True)
    samples: list[S] = []
    errors: dict[str, str] = {}
    for t, r in zip(targets, results, strict=True):
        if isinstance(r, kind):
            samples.append(r)
        elif isinstance(r, ScrapeError):
            errors[t.pod] = str(r)
        else:
            raise r  # a bug, not a pod problem
    return samples, errors


async def scrape(session: aiohttp.ClientSession, targets: Iterable[Target], not_ready: int,
                 names: dict[str, str], timeout: float = 2.0) -> ScrapeResult:
    samples, errors = await _gather(list(targets), lambda t: scrape_one(session, t, names, timeout), PodSample)
    return ScrapeResult(Observation(samples=tuple(samples), failed=len(errors), not_ready=not_ready), errors)


async def scrape_routers(session: aiohttp.ClientSession, targets: Iterable[Target],
                         timeout: float = 2.0) -> tuple[tuple[RouterSample, ...], dict[str, str]]:
    """The routers' samples, and pod -> why its scrape failed."""
    samples, errors = await _gather(list(targets), lambda t: fetch(session, t, timeout, parse_router_metrics),
                                    RouterSample)
    return tuple(samples), errors


def pod_is_ready(pod: dict[str, Any]) -> bool:
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return False
    conditions = pod.get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def split_pods(pods: Iterable[dict[str, Any]], port: int) -> tuple[list[Target], int]:
    """Ready pods with an IP become scrape targets; the other live pods count as capacity on its way."""
    targets, not_ready = [], 0
    for pod in pods:
        phase = pod.get("status", {}).get("phase")
        if phase in ("Succeeded", "Failed") or pod.get("metadata", {}).get("deletionTimestamp"):
            continue
        base = pod_base_url(pod, port)
        if pod_is_ready(pod) and base:
            path = (pod.get("metadata", {}).get("annotations") or {}).get(METRICS_PATH_ANNOTATION, "/metrics")
            targets.append(Target(pod=pod["metadata"]["name"], url=f"{base}{path}"))
        else:
            not_ready += 1
    return targets, not_ready


def pod_base_url(pod: dict[str, Any], port: int) -> str | None:
    """http://ip:port of the pod's server, or None before it has an IP. The pod may say its port."""
    ip = pod.get("status", {}).get("podIP")
    if not ip:
        return None
    host = f"[{ip}]" if ":" in ip else ip
    annotations = pod.get("metadata", {}).get("annotations") or {}
    raw_port = str(annotations.get(METRICS_PORT_ANNOTATION, port))
    pod_port = int(raw_port) if raw_port.isdigit() and 0 < int(raw_port) < 65536 else port
    return f"http://{host}:{pod_port}"
