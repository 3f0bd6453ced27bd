"""The Deployment and ReplicaSet controllers, for the emulator only (on a cluster the controller-manager
does this): as many Pods as spec.replicas, a rolling update when the pod template changes, and the
Deployment's status.

Rolling update as the Deployment controller does it with maxSurge / maxUnavailable: pods of the new
template are added while the total stays within replicas + maxSurge, and old pods go only while at least
replicas - maxUnavailable pods are Ready. Scale-in deletes unready pods first, then the youngest.
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
from collections.abc import Callable
from typing import Any

from .cluster import Kube, deployments, pod_ready, pods, terminating

HASH_LABEL = "pod-template-hash"


def template_hash(template: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def owned(pod: dict[str, Any], dep: dict[str, Any]) -> bool:
    sel = (dep.get("spec", {}).get("selector") or {}).get("matchLabels") or {}
    labels = pod.get("metadata", {}).get("labels") or {}
    return bool(sel) and all(labels.get(k) == v for k, v in sel.items())


def _budget(value: Any, replicas: int, round_up: bool) -> int:
    """maxSurge rounds a percentage up, maxUnavailable down (as the controller does)."""
    if isinstance(value, str) and value.endswith("%"):
        x = replicas * float(value[:-1]) / 100
        return math.ceil(x) if round_up else math.floor(x)
    return int(value)


def rollout_budgets(dep: dict[str, Any]) -> tuple[int, int]:
    spec = dep.get("spec") or {}
    ru = ((spec.get("strategy") or {}).get("rollingUpdate")) or {}
    want = int(spec.get("replicas", 1))
    surge = _budget(ru.get("maxSurge", "25%"), want, True)
    unavailable = _budget(ru.get("maxUnavailable", "25%"), want, False)
    return (surge, unavailable) if surge or unavailable else (1, 0)


class ReplicaSets:
    def __init__(self, kube: Kube, ns: str, record: Callable[[str, str, dict[str, Any]], None]) -> None:
        self.kube = kube
        self.ns = ns
        self.record = record
        self._created: dict[str, int] = {}  # pod -> creation order, for "youngest first"
        self._status: dict[str, dict[str, Any]] = {}

    async def sync(self, dep: dict[str, Any], pod_list: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One pass for one Deployment; returns the pod list, changed by what it did."""
        want = int(dep.get("spec", {}).get("replicas", 1))
        h = template_hash(dep["spec"]["template"])
        active = [p for p in pod_list if owned(p, dep) and not terminating(p)]
        new = [p for p in active if (p["metadata"].get("labels") or {}).get(HASH_LABEL) == h]
        old = [p for p in active if p not in new]
        surge, unavailable = rollout_budgets(dep)
        create = want - len(new) if not old else min(want + surge - len(active), want - len(new))
        doomed: list[dict[str, Any]] = []
        if not old and len(new) > want:
            doomed = self._scale_in_order(new)[: len(new) - want]
        elif old:
            # Old pods that are not Ready cost no availability; Ready ones go while enough stay Ready.
            doomed = [p for p in old if not pod_ready(p)]
            spare = sum(pod_ready(p) for p in active) - (want - unavailable)
            doomed += [p for p in old if pod_ready(p)][: max(0, spare)]
        for _ in range(max(0, create)):
            pod_list = [*pod_list, await self._create_pod(dep, h)]
        for pod in doomed:
            name = pod["metadata"]["name"]
            self.record(name, "delete", {"replicas": want, "rollout": bool(old)})
            await self.kube.delete(f"{pods(self.ns)}/{name}")
        if doomed:
            pod_list = await self.kube.list(pods(self.ns))
        return pod_list

    def _scale_in_order(self, active: list[dict[str, Any]]) -> list[dict[str, Any]]:
        unready = [p for p in active if not pod_ready(p)]
        ready = sorted((p for p in active if pod_ready(p)),
                       key=lambda p: self._created.get(p["metadata"]["name"], -1), reverse=True)
        return unready + ready

    async def _create_pod(self, dep: dict[str, Any], h: str) -> dict[str, Any]:
        template = dep["spec"]["template"]
        meta = dep["metadata"]
        name = f"{meta['name']}-{h}-{secrets.token_hex(3)[:5]}"
        body = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "name": name, "namespace": self.ns,
                "labels": {**(template.get("metadata", {}).get("labels") or {}), HASH_LABEL: h},
                "annotations": dict(template.get("metadata", {}).get("annotations") or {}),
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": meta["name"],
                                     "uid": meta.get("uid", ""), "controller": True}],
            },
            "spec": dict(template.get("spec", {})),  # no nodeName: the scheduler role binds it
            "status": {"phase": "Pending"},
        }
        created = await self.kube.create(pods(self.ns), body)
        self._created[name] = len(self._created)
        self.record(name, "created", {})
        return created

    async def write_status(self, dep: dict[str, Any], pod_list: list[dict[str, Any]]) -> None:
        mine = [p for p in pod_list if owned(p, dep)]
        active = [p for p in mine if not terminating(p)]
        h = template_hash(dep["spec"]["template"])
        updated = [p for p in active if (p["metadata"].get("labels") or {}).get(HASH_LABEL) == h]
        ready = sum(1 for p in active if pod_ready(p))
        want = int(dep.get("spec", {}).get("replicas", 1))
        complete = len(updated) == want == len(active) and all(pod_ready(p) for p in updated)
        status = {
            "observedGeneration": dep["metadata"].get("generation", 1),
            "replicas": len(active),
            "updatedReplicas": len(updated),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "unavailableReplicas": max(0, want - ready),
            "terminatingReplicas": len(mine) - len(active),
            "conditions": [
                {"type": "Available", "status": "True" if ready >= 1 else "False",
                 "reason": "MinimumReplicasAvailable" if ready >= 1 else "MinimumReplicasUnavailable"},
                {"type": "Progressing", "status": "True",
                 "reason": "NewReplicaSetAvailable" if complete else "ReplicaSetUpdated"},
            ],
        }
        name = dep["metadata"]["name"]
        if self._status.get(name) != status:
            await self.kube.patch(f"{deployments(self.ns)}/{name}/status", {"status": status})
            self._status[name] = status
