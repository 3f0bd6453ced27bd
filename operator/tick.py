"""One autoscaling tick for one InferenceDeployment: observe (I/O) -> decide (pure) -> act (I/O).

observe reads the workload (the Deployment, or the LeaderWorkerSet of multi-node replicas) and the pods that
serve the API (a group's leader) and scrapes the Ready ones; decide turns that into a Plan with no
I/O (the Autoscaler's history is the only state, and it is passed in); act writes the Plan: the replicas, an
Event, the PDB and the status, each write retried on a 409 with a fresh read.
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from kvpilot.operator import crd, kube, metrics, resources, routing, workload
from kvpilot.operator.autoscaler import Autoscaler, Decision, Policy
from kvpilot.operator.names import GROUP, KIND, VERSION
from kvpilot.operator.scrape import ScrapeResult, scrape, scrape_routers, split_pods
from kvpilot.operator.status import now_iso, status_patch

AUTOSCALER_MANAGER = workload.AUTOSCALER_MANAGER


@dataclass(frozen=True)
class Cr:
    """An InferenceDeployment as last seen: the parts the operator works from."""

    meta: dict[str, Any]  # name, namespace, uid, generation
    spec: dict[str, Any]  # defaulted

    @classmethod
    def from_body(cls, body: Any) -> Cr:
        m = body.get("metadata") or {}
        meta = {"name": m["name"], "namespace": m["namespace"], "uid": m.get("uid", ""),
                "generation": m.get("generation")}
        return cls(meta=meta, spec=crd.default_spec(dict(body.get("spec") or {})))

    @property
    def key(self) -> tuple[str, str]:
        return self.meta["namespace"], self.meta["name"]

    @property
    def interval(self) -> float:
        return float(self.spec["autoscaling"].get("metricsIntervalSeconds", 10))


@dataclass(frozen=True)
class Observed:
    cr: Cr
    deployment: dict[str, Any]  # the workload: a Deployment, or a LeaderWorkerSet (its replicas are groups)
    scraped: ScrapeResult  # its observation includes the routers' samples
    targets: int
    router: dict[str, Any] | None = None  # the router Deployment (builtin mode)
    router_errors: dict[str, str] = field(default_factory=dict)  # router pod -> why its scrape failed

    @property
    def current(self) -> int:
        return int(self.deployment.get("spec", {}).get("replicas", 0) or 0)


@dataclass(frozen=True)
class Plan:
    current: int
    desired: int
    decision: Decision
    enabled: bool

    @property
    def scale(self) -> bool:
        return self.enabled and self.desired != self.current

    @property
    def direction(self) -> str:
        return "up" if self.desired > self.current else "down" if self.desired < self.current else "hold"


async def observe(client: kube.KubeClient, http: aiohttp.ClientSession, cr: Cr,
                  scrape_timeout: float) -> Observed | None:
    """None when there is nothing to scale: an invalid spec (reconcile reports it) or no workload yet."""
    ns, name = cr.key
    if crd.validate(name, cr.spec):
        return None
    deployment = await workload.read(client, ns, name, workload.kind_of(cr.spec))
    if deployment is None:
        return None
    # Only the pods with the API: a multi-node replica's workers have no /metrics and count as no replica.
    listed = await client.list(kube.pods(ns), label_selector=resources.serving_selector_string(name, cr.spec))
    # Filtered again here: an API that ignored the selector must not let another CR's pods count.
    pods = [p for p in listed if resources.matches_selector(p.get("metadata", {}).get("labels"), name, cr.spec)]
    targets, not_ready = split_pods(pods, resources.DAEMON_PORT)
    scraped = await scrape(http, targets, not_ready, dict(cr.spec["autoscaling"]["metrics"]), scrape_timeout)
    if not resources.builtin_router(cr.spec):
        return Observed(cr=cr, deployment=deployment, scraped=scraped, targets=len(targets))
    return await observe_routers(client, http, cr, scrape_timeout,
                                 Observed(cr=cr, deployment=deployment, scraped=scraped, targets=len(targets)))


async def observe_routers(client: kube.KubeClient, http: aiohttp.ClientSession, cr: Cr, scrape_timeout: float,
                          observed: Observed) -> Observed:
    """The routers' held and in-flight requests: the only demand signal while the daemons are at zero."""
    ns, name = cr.key
    router = await client.get(f"{kube.deployments(ns)}/{routing.router_name(name)}")
    listed = await client.list(kube.pods(ns), label_selector=routing.router_selector_string(name))
    pods = [p for p in listed if routing.matches_router(p.get("metadata", {}).get("labels"), name)]
    targets, _starting = split_pods(pods, routing.ROUTER_PORT)
    samples, errors = await scrape_routers(http, targets, scrape_timeout)
    obs = replace(observed.scraped.observation, routers=samples, routers_failed=len(errors))
    return replace(observed, scraped=replace(observed.scraped, observation=obs), router=router,
                   targets=observed.targets + len(targets), router_errors=errors)


def decide(observed: Observed, scaler: Autoscaler | None, now: float) -> tuple[Plan, Autoscaler | None]:
    """The replicas wanted now. Returns the autoscaler to keep: its history is its state."""
    auto = observed.cr.spec["autoscaling"]
    current = observed.current
    obs = observed.scraped.observation
    if not auto["enabled"]:
        sample = Autoscaler(Policy()).decide(0.0, current, obs)  # the load, for the status only
        return Plan(current=current, desired=current, decision=sample, enabled=False), None
    policy = Policy.from_spec(auto, max_num_seqs=routing.daemon_max_num_seqs(observed.cr.spec))
    if scaler is None:
        scaler = Autoscaler(policy)
    scaler.policy = policy  # the bounds and targets may have changed; the history stays
    decision = scaler.decide(now, current, obs)
    return Plan(current=current, desired=decision.desired, decision=decision, enabled=True), scaler


def record(observed: Observed, plan: Plan) -> None:
    """The operator's own metrics for one tick."""
    ns, name = observed.cr.key
    metrics.SCRAPES.labels(ns, name).inc(observed.targets)
    metrics.SCRAPE_ERRORS.labels(ns, name).inc(len(observed.scraped.errors) + len(observed.router_errors))
    if plan.enabled:
        metrics.DECISIONS.labels(ns, name, plan.direction, plan.decision.reason).inc()
        metrics.PANIC.labels(ns, name).set(1 if plan.decision.panic else 0)
    metrics.DESIRED.labels(ns, name).set(plan.desired)
    metrics.CURRENT.labels(ns, name).set(plan.current)
    metrics.KV_USAGE.labels(ns, name).set(plan.decision.mean_kv_cache_usage)
    metrics.WAITING.labels(ns, name).set(plan.decision.waiting_total)
    if observed.router is not None:
        metrics.HELD.labels(ns, name).set(plan.decision.held)


async def act(client: kube.KubeClient, observed: Observed, plan: Plan, logger: logging.Logger) -> None:
    for pod, err in {**observed.scraped.errors, **observed.router_errors}.items():
        logger.warning("scrape of pod %s failed: %s", pod, err)
    cr, now = observed.cr, now_iso()
    deployment: dict[str, Any] | None = observed.deployment
    scaled = False
    if plan.scale:
        deployment = await scale(client, cr, plan)
        scaled = deployment is not None
        if scaled:
            logger.info("autoscaler: %s", plan.decision.message())
            reason = "ScaledUp" if plan.direction == "up" else "ScaledDown"
            await post_event(client, cr, reason, plan.decision.message())
            await sync_pdb(client, cr, plan.desired)
        else:
            logger.info("autoscaler: the workload changed under the decision; deciding again next tick")
    else:
        logger.debug("autoscaler: %s", plan.decision.message())
    extra = {"router": observed.router} if observed.router is not None else {}
    await write_status(client, cr, deployment=deployment, now=now, desired=plan.desired,
                       decision=plan.decision, scaled=scaled, **extra)


async def scale(client: kube.KubeClient, cr: Cr, plan: Plan) -> dict[str, Any] | None:
    """Set the workload's replicas, if they are still what the decision saw; the patched workload or None."""
    return await workload.scale(client, *cr.key, workload.kind_of(cr.spec), plan.current, plan.desired)


async def sync_pdb(client: kube.KubeClient, cr: Cr, replicas: int) -> None:
    """The PDB follows the replica count: none with a single pod (it would block node drains)."""
    ns, name = cr.key
    pdb = resources.render_pdb(cr.meta, replicas)
    if pdb is not None:
        await client.apply(kube.pdbs(ns), pdb)
    else:
        await client.delete(f"{kube.pdbs(ns)}/{name}")


async def write_status(client: kube.KubeClient, cr: Cr, **observed: Any) -> None:
    """Patch the status subresource from a fresh read of the CR, with its resourceVersion as precondition.
    Keyword arguments go to status_patch(). A CR that is gone is left alone."""
    path = kube.inferencedeployment(*cr.key)

    async def attempt() -> None:
        live = await client.get(path)
        if live is None:
            return
        status = status_patch(meta=cr.meta, spec=cr.spec, old=live.get("status"), **observed)
        body: dict[str, Any] = {"status": status}
        rv = live.get("metadata", {}).get("resourceVersion")
        if rv:
            body["metadata"] = {"resourceVersion": rv}
        await client.patch(f"{path}/status", body)

    await kube.retry_on_conflict(attempt)


async def post_event(client: kube.KubeClient, cr: Cr, reason: str, message: str, etype: str = "Normal") -> None:
    ns, name = cr.key
    now = now_iso()
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        # Named by us: the emulator in the tests has no generateName.
        "metadata": {"name": f"{name}.{uuid.uuid4().hex[:16]}", "namespace": ns},
        "involvedObject": {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": name, "namespace": ns,
                           "uid": cr.meta.get("uid", "")},
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
    await client.create(kube.events(ns), event)
