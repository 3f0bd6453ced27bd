"""Converge an InferenceDeployment's children (a Deployment or, for replicas on several nodes, a
LeaderWorkerSet; Services, PDBs, the router's objects or an InferencePool) on its spec, and write its status.

Idempotent: the manifests are rendered purely from the spec and the live replica count, and server-side
apply of an unchanged manifest changes nothing, so a restart of the operator causes no rollout.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from kvpilot.operator import crd, kube, lora_plan, metrics, parallelism, resources, routing, workload
from kvpilot.operator.lora_sources import NO_SOURCES, Sources
from kvpilot.operator.status import now_iso
from kvpilot.operator.tick import Cr, sync_pdb, write_status


class NotReady(Exception):
    """The object cannot be reconciled yet (e.g. no uid for the owner references); try again shortly."""


class Degraded(Exception):
    """Reconciled, but a part could not be applied (e.g. no InferencePool or LeaderWorkerSet CRD); the status
    says why."""


async def reconcile(client: kube.KubeClient, cr: Cr, logger: logging.Logger,
                    status: dict[str, Any] | None = None) -> int | None:
    """Apply the children and write the status; the replicas written, or None for an invalid spec.
    `status` is the CR's status as the event saw it (which InferencePool it may have left behind)."""
    ns, name = cr.key
    status = status or {}
    applied = status.get("workload")  # the kind applied before: the other one goes after a switch
    errors = crd.validate(name, cr.spec)
    kind = (applied or workload.DEPLOYMENT) if errors else workload.kind_of(cr.spec)
    live = await workload.read(client, ns, name, kind)
    if errors:
        logger.warning("invalid spec, children left as they are: %s", "; ".join(errors))
        metrics.RECONCILES.labels(ns, name, "invalid").inc()
        await write_status(client, cr, deployment=live, now=now_iso(), errors=errors, reconciled=True)
        return None
    if not cr.meta["uid"]:
        raise NotReady("the object has no uid yet")

    live_replicas = live.get("spec", {}).get("replicas") if live else None
    replicas = resources.reconcile_replicas(cr.spec, live_replicas)
    lora = await adapter_sources(client, cr)
    running, workload_error = await workload.apply(client, cr.meta, cr.spec, replicas, lora)
    routed = cr
    if workload_error is None:
        await workload.remove_other(client, ns, name, kind, applied, logger)
    else:
        # No LeaderWorkerSet: a Deployment from before keeps serving, behind Services that select all its pods.
        routed = dataclasses.replace(cr, spec=parallelism.on_one_node(cr.spec))
    router, routing_error = await sync_routing(client, routed, status, logger)
    await sync_pdb(client, cr, replicas)
    logger.info("reconciled: %s, Service%s with %d replicas%s", kind,
                " and PDB" if resources.render_pdb(cr.meta, replicas) else "", replicas,
                ", behind the router" if router is not None else "")
    await write_status(client, cr, deployment=running, now=now_iso(), desired=replicas, reconciled=True,
                       router=router, routing_error=routing_error, workload_error=workload_error,
                       workload_kind=kind if workload_error is None else None)
    problem = workload_error or routing_error
    if problem is not None:
        metrics.RECONCILES.labels(ns, name, "degraded").inc()
        logger.warning("not applied: %s", problem[1])
        raise Degraded(problem[1])
    metrics.RECONCILES.labels(ns, name, "ok").inc()
    return replicas


async def adapter_sources(client: kube.KubeClient, cr: Cr) -> Sources:
    """The claims and folders this base's LoRAAdapters need in its pods (engine.enableLora only). A cluster
    without the LoRAAdapter CRD (a chart upgrade does not install new CRDs) has none."""
    if not cr.spec["engine"].get("enableLora"):
        return NO_SOURCES
    ns, name = cr.key
    try:
        listed = await client.list(kube.loraadapters(ns))
    except kube.KubeApiError as e:
        if e.not_found:
            return NO_SOURCES
        raise
    adapters = [lora_plan.Adapter.from_body(body) for body in listed]
    return lora_plan.wanted_sources(a for a in adapters if a.base_key == (ns, name))


async def sync_routing(client: kube.KubeClient, cr: Cr, status: dict[str, Any], logger: logging.Logger,
                       ) -> tuple[dict[str, Any] | None, tuple[str, str] | None]:
    """The user-facing Service and what routes behind it. The router goes up before the Service points at
    it, and comes down after the Service points at the daemons again. Returns (the router Deployment in
    builtin mode, (reason, message) when the router or the InferencePool could not be applied)."""
    ns = cr.meta["namespace"]
    service = resources.render_service(cr.meta, cr.spec)
    router, routing_error = None, None
    if resources.builtin_router(cr.spec):
        try:
            router = await apply_router(client, cr)
        except kube.KubeApiError as e:
            if e.status != 403:
                raise
            # The Service keeps pointing at the daemons: serving goes on without the router.
            await client.apply(kube.services(ns), resources.render_service(cr.meta, without_router(cr.spec)))
            return None, ROUTER_FORBIDDEN
        await client.apply(kube.services(ns), service)
    else:
        await client.apply(kube.services(ns), service)
        await remove_router(client, cr, logger)
    if crd.inference_pool(cr.spec):
        routing_error = await apply_inference_pool(client, cr)
    elif (status.get("router") or {}).get("mode") == "inferencePool":
        await remove_inference_pool(client, cr, logger)
    return router, routing_error


async def apply_router(client: kube.KubeClient, cr: Cr) -> dict[str, Any]:
    """The router's identity and grant first (its pods start watching at once), then the daemons' headless
    Service it discovers them through, then the router itself and its PDB."""
    ns, meta = cr.meta["namespace"], cr.meta
    await client.apply(kube.serviceaccounts(ns), routing.render_service_account(meta))
    await client.apply(kube.roles(ns), routing.render_role(meta))
    await client.apply(kube.rolebindings(ns), routing.render_role_binding(meta))
    await client.apply(kube.services(ns), routing.render_daemons_service(meta, cr.spec))
    router = await client.apply(kube.deployments(ns), routing.render_router_deployment(meta, cr.spec))
    await client.apply(kube.pdbs(ns), routing.render_router_pdb(meta))
    return router


async def remove_router(client: kube.KubeClient, cr: Cr, logger: logging.Logger) -> None:
    """After router.enabled went false (or the mode changed): the router Deployment is the marker."""
    ns, name = cr.key
    rname = routing.router_name(name)
    if await client.get(f"{kube.deployments(ns)}/{rname}") is None:
        return
    for path in (f"{kube.deployments(ns)}/{rname}", f"{kube.pdbs(ns)}/{rname}",
                 f"{kube.services(ns)}/{routing.daemons_service_name(name)}", f"{kube.rolebindings(ns)}/{rname}",
                 f"{kube.roles(ns)}/{rname}", f"{kube.serviceaccounts(ns)}/{rname}"):
        await client.delete(path)
    logger.info("router removed")


def without_router(spec: dict[str, Any]) -> dict[str, Any]:
    return {**spec, "router": {**spec["router"], "enabled": False}}


ROUTER_FORBIDDEN = ("RouterForbidden", "the operator may not create the router's ServiceAccount, Role or Deployment: "
                    "install the kvpilot chart with router.enabled=true")
POOL_ERRORS = {
    404: ("InferencePoolCRDMissing", "the InferencePool API (inference.networking.k8s.io/v1) is not installed: "
          "install the Gateway API Inference Extension CRDs, or use router.mode builtin"),
    403: ("InferencePoolForbidden", "the operator may not write InferencePools: install the kvpilot chart with "
          "gatewayInferenceExtension.enabled=true"),
}


async def apply_inference_pool(client: kube.KubeClient, cr: Cr) -> tuple[str, str] | None:
    """None when applied; (reason, message) for the RouterReady condition when the cluster cannot take it."""
    pool = routing.render_inference_pool(cr.meta, cr.spec)
    try:
        await client.apply(kube.inferencepools(cr.meta["namespace"]), pool)
    except kube.KubeApiError as e:
        if e.status not in POOL_ERRORS:
            raise
        return POOL_ERRORS[e.status]
    return None


async def remove_inference_pool(client: kube.KubeClient, cr: Cr, logger: logging.Logger) -> None:
    ns, name = cr.key
    try:
        if await client.delete(f"{kube.inferencepools(ns)}/{name}"):
            logger.info("InferencePool removed")
    except kube.KubeApiError as e:
        if e.status != 403:
            raise
        logger.warning("could not delete the InferencePool %s: %s", name, e)
