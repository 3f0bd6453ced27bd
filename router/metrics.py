"""The router's own Prometheus metrics (kvpilot:router_*), on its own registry."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

CONTENT_TYPE = CONTENT_TYPE_LATEST
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.decisions = Counter("kvpilot:router_decisions", "Routing decisions by reason: session, prefix, "
                                 "hash (the request's home by affinity), spill (moved off its home by load: "
                                 "over the cap, KV full, or it would queue there while another replica has "
                                 "room), load (nothing to route by), fallback (every replica over the cap).",
                                 ["reason"], registry=r)
        self.inflight = Gauge("kvpilot:router_endpoint_inflight", "Requests this router has in flight per "
                              "endpoint.", ["endpoint"], registry=r)
        self.prompt_tokens = Counter("kvpilot:router_prompt_tokens", "Prompt tokens of routed requests "
                                     "(as the router tokenized them).", registry=r)
        self.prefix_hit_tokens = Counter("kvpilot:router_prefix_hit_tokens", "Estimated prompt tokens already "
                                         "cached on the chosen replica (prefix index, whole blocks).", registry=r)
        self.held = Gauge("kvpilot:router_held_requests", "Requests held while no replica is ready.", registry=r)
        self.held_timeouts = Counter("kvpilot:router_held_timeouts", "Held requests answered 503 "
                                     "(no replica in time, or the hold queue was full).", ["reason"], registry=r)
        self.retries = Counter("kvpilot:router_retries", "Requests re-sent to another replica, by the cause.",
                               ["cause"], registry=r)
        self.stream_errors = Counter("kvpilot:router_stream_errors", "Streams cut by their replica, ended "
                                     "with an SSE error event.", registry=r)
        self.responses = Counter("kvpilot:router_responses", "Responses to clients by status code.", ["code"],
                                 registry=r)
        self.overhead = Histogram("kvpilot:router_decision_seconds", "Wall time to tokenize, hash and pick, "
                                  "per request, by where the prompt was encoded (inline on the event loop, "
                                  "pool: on a tokenizer thread, the wait for one included; none: nothing to "
                                  "encode; shed: not encoded, the tokenizer threads were full).", ["tokenize"],
                                  buckets=OVERHEAD_BUCKETS, registry=r)
        self.tokenize_shed = Counter("kvpilot:router_tokenize_shed", "Long prompts not tokenized because "
                                     "--tokenize-max-pending were already on the tokenizer threads: routed on "
                                     "load alone.", registry=r)
        self.adapter_decisions = Counter(
            "kvpilot:router_adapter_decisions", "Requests naming a LoRA adapter, by where they went: hit (a "
            "replica where the adapter was hot: its requests running or waiting there), spill (moved by load "
            "off every replica where it was hot; that replica loads it), cold (hot nowhere: the least-loaded "
            "replica that lists it loads it), unlisted (a model name no replica lists: routed as any "
            "request, the replica answers for it).", ["outcome"], registry=r)
        self._adapter_children: dict[str, Any] = {}
        self._decision_children: dict[str, Any] = {}
        self._overhead_children: dict[str, Any] = {}
        self._inflight_children: dict[str, Any] = {}
        self.endpoints_fn: Callable[[], int] = lambda: 0
        Gauge("kvpilot:router_ready_endpoints", "Ready endpoints known to the router.",
              registry=r).set_function(lambda: self.endpoints_fn())

    def decided(self, reason: str) -> None:
        child = self._decision_children.get(reason)
        if child is None:  # labels() takes a lock and builds a tuple: once per reason is enough
            child = self._decision_children[reason] = self.decisions.labels(reason)
        child.inc()

    def adapter_decided(self, outcome: str) -> None:
        child = self._adapter_children.get(outcome)
        if child is None:
            child = self._adapter_children[outcome] = self.adapter_decisions.labels(outcome)
        child.inc()

    def decision_time(self, tokenized: str, seconds: float) -> None:
        child = self._overhead_children.get(tokenized)
        if child is None:
            child = self._overhead_children[tokenized] = self.overhead.labels(tokenized)
        child.observe(seconds)

    def set_inflight(self, endpoint: str, n: int) -> None:
        child = self._inflight_children.get(endpoint)
        if child is None:
            child = self._inflight_children[endpoint] = self.inflight.labels(endpoint)
        child.set(n)

    def drop_endpoint(self, endpoint: str) -> None:
        self._inflight_children.pop(endpoint, None)
        with contextlib.suppress(KeyError):
            self.inflight.remove(endpoint)

    def render(self) -> bytes:
        return generate_latest(self.registry)
