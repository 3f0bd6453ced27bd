"""What the replicas say about LoRA adapters, read without I/O: their `/v1/models` lists and the
`vllm:lora_requests_info` series of their `/metrics`, and from both, where one adapter can run.

The shapes are vLLM's: an adapter is a model entry whose `parent` names the base model it was trained on;
`vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}` carries the adapters of
the running and the waiting requests, comma-joined, with a timestamp as its value.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from .picker import AdapterTargets

LORA_INFO = "vllm:lora_requests_info"


@dataclass(frozen=True)
class ReplicaModels:
    """One replica's `/v1/models`: the names it serves as itself and the adapters on top of them."""

    bases: frozenset[str] = frozenset()
    adapters: frozenset[str] = frozenset()


def parse_models(body: Any) -> ReplicaModels:
    """A `/v1/models` answer -> its base names and adapter names. Raises ValueError on another shape."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise ValueError("expected an object with a `data` list")
    bases, adapters = set(), set()
    for card in data:
        name = card.get("id") if isinstance(card, dict) else None
        if not isinstance(name, str) or not name:
            continue
        parent = card.get("parent")
        (adapters if isinstance(parent, str) and parent else bases).add(name)
    return ReplicaModels(frozenset(bases), frozenset(adapters))


@dataclass(frozen=True)
class LoraInfo:
    """One replica's adapter slots now: how many it has, and the adapters its requests hold."""

    max_lora: int = 0
    running: frozenset[str] = frozenset()
    waiting: frozenset[str] = frozenset()

    @property
    def hot(self) -> frozenset[str]:
        return self.running | self.waiting


def _names(joined: str) -> frozenset[str]:
    return frozenset(n.strip() for n in joined.split(",") if n.strip())


def parse_lora_info(text: str) -> LoraInfo | None:
    """The `vllm:lora_requests_info` of a `/metrics` page; None when the page has none.

    vLLM sets a new label set each time the adapters change and keeps the old ones, with the time as the
    value: the newest sample is the current one (the Gateway API Inference Extension reads it so too).
    Only that series' lines are parsed, so a scrape of a large page costs little more.
    """
    lines = "\n".join(line for line in text.splitlines() if line.startswith(LORA_INFO))
    if not lines:
        return None
    newest, labels = float("-inf"), None
    try:
        for family in text_string_to_metric_families(lines + "\n"):
            for s in family.samples:
                if s.name == LORA_INFO and s.value >= newest:
                    newest, labels = s.value, s.labels
    except ValueError:  # a malformed line: the adapters are unknown, the load scrape stands
        return None
    if labels is None:
        return None
    try:
        max_lora = int(float(labels.get("max_lora") or 0))
    except ValueError:
        max_lora = 0
    return LoraInfo(max_lora, _names(labels.get("running_lora_adapters", "")),
                    _names(labels.get("waiting_lora_adapters", "")))


def adapter_targets(model: str | None, lists: Mapping[str, ReplicaModels], lora: Mapping[str, LoraInfo],
                    ours: Mapping[str, Iterable[str]]) -> AdapterTargets | None:
    """Where a request for `model` can run, if `model` is an adapter; None for a base model, no model, or
    while no replica's list is known.

    `lists`: the replicas' known `/v1/models`; `lora`: their scraped adapter slots; `ours`: the adapters of
    the router's own requests in flight per replica (fresh, where the scrape is up to an interval old).
    A name no replica lists gives targets with no replica: the picker then routes it as it routes any
    model, and the replica answers for it.
    """
    if not model or not lists or any(model in m.bases for m in lists.values()):
        return None  # with no list known yet, nothing tells an adapter from an alias of the base
    listed = frozenset(n for n, m in lists.items() if model in m.adapters)
    hot = frozenset(n for n, info in lora.items() if model in info.hot) | frozenset(
        n for n, names in ours.items() if model in names)
    # a cold replica whose slots all hold other adapters would keep the request waiting for one to free
    full = frozenset(n for n, info in lora.items()
                     if info.max_lora > 0 and n not in hot and len(info.running) >= info.max_lora)
    return AdapterTargets(model, listed, hot, full)
