"""What runs an InferenceDeployment's replicas: a Deployment, or a LeaderWorkerSet when each replica spans
several nodes (parallelism.py). Reading, applying, scaling and removing it, for reconcile and the autoscaler.

The LeaderWorkerSet API is an add-on: a cluster without its CRD (404) or a chart without its grant (403)
gets a condition (reconcile) instead of an error, and the operator never calls it for a spec on one node
unless the status says it applied one before (status.workload), as with the InferencePool.
"""

from __future__ import annotations

import logging
from typing import Any

from kvpilot.operator import kube, lws, parallelism, resources
from kvpilot.operator.lora_sources import NO_SOURCES, Sources

DEPLOYMENT = "Deployment"
LEADER_WORKER_SET = lws.KIND
AUTOSCALER_MANAGER = "kvpilot-autoscaler"
LWS_ERRORS = {
    404: ("LeaderWorkerSetCRDMissing", "each replica spans several nodes (spec.parallelism over "
          "resources.gpusPerNode), which needs the LeaderWorkerSet API (leaderworkerset.x-k8s.io/v1): install "
          "LeaderWorkerSet in the cluster, or fit the ranks on one node"),
    403: ("LeaderWorkerSetForbidden", "the operator may not write LeaderWorkerSets: install the kvpilot chart "
          "with leaderWorkerSet.enabled=true"),
}


def kind_of(spec: dict[str, Any]) -> str:
    return LEADER_WORKER_SET if parallelism.multi_node(spec) else DEPLOYMENT


def collection(kind: str, ns: str) -> str:
    return kube.leaderworkersets(ns) if kind == LEADER_WORKER_SET else kube.deployments(ns)


def path(kind: str, ns: str, name: str) -> str:
    return f"{collection(kind, ns)}/{name}"


def render(cr_meta: dict[str, Any], spec: dict[str, Any], replicas: int, lora: Sources = NO_SOURCES) -> dict[str, Any]:
    if kind_of(spec) == LEADER_WORKER_SET:
        return lws.render_leader_worker_set(cr_meta, spec, replicas, lora)
    return resources.render_deployment(cr_meta, spec, replicas, lora)


async def read(client: kube.KubeClient, ns: str, name: str, kind: str) -> dict[str, Any] | None:
    """The live workload of that kind; None when absent, or when the cluster has no LeaderWorkerSet API or
    the operator may not read it (reconcile says which in a condition)."""
    try:
        return await client.get(path(kind, ns, name))
    except kube.KubeApiError as e:
        if kind == LEADER_WORKER_SET and e.status in LWS_ERRORS:
            return None
        raise


async def apply(client: kube.KubeClient, meta: dict[str, Any], spec: dict[str, Any], replicas: int,
                lora: Sources = NO_SOURCES) -> tuple[dict[str, Any] | None, tuple[str, str] | None]:
    """(the applied workload, None), or (None, (reason, message)) when the cluster cannot take an LWS."""
    kind = kind_of(spec)
    try:
        return await client.apply(collection(kind, meta["namespace"]), render(meta, spec, replicas, lora)), None
    except kube.KubeApiError as e:
        if kind != LEADER_WORKER_SET or e.status not in LWS_ERRORS:
            raise
        return None, LWS_ERRORS[e.status]


async def remove_other(client: kube.KubeClient, ns: str, name: str, kind: str, applied: str | None,
                       logger: logging.Logger) -> None:
    """After a switch between one node and several, once `kind` is applied: the other kind goes. `applied`
    is status.workload, the kind applied before (None before this field existed: a Deployment)."""
    if kind == LEADER_WORKER_SET:
        if applied != LEADER_WORKER_SET and await client.delete(path(DEPLOYMENT, ns, name)):
            logger.info("Deployment removed: the replicas span several nodes now")
        return
    if applied != LEADER_WORKER_SET:
        return
    try:
        if await client.delete(path(LEADER_WORKER_SET, ns, name)):
            logger.info("LeaderWorkerSet removed: the replicas fit one node now")
    except kube.KubeApiError as e:
        if e.status != 403:
            raise
        logger.warning("could not delete the LeaderWorkerSet %s: %s", name, e)


def replicas_of(obj: dict[str, Any] | None) -> int:
    return int(((obj or {}).get("spec") or {}).get("replicas", 0) or 0)


async def scale(client: kube.KubeClient, ns: str, name: str, kind: str, current: int,
                desired: int) -> dict[str, Any] | None:
    """Set the replicas (groups, for an LWS) if they are still `current`, with the read's resourceVersion as
    precondition; the workload as patched, or None when it changed under the decision. A Deployment is
    patched directly; an LWS through its scale subresource, the LWS API's way to set the group count."""
    where = path(kind, ns, name)

    async def attempt() -> dict[str, Any] | None:
        live = await client.get(where)
        if live is None or replicas_of(live) != current:
            return None
        body: dict[str, Any] = {"spec": {"replicas": desired}}
        rv = live.get("metadata", {}).get("resourceVersion")
        if rv:
            body["metadata"] = {"resourceVersion": rv}
        if kind == DEPLOYMENT:
            return await client.patch(where, body, "strategic", manager=AUTOSCALER_MANAGER)
        scaled = await client.patch(f"{where}/scale", body, "merge", manager=AUTOSCALER_MANAGER)
        # The Scale answer carries the new count and version; the LWS's status is the one just read.
        meta = {**live["metadata"], **{k: v for k, v in (scaled.get("metadata") or {}).items()
                                        if k == "resourceVersion"}}
        return {**live, "metadata": meta, "spec": {**live["spec"], "replicas": scaled["spec"]["replicas"]}}

    return await kube.retry_on_conflict(attempt)
