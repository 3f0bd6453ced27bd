"""Pure functions that compute the InferenceDeployment's status from what was observed."""

from __future__ import annotations

import datetime
from typing import Any

from kvpilot.operator.autoscaler import Decision
from kvpilot.operator.resources import selector_string, service_url


def now_iso(now: datetime.datetime | None = None) -> str:
    now = now or datetime.datetime.now(datetime.UTC)
    return now.strftime("%Y-%m-%dT%H:%M:%SZ")


def set_condition(conditions: list[dict[str, Any]], ctype: str, status: str, reason: str, message: str,
                  now: str, generation: int | None = None) -> list[dict[str, Any]]:
    """Replace one condition; lastTransitionTime moves only when its status changes."""
    old = next((c for c in conditions if c.get("type") == ctype), None)
    cond: dict[str, Any] = {"type": ctype, "status": status, "reason": reason, "message": message,
                            "lastTransitionTime": now}
    if old is not None and old.get("status") == status and old.get("lastTransitionTime"):
        cond["lastTransitionTime"] = old["lastTransitionTime"]
    if generation is not None:
        cond["observedGeneration"] = generation
    out = [c for c in conditions if c.get("type") != ctype] + [cond]
    order = {"Ready": 0, "Progressing": 1, "ScalingActive": 2}
    return sorted(out, key=lambda c: order.get(c.get("type", ""), 9))


def get_condition(status: dict[str, Any] | None, ctype: str) -> dict[str, Any] | None:
    return next((c for c in (status or {}).get("conditions") or [] if c.get("type") == ctype), None)


def deployment_conditions(conditions: list[dict[str, Any]], deployment: dict[str, Any] | None,
                          now: str, generation: int | None) -> list[dict[str, Any]]:
    """Ready and Progressing from the child Deployment."""
    if deployment is None:
        conditions = set_condition(conditions, "Ready", "False", "DeploymentMissing",
                                   "the Deployment does not exist yet", now, generation)
        return set_condition(conditions, "Progressing", "True", "Creating", "creating the Deployment", now,
                             generation)
    want = deployment.get("spec", {}).get("replicas", 1)
    st = deployment.get("status", {}) or {}
    ready, updated = st.get("readyReplicas", 0) or 0, st.get("updatedReplicas", 0) or 0
    total = st.get("replicas", 0) or 0
    if ready > 0:
        conditions = set_condition(conditions, "Ready", "True", "Serving",
                                   f"{ready}/{want} pods ready", now, generation)
    elif want == 0:
        conditions = set_condition(conditions, "Ready", "False", "ScaledToZero", "spec.replicas is 0", now,
                                   generation)
    else:
        conditions = set_condition(conditions, "Ready", "False", "NoReadyPods",
                                   f"0/{want} pods ready (the model may still be loading)", now, generation)
    dep_progress = next((c for c in st.get("conditions") or [] if c.get("type") == "Progressing"), None)
    if dep_progress is not None and dep_progress.get("status") == "False":
        return set_condition(conditions, "Progressing", "False", dep_progress.get("reason") or "Stalled",
                             dep_progress.get("message") or "the rollout stalled", now, generation)
    if updated < want or ready < want or total > want:
        msg = f"rolling out: {updated} updated, {ready} ready, {total} total of {want}"
        return set_condition(conditions, "Progressing", "True", "RollingOut", msg, now, generation)
    return set_condition(conditions, "Progressing", "False", "Complete", f"all {want} pods updated and ready",
                         now, generation)


def invalid_spec_conditions(conditions: list[dict[str, Any]], errors: list[str], now: str,
                            generation: int | None, deployment_exists: bool) -> list[dict[str, Any]]:
    message = "; ".join(errors)[:1000]
    conditions = set_condition(conditions, "Progressing", "False", "InvalidSpec", message, now, generation)
    if not deployment_exists:
        conditions = set_condition(conditions, "Ready", "False", "InvalidSpec", message, now, generation)
    return conditions


def scaling_condition(conditions: list[dict[str, Any]], enabled: bool, decision: Decision | None,
                      now: str, generation: int | None) -> list[dict[str, Any]]:
    if not enabled:
        return set_condition(conditions, "ScalingActive", "False", "AutoscalingDisabled",
                             "spec.replicas drives the Deployment", now, generation)
    if decision is None:
        return set_condition(conditions, "ScalingActive", "Unknown", "Waiting", "no metrics sample yet", now,
                             generation)
    if not decision.metrics_known:
        return set_condition(conditions, "ScalingActive", "False", decision.reason, decision.message(), now,
                             generation)
    return set_condition(conditions, "ScalingActive", "True", decision.reason, decision.message(), now,
                         generation)


def metrics_status(decision: Decision, now: str) -> dict[str, Any]:
    mean = decision.mean_kv_cache_usage
    return {
        "kvCacheUsage": round(mean, 4),
        "kvCacheUsagePercent": round(mean * 100),
        "waitingRequests": round(decision.waiting_total, 2),
        "runningRequests": round(decision.running_total, 2),
        "sampledPods": decision.sampled,
        "failedPods": decision.failed,
        "time": now,
    }


def _scaling(conditions: list[dict[str, Any]], old: dict[str, Any], enabled: bool, decision: Decision | None,
             now: str, generation: int | None) -> list[dict[str, Any]]:
    if enabled and decision is None:
        kept = get_condition(old, "ScalingActive")
        if kept is not None and kept.get("reason") != "AutoscalingDisabled":
            return conditions  # the autoscaling loop's last word stands until its next decision
    return scaling_condition(conditions, enabled, decision if enabled else None, now, generation)


def status_patch(*, meta: dict[str, Any], spec: dict[str, Any], old: dict[str, Any] | None,
                 deployment: dict[str, Any] | None, now: str, errors: list[str] | None = None,
                 desired: int | None = None, decision: Decision | None = None, scaled: bool = False,
                 reconciled: bool = False) -> dict[str, Any]:
    """The one status an InferenceDeployment gets, from what was observed and decided.

    `old` is the status read just before (conditions keep their transition times); `reconciled` says the
    spec of meta["generation"] was converged on (or found invalid), which is what observedGeneration means.
    `decision` is the autoscaler's, or with autoscaling off a sample of the load only.
    """
    old = dict(old or {})
    gen = meta.get("generation")
    conditions = list(old.get("conditions") or [])
    patch: dict[str, Any] = {}
    if reconciled and gen is not None:
        patch["observedGeneration"] = gen
    if errors:
        patch["conditions"] = invalid_spec_conditions(conditions, errors, now, gen, deployment is not None)
        return patch
    enabled = bool(spec["autoscaling"]["enabled"])
    live = (deployment or {}).get("spec", {}).get("replicas", 0) or 0
    conditions = deployment_conditions(conditions, deployment, now, gen)
    st = (deployment or {}).get("status") or {}
    patch.update({
        "replicas": st.get("replicas", 0) or 0,  # always beside Ready, which is computed from the same counts
        "readyReplicas": st.get("readyReplicas", 0) or 0,
        "desiredReplicas": live if desired is None else desired,
        "selector": selector_string(meta["name"]),
        "url": service_url(meta, spec),
        "conditions": _scaling(conditions, old, enabled, decision, now, gen),
    })
    if decision is not None and enabled:
        patch["autoscaler"] = {"panic": decision.panic, "reason": decision.reason, "message": decision.message()}
    if scaled:
        patch["lastScaleTime"] = now
    if decision is not None and decision.metrics_known:
        patch["metrics"] = metrics_status(decision, now)
    return patch
