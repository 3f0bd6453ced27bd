"""Pure functions that compute the InferenceDeployment's status from what was observed."""

from __future__ import annotations

import datetime
from typing import Any

from kvpilot.operator import parallelism
from kvpilot.operator.autoscaler import Decision
from kvpilot.operator.resources import service_url, serving_selector_string


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
    order = {"Ready": 0, "Progressing": 1, "ScalingActive": 2, "RouterReady": 3}
    return sorted(out, key=lambda c: order.get(c.get("type", ""), 9))


def get_condition(status: dict[str, Any] | None, ctype: str) -> dict[str, Any] | None:
    return next((c for c in (status or {}).get("conditions") or [] if c.get("type") == ctype), None)


def deployment_conditions(conditions: list[dict[str, Any]], deployment: dict[str, Any] | None,
                          now: str, generation: int | None, kind: str = "Deployment") -> list[dict[str, Any]]:
    """Ready and Progressing from the child workload: a Deployment (its pods), or a LeaderWorkerSet (its
    groups, each ready when all its pods are)."""
    if deployment is None:
        conditions = set_condition(conditions, "Ready", "False", f"{kind}Missing",
                                   f"the {kind} does not exist yet", now, generation)
        return set_condition(conditions, "Progressing", "True", "Creating", f"creating the {kind}", now,
                             generation)
    kind = deployment.get("kind") or kind
    unit = "groups" if kind == "LeaderWorkerSet" else "pods"
    want = deployment.get("spec", {}).get("replicas", 1)
    st = deployment.get("status", {}) or {}
    ready, updated = st.get("readyReplicas", 0) or 0, st.get("updatedReplicas", 0) or 0
    total = st.get("replicas", 0) or 0
    if ready > 0:
        conditions = set_condition(conditions, "Ready", "True", "Serving",
                                   f"{ready}/{want} {unit} ready", now, generation)
    elif want == 0:
        conditions = set_condition(conditions, "Ready", "False", "ScaledToZero", "spec.replicas is 0", now,
                                   generation)
    else:
        conditions = set_condition(conditions, "Ready", "False", "NoReadyPods",
                                   f"0/{want} {unit} ready (the model may still be loading)", now, generation)
    # A Deployment's Progressing False means its rollout stalled; an LWS's only that no group is in progress.
    dep_progress = next((c for c in st.get("conditions") or [] if c.get("type") == "Progressing"), None)
    if kind == "Deployment" and dep_progress is not None and dep_progress.get("status") == "False":
        return set_condition(conditions, "Progressing", "False", dep_progress.get("reason") or "Stalled",
                             dep_progress.get("message") or "the rollout stalled", now, generation)
    if updated < want or ready < want or total > want:
        msg = f"rolling out: {updated} updated, {ready} ready, {total} total of {want} {unit}"
        return set_condition(conditions, "Progressing", "True", "RollingOut", msg, now, generation)
    return set_condition(conditions, "Progressing", "False", "Complete", f"all {want} {unit} updated and ready",
                         now, generation)


def workload_error_conditions(conditions: list[dict[str, Any]], error: tuple[str, str], now: str,
                              generation: int | None) -> list[dict[str, Any]]:
    """The workload could not be applied (no LeaderWorkerSet API): neither Ready nor progressing until it is."""
    conditions = set_condition(conditions, "Ready", "False", *error, now, generation)
    return set_condition(conditions, "Progressing", "False", *error, now, generation)


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


def _router_mode(spec: dict[str, Any]) -> str | None:
    router = spec.get("router") or {}
    return router.get("mode", "builtin") if router.get("enabled") else None


def routing_status(conditions: list[dict[str, Any]], old: dict[str, Any], meta: dict[str, Any],
                   spec: dict[str, Any], router: dict[str, Any] | None, routing_error: tuple[str, str] | None,
                   reconciled: bool, decision: Decision | None, now: str,
                   ) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """status.router ({} keeps the old one, None removes it) and the RouterReady condition.

    builtin: from the router Deployment, when one was read. inferencePool: from reconcile, which applied the
    InferencePool. Either way reconcile may have got `routing_error` (reason, message) instead, e.g. on a
    cluster without the InferencePool CRD, or with a chart that does not let the operator deploy routers."""
    gen, mode = meta.get("generation"), _router_mode(spec)
    if mode is None:
        kept = [c for c in conditions if c.get("type") != "RouterReady"]
        return (None if "router" in old else {}), kept
    if mode == "inferencePool":
        if not reconciled:
            return {}, conditions
        out = {"mode": mode, "inferencePool": meta["name"], "replicas": 0, "readyReplicas": 0}
        if routing_error is not None:
            return out, set_condition(conditions, "RouterReady", "False", *routing_error, now, gen)
        return out, set_condition(conditions, "RouterReady", "True", "InferencePoolApplied",
                                  f"InferencePool {meta['name']} selects the daemon pods", now, gen)
    if routing_error is not None and reconciled:
        return {"mode": mode}, set_condition(conditions, "RouterReady", "False", *routing_error, now, gen)
    if router is None:
        return {}, conditions
    st = router.get("status") or {}
    want = (router.get("spec") or {}).get("replicas", 0) or 0
    ready = st.get("readyReplicas", 0) or 0
    out = {"mode": mode, "replicas": st.get("replicas", 0) or 0, "readyReplicas": ready}
    if decision is not None:
        out["heldRequests"] = round(decision.held, 2)
    if ready > 0:
        return out, set_condition(conditions, "RouterReady", "True", "RouterAvailable",
                                  f"{ready}/{want} router pods ready", now, gen)
    return out, set_condition(conditions, "RouterReady", "False", "RouterUnavailable",
                              f"0/{want} router pods ready: the Service has no endpoint", now, gen)


def status_patch(*, meta: dict[str, Any], spec: dict[str, Any], old: dict[str, Any] | None,
                 deployment: dict[str, Any] | None, now: str, errors: list[str] | None = None,
                 desired: int | None = None, decision: Decision | None = None, scaled: bool = False,
                 reconciled: bool = False, router: dict[str, Any] | None = None,
                 routing_error: tuple[str, str] | None = None, workload_error: tuple[str, str] | None = None,
                 workload_kind: str | None = None) -> dict[str, Any]:
    """The one status an InferenceDeployment gets, from what was observed and decided.

    `old` is the status read just before (conditions keep their transition times); `reconciled` says the
    spec of meta["generation"] was converged on (or found invalid), which is what observedGeneration means.
    `decision` is the autoscaler's, or with autoscaling off a sample of the load only. `router` is the router
    Deployment (builtin mode) and `routing_error` why the InferencePool could not be applied (routing_status).
    `deployment` is the workload, a Deployment or a LeaderWorkerSet; reconcile gives the kind it applied
    (`workload_kind`, status.workload) or why it could not apply one (`workload_error`).
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
    kind = "LeaderWorkerSet" if parallelism.multi_node(spec) else "Deployment"
    if workload_error is not None:
        conditions = workload_error_conditions(conditions, workload_error, now, gen)
    else:
        conditions = deployment_conditions(conditions, deployment, now, gen, kind)
    ready_now = ((deployment or {}).get("status") or {}).get("readyReplicas", 0) or 0
    if live == 0 and not ready_now and deployment is not None and _router_mode(spec) == "builtin":
        conditions = set_condition(conditions, "Ready", "False", "ScaledToZero",
                                   "scaled to zero: the router holds the next request and wakes a replica", now, gen)
    st = (deployment or {}).get("status") or {}
    patch.update({
        "replicas": st.get("replicas", 0) or 0,  # always beside Ready, which is computed from the same counts
        "readyReplicas": st.get("readyReplicas", 0) or 0,
        "desiredReplicas": live if desired is None else desired,
        "selector": serving_selector_string(meta["name"], spec),
        "url": service_url(meta, spec),
    })
    if workload_kind is not None:
        patch["workload"] = workload_kind
    conditions = _scaling(conditions, old, enabled, decision, now, gen)
    router_st, patch["conditions"] = routing_status(conditions, old, meta, spec, router, routing_error, reconciled,
                                                    decision, now)
    if router_st:
        prev = old.get("router") or {}
        # After a mode switch the other mode's fields go (null deletes in a merge patch).
        stale = {k: None for k in prev if k not in router_st} if prev.get("mode") != router_st["mode"] else {}
        patch["router"] = {**stale, **router_st}
    elif router_st is None:
        patch["router"] = None
    if decision is not None and enabled:
        patch["autoscaler"] = {"panic": decision.panic, "reason": decision.reason, "message": decision.message()}
    if scaled:
        patch["lastScaleTime"] = now
    if decision is not None and decision.metrics_known:
        patch["metrics"] = metrics_status(decision, now)
    return patch
