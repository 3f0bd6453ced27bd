"""A LoRAAdapter's status from a Plan, pure: the pods that hold it, the counts, Ready and LoadFailed."""

from __future__ import annotations

from typing import Any

from kvpilot.operator.lora_plan import Adapter, Plan
from kvpilot.operator.status import set_condition

MAX_MESSAGE = 1000


def load_failed(plan: Plan) -> tuple[str, str, str]:
    """(status, reason, message) of LoadFailed: the daemons' own messages, pod by pod."""
    if not plan.failures:
        return "False", "NoFailures", "no load failed on the pods that should hold the adapter"
    first = plan.failures[min(plan.failures)]
    message = "; ".join(f"{pod}: {a.message}" for pod, a in sorted(plan.failures.items()))
    return "True", first.reason, message[:MAX_MESSAGE]


def status_patch(adapter: Adapter, plan: Plan, now: str) -> dict[str, Any]:
    """The status to write. Conditions keep their transition times while their status holds (set_condition),
    so the same plan gives the same status and the caller writes only what changed."""
    gen = adapter.generation
    conditions = list(adapter.status.get("conditions") or [])
    conditions = set_condition(conditions, "Ready", "True" if plan.ready else "False", plan.reason,
                               plan.message[:MAX_MESSAGE], now, gen)
    conditions = set_condition(conditions, "LoadFailed", *load_failed(plan), now, gen)
    patch: dict[str, Any] = {
        "adapterName": adapter.adapter_name,
        "desiredReplicas": plan.desired,
        "readyReplicas": len(plan.loaded),
        "loadedPods": list(plan.loaded),
        "conditions": conditions,
    }
    if gen is not None:
        patch["observedGeneration"] = gen
    return patch


def changed(adapter: Adapter, patch: dict[str, Any]) -> bool:
    return any(adapter.status.get(k) != v for k, v in patch.items())
