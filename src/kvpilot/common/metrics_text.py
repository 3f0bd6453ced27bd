"""The daemons' load read from their Prometheus /metrics text, one way for the operator (autoscaling)
and the router (load-aware routing). Parsed with prometheus_client's text parser."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# role -> the daemon's series name (vLLM's); an InferenceDeployment may rename them
DEFAULT_NAMES = {
    "kvCacheUsage": "vllm:kv_cache_usage_perc",
    "waitingRequests": "vllm:num_requests_waiting",
    "runningRequests": "vllm:num_requests_running",
}


class ScrapeError(Exception):
    """A /metrics page that cannot be read (or a series missing from it)."""


@dataclass(frozen=True)
class LoadSample:
    kv_cache_usage: float  # fraction of the daemon's KV blocks in use
    waiting: float
    running: float = 0.0


def sample_values(text: str, wanted: Iterable[str]) -> dict[str, list[float]]:
    """Every sample of the wanted series, by series name (one value per label set)."""
    want = set(wanted)
    values: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in want:
                values.setdefault(s.name, []).append(float(s.value))
    return values


def parse_metrics(text: str, names: dict[str, str]) -> LoadSample:
    """One daemon's page -> its load. A missing KV or waiting series is an error, never zero load."""
    values = sample_values(text, names.values())
    missing = [names[k] for k in ("kvCacheUsage", "waitingRequests") if names[k] not in values]
    if missing:
        raise ScrapeError(f"series missing: {', '.join(missing)}")
    # A pod serves one model; several series (label sets) are summed, KV usage takes the fullest.
    return LoadSample(
        kv_cache_usage=max(values[names["kvCacheUsage"]]),
        waiting=sum(values[names["waitingRequests"]]),
        running=sum(values.get(names.get("runningRequests", ""), [0.0])),
    )
