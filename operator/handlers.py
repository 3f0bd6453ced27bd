"""Thin kopf handlers: wire the CRD, the pure renderers, the autoscaler and the API together.

- create/update/resume -> one idempotent reconcile (server-side apply of Deployment, Service, PDB);
- a per-object daemon scrapes the pods every metricsIntervalSeconds, runs the autoscaler and keeps status.
No finalizer: deleting an InferenceDeployment leaves its children to Kubernetes' garbage collector.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Any

import aiohttp
import kopf

from kvpilot.operator import crd, kube, metrics, resources
from kvpilot.operator.autoscaler import Autoscaler, Decision, Policy
from kvpilot.operator.names import GROUP, PLURAL, VERSION
from kvpilot.operator.scrape import scrape, split_pods
from kvpilot.operator.status import (
    deployment_conditions,
    get_condition,
    invalid_spec_conditions,
    metrics_status,
    now_iso,
    scaling_condition,
)

AUTOSCALER_MANAGER = "kvpilot-autoscaler"


def _env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


@kopf.on.login()
def login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
    return kube.login(settings)


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    # Progress and diff-base live in our own annotations; status stays ours alone.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = logging.WARNING
    memo.kube = kube.Kube(lambda: kube.login(settings))
    memo.http = aiohttp.ClientSession()
    memo.metrics_server = None
    port = int(os.environ.get("KVPILOT_OPERATOR_METRICS_PORT", "8080"))
    if port > 0:
        memo.metrics_server = metrics.serve(port, os.environ.get("KVPILOT_OPERATOR_METRICS_HOST", "0.0.0.0"))
        logger.info("operator metrics on port %d", port)


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    await memo.kube.close()
    await memo.http.close()
    if memo.metrics_server is not None:
        server, thread = memo.metrics_server
        server.shutdown()
        thread.join(timeout=5)


def _meta(body: kopf.Body) -> dict[str, Any]:
    m = body.get("metadata", {})
    return {"name": m["name"], "namespace": m["namespace"], "uid": m.get("uid", ""),
            "generation": m.get("generation")}


def replica_counts(deployment: dict[str, Any]) -> dict[str, int]:
    st = deployment.get("status") or {}
    return {"replicas": st.get("replicas", 0) or 0, "readyReplicas": st.get("readyReplicas", 0) or 0}


async def reconcile(body: kopf.Body, k: kube.Kube, logger: logging.Logger) -> dict[str, Any]:
    """Converge the children on the spec; returns the status patch. Safe to run any number of times."""
    meta = _meta(body)
    ns, name, gen = meta["namespace"], meta["name"], meta["generation"]
    spec = crd.default_spec(dict(body.get("spec") or {}))
    old = dict(body.get("status") or {})
    conditions = list(old.get("conditions") or [])
    now = now_iso()
    errors = crd.validate(name, spec)
    live = await k.get(f"{kube.deployments(ns)}/{name}")
    if errors:
        logger.warning("invalid spec, children left as they are: %s", "; ".join(errors))
        metrics.RECONCILES.labels(ns, name, "invalid").inc()
        return {"conditions": invalid_spec_conditions(conditions, errors, now, gen, live is not None)}
    if not meta["uid"]:
        raise kopf.TemporaryError("the object has no uid yet", delay=2)

    live_replicas = live.get("spec", {}).get("replicas") if live else None
    replicas = resources.reconcile_replicas(spec, live_replicas)
    deployment = await k.apply(kube.deployments(ns), resources.render_deployment(meta, spec, replicas))
    await k.apply(kube.services(ns), resources.render_service(meta, spec))
    pdb = resources.render_pdb(meta, replicas)
    if pdb is not None:
        await k.apply(kube.pdbs(ns), pdb)
    else:
        await k.delete(f"{kube.pdbs(ns)}/{name}")
    metrics.RECONCILES.labels(ns, name, "ok").inc()
    logger.info("reconciled: Deployment, Service%s with %d replicas", " and PDB" if pdb else "", replicas)
    conditions = deployment_conditions(conditions, deployment, now, gen)
    enabled = spec["autoscaling"]["enabled"]
    scaling = get_condition(old, "ScalingActive")
    if not enabled or scaling is None or scaling.get("reason") == "AutoscalingDisabled":
        conditions = scaling_condition(conditions, enabled, None, now, gen)  # the daemon refines it
    patch: dict[str, Any] = {
        **replica_counts(deployment),  # always beside Ready, which is computed from the same counts
        "selector": resources.selector_string(name),
        "url": resources.service_url(meta, spec),
        "desiredReplicas": replicas,
        "conditions": conditions,
    }
    if gen is not None:
        patch["observedGeneration"] = gen
    return patch


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
async def reconcile_handler(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: logging.Logger,
                            **_: Any) -> None:
    try:
        status = await reconcile(body, memo.kube, logger)
    except kube.ApiError as e:
        metrics.RECONCILES.labels(body["metadata"]["namespace"], body["metadata"]["name"], "error").inc()
        raise kopf.TemporaryError(f"API call failed: {e}", delay=5) from e
    patch.setdefault("status", {}).update(status)


async def post_event(k: kube.Kube, body: kopf.Body, reason: str, message: str, etype: str = "Normal") -> None:
    m = body["metadata"]
    now = now_iso()
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        # Named by us: the emulator in the tests has no generateName.
        "metadata": {"name": f"{m['name']}.{uuid.uuid4().hex[:16]}", "namespace": m["namespace"]},
        "involvedObject": {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment",
                           "name": m["name"], "namespace": m["namespace"], "uid": m.get("uid", "")},
        "reason": reason,
        "message": message[:1000],
        "type": etype,
        "source": {"component": "kvpilot-operator"},
        "reportingComponent": "kvpilot-operator",
        "reportingInstance": os.environ.get("HOSTNAME", "kvpilot-operator"),
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    await k.create(kube.events(m["namespace"]), event)


async def autoscale_tick(body: kopf.Body, memo: kopf.Memo, scaler: Autoscaler | None,
                         logger: logging.Logger) -> Autoscaler | None:
    """One scrape + decision + status write. Returns the autoscaler to keep (its history is its state)."""
    k: kube.Kube = memo.kube
    meta = _meta(body)
    ns, name, gen = meta["namespace"], meta["name"], meta["generation"]
    spec = crd.default_spec(dict(body.get("spec") or {}))
    if crd.validate(name, spec):
        return scaler  # reported by reconcile; keep the last good decisions running as they are
    dep_path = f"{kube.deployments(ns)}/{name}"
    deployment = await k.get(dep_path)
    if deployment is None:
        return scaler  # reconcile creates it
    auto = spec["autoscaling"]
    current = deployment.get("spec", {}).get("replicas", 0)
    pods = [p for p in await k.list(kube.pods(ns), resources.selector_string(name))
            if resources.matches_selector(p.get("metadata", {}).get("labels"), name)]  # selectors may be ignored
    targets, not_ready = split_pods(pods, resources.DAEMON_PORT)
    names = {**auto["metrics"]}
    result = await scrape(memo.http, targets, not_ready, names, _env_float("KVPILOT_SCRAPE_TIMEOUT", 2.0))
    metrics.SCRAPES.labels(ns, name).inc(len(targets))
    metrics.SCRAPE_ERRORS.labels(ns, name).inc(len(result.errors))
    for pod, err in result.errors.items():
        logger.warning("scrape of pod %s failed: %s", pod, err)

    now = now_iso()
    status: dict[str, Any] = {}
    decision: Decision
    if auto["enabled"]:
        policy = Policy.from_spec(auto)
        if scaler is None:
            scaler = Autoscaler(policy)
        scaler.policy = policy
        decision = scaler.decide(time.monotonic(), current, result.observation)
        direction = "up" if decision.desired > current else "down" if decision.desired < current else "hold"
        metrics.DECISIONS.labels(ns, name, direction, decision.reason).inc()
        metrics.PANIC.labels(ns, name).set(1 if decision.panic else 0)
        status["autoscaler"] = {"panic": decision.panic, "reason": decision.reason, "message": decision.message()}
        if decision.scaled:
            logger.info("autoscaler: %s", decision.message())
            deployment = await k.merge_patch(dep_path, {"spec": {"replicas": decision.desired}},
                                             manager=AUTOSCALER_MANAGER)
            status["lastScaleTime"] = now
            await post_event(k, body, "ScaledUp" if direction == "up" else "ScaledDown", decision.message())
            pdb = resources.render_pdb(meta, decision.desired)  # the PDB follows the replica count
            if pdb is not None:
                await k.apply(kube.pdbs(ns), pdb)
            else:
                await k.delete(f"{kube.pdbs(ns)}/{name}")
        else:
            logger.debug("autoscaler: %s", decision.message())
    else:
        scaler = None  # a later enable starts with fresh history
        decision = Autoscaler(Policy()).decide(0.0, current, result.observation)  # only for the sample
    metrics.DESIRED.labels(ns, name).set(decision.desired if auto["enabled"] else current)
    metrics.CURRENT.labels(ns, name).set(current)
    metrics.KV_USAGE.labels(ns, name).set(decision.mean_kv_cache_usage)
    metrics.WAITING.labels(ns, name).set(decision.waiting_total)

    old = dict(body.get("status") or {})
    conditions = deployment_conditions(list(old.get("conditions") or []), deployment, now, gen)
    conditions = scaling_condition(conditions, auto["enabled"], decision if auto["enabled"] else None, now, gen)
    status.update({
        **replica_counts(deployment),
        "desiredReplicas": decision.desired if auto["enabled"] else current,
        "selector": resources.selector_string(name),
        "url": resources.service_url(meta, spec),
        "conditions": conditions,
    })
    if decision.metrics_known:
        status["metrics"] = metrics_status(decision, now)
    await k.merge_patch(f"{kube.inferencedeployment(ns, name)}/status", {"status": status})
    return scaler


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=5.0)
async def autoscaler_daemon(body: kopf.Body, memo: kopf.Memo, stopped: kopf.DaemonStopped,
                            logger: logging.Logger, **_: Any) -> None:
    scaler: Autoscaler | None = None
    try:
        while not stopped:
            try:
                scaler = await autoscale_tick(body, memo, scaler, logger)
            except (TimeoutError, kube.ApiError, aiohttp.ClientError) as e:
                logger.warning("autoscaler tick failed, retrying next interval: %s", e)
            interval = crd.default_spec(dict(body.get("spec") or {})).get("autoscaling", {}) \
                .get("metricsIntervalSeconds", 10)
            await stopped.wait(float(interval))
    finally:
        metrics.forget(body["metadata"]["namespace"], body["metadata"]["name"])
