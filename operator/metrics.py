"""The operator's own Prometheus metrics, in a registry of their own (not the process-wide default)."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

REGISTRY = CollectorRegistry()
_L = ("namespace", "name")

DESIRED = Gauge("kvpilot_operator_desired_replicas", "Replicas the operator wants", _L, registry=REGISTRY)
CURRENT = Gauge("kvpilot_operator_current_replicas", "Replicas of the Deployment before the decision", _L,
                registry=REGISTRY)
KV_USAGE = Gauge("kvpilot_operator_kv_cache_usage", "Mean KV-cache usage of the sampled pods", _L,
                 registry=REGISTRY)
WAITING = Gauge("kvpilot_operator_waiting_requests", "Queued requests over the sampled pods", _L,
                registry=REGISTRY)
HELD = Gauge("kvpilot_operator_router_held_requests", "Requests the routers hold while no daemon is ready", _L,
             registry=REGISTRY)
PANIC = Gauge("kvpilot_operator_panic", "1 while the autoscaler is in panic mode", _L, registry=REGISTRY)
SCRAPES = Counter("kvpilot_operator_scrapes", "Pod /metrics scrapes", _L, registry=REGISTRY)
SCRAPE_ERRORS = Counter("kvpilot_operator_scrape_errors", "Pod /metrics scrapes that failed", _L,
                        registry=REGISTRY)
DECISIONS = Counter("kvpilot_operator_scaling_decisions", "Autoscaler decisions", (*_L, "direction", "reason"),
                    registry=REGISTRY)
RECONCILES = Counter("kvpilot_operator_reconciles", "Reconciles of InferenceDeployments", (*_L, "result"),
                     registry=REGISTRY)
LORA_OPERATIONS = Counter("kvpilot_operator_lora_operations", "LoRA adapter loads and unloads on daemons",
                          (*_L, "op", "result"), registry=REGISTRY)


def serve(port: int, addr: str = "0.0.0.0"):
    """Start the /metrics HTTP server in a thread; returns (server, thread)."""
    return start_http_server(port, addr=addr, registry=REGISTRY)


def forget(namespace: str, name: str) -> None:
    for gauge in (DESIRED, CURRENT, KV_USAGE, WAITING, PANIC, HELD):
        with contextlib.suppress(KeyError):  # never set for this object
            gauge.remove(namespace, name)
