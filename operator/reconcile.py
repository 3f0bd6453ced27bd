"""Converge an InferenceDeployment's children (Deployment, Service, PDB) on its spec, and write its status.

Idempotent: the manifests are rendered purely from the spec and the live replica count, and server-side
apply of an unchanged manifest changes nothing, so a restart of the operator causes no rollout.
"""

from __future__ import annotations

import logging

from kvpilot.operator import crd, kube, metrics, resources
from kvpilot.operator.status import now_iso
from kvpilot.operator.tick import Cr, sync_pdb, write_status


class NotReady(Exception):
    """The object cannot be reconciled yet (e.g. no uid for the owner references); try again shortly."""


async def reconcile(client: kube.KubeClient, cr: Cr, logger: logging.Logger) -> int | None:
    """Apply the children and write the status; the replicas written, or None for an invalid spec."""
    ns, name = cr.key
    errors = crd.validate(name, cr.spec)
    live = await client.get(f"{kube.deployments(ns)}/{name}")
    if errors:
        logger.warning("invalid spec, children left as they are: %s", "; ".join(errors))
        metrics.RECONCILES.labels(ns, name, "invalid").inc()
        await write_status(client, cr, deployment=live, now=now_iso(), errors=errors, reconciled=True)
        return None
    if not cr.meta["uid"]:
        raise NotReady("the object has no uid yet")

    live_replicas = live.get("spec", {}).get("replicas") if live else None
    replicas = resources.reconcile_replicas(cr.spec, live_replicas)
    deployment = await client.apply(kube.deployments(ns), resources.render_deployment(cr.meta, cr.spec, replicas))
    await client.apply(kube.services(ns), resources.render_service(cr.meta, cr.spec))
    await sync_pdb(client, cr, replicas)
    metrics.RECONCILES.labels(ns, name, "ok").inc()
    logger.info("reconciled: Deployment, Service%s with %d replicas",
                " and PDB" if resources.render_pdb(cr.meta, replicas) else "", replicas)
    await write_status(client, cr, deployment=deployment, now=now_iso(), desired=replicas, reconciled=True)
    return replicas
