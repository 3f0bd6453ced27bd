"""The agent's Node: its object (registered, Ready, heartbeat), and the scheduler's fit check and bind.

The node is this machine: its pods are processes here, each in its own network (netns.py). Its
capacity is what the run declares (enough for its pods), not the machine's; that is the scheduler's only
use of it. A taint keeps other workloads off it, and the e2e's pods carry the nodeSelector and toleration
that lead them to it, so a cluster's own scheduler (kind, k3s) binds them here too.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from typing import Any

from kvpilot.operator.kube import KubeApiError

from .cluster import NODES, Kube, now_iso, pods

NODE_LABEL = "kvpilot.io/e2e-node"
TAINT_KEY = "kvpilot.io/e2e"
GPU = "nvidia.com/gpu"


@dataclass
class NodeSpec:
    name: str
    capacity: dict[str, str] = field(default_factory=lambda: {"cpu": "4", "memory": "16Gi", GPU: "0"})
    max_pods: int = 110
    since: str = field(default_factory=now_iso)  # the conditions' lastTransitionTime: they never change
    tainted: bool = True  # False only where nothing else could land on it (the emulator)

    def labels(self) -> dict[str, str]:
        return {"kubernetes.io/hostname": self.name, "kubernetes.io/os": "linux", NODE_LABEL: self.name,
                "kubernetes.io/arch": {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), "amd64")}

    def taints(self) -> list[dict[str, str]]:
        return [{"key": TAINT_KEY, "value": self.name, "effect": "NoSchedule"}] if self.tainted else []

    def allocatable(self) -> dict[str, str]:
        return {**self.capacity, "pods": str(self.max_pods)}

    def selector(self) -> dict[str, str]:
        """What a pod needs to land here: pod spec fields (nodeSelector, tolerations)."""
        return {NODE_LABEL: self.name}

    def toleration(self) -> dict[str, str]:
        return {"key": TAINT_KEY, "operator": "Equal", "value": self.name, "effect": "NoSchedule"}


def manifest(spec: NodeSpec) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": spec.name, "labels": spec.labels()},
            "spec": {"taints": spec.taints()}}


def status(spec: NodeSpec) -> dict[str, Any]:
    now = now_iso()

    def cond(ctype: str, value: str, reason: str) -> dict[str, str]:
        return {"type": ctype, "status": value, "reason": reason, "lastHeartbeatTime": now,
                "lastTransitionTime": spec.since, "message": reason}
    return {
        "capacity": {**spec.capacity, "pods": str(spec.max_pods)},
        "allocatable": spec.allocatable(),
        "conditions": [cond("Ready", "True", "KubeletReady"), cond("MemoryPressure", "False", "KubeletHasSufficientMemory"),
                       cond("DiskPressure", "False", "KubeletHasNoDiskPressure"),
                       cond("PIDPressure", "False", "KubeletHasSufficientPID")],
        "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": spec.name}],
        "nodeInfo": {"kubeletVersion": "v1.30.0-kvpilot-e2e", "kubeProxyVersion": "", "operatingSystem": "linux",
                     "architecture": spec.labels()["kubernetes.io/arch"], "containerRuntimeVersion": "process://e2e",
                     "osImage": platform.platform(), "kernelVersion": platform.release(), "machineID": "",
                     "systemUUID": "", "bootID": ""},
        "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
    }


async def register(kube: Kube, spec: NodeSpec) -> None:
    """Create the Node (or take over one of the same name) and report it Ready, as a kubelet does."""
    try:
        await kube.create(NODES, manifest(spec))
    except KubeApiError as e:
        if e.status != 409:
            raise
        await kube.patch(f"{NODES}/{spec.name}", {"metadata": {"labels": spec.labels()},
                                                  "spec": {"taints": spec.taints()}})
    await heartbeat(kube, spec)


async def heartbeat(kube: Kube, spec: NodeSpec) -> None:
    """Conditions with a fresh lastHeartbeatTime: without them the node lifecycle controller marks the node
    NotReady after its grace period (about 40 s) and taints it, and then evicts its pods."""
    await kube.patch(f"{NODES}/{spec.name}/status", {"status": status(spec)})


# ---------------------------------------------------------------------------------------------- scheduling

def quantity(raw: Any) -> float:
    """A resource quantity as a number: cores for cpu, bytes for memory, a count otherwise."""
    s = str(raw).strip()
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "m": 1e-3}
    for suffix, mult in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if s.endswith(suffix):
            return float(s[: -len(suffix)]) * mult
    return float(s)


def requests(pod: dict[str, Any]) -> dict[str, float]:
    """The pod's requests (limits stand in where requests are absent, as the API server defaults them)."""
    total: dict[str, float] = {}
    for ctr in (pod.get("spec") or {}).get("containers") or []:
        res = ctr.get("resources") or {}
        for name, value in {**(res.get("limits") or {}), **(res.get("requests") or {})}.items():
            total[name] = total.get(name, 0.0) + quantity(value)
    return total


def _tolerates(tolerations: list[dict[str, Any]], taint: dict[str, str]) -> bool:
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint["effect"]:
            continue
        if t.get("operator") == "Exists" and (not t.get("key") or t["key"] == taint["key"]):
            return True
        if t.get("key") == taint["key"] and t.get("value", "") == taint.get("value", ""):
            return True
    return False


def misfit(pod: dict[str, Any], spec: NodeSpec, bound: list[dict[str, Any]]) -> str | None:
    """Why the pod does not fit on the node (None: it fits), as the scheduler's filters see it."""
    pspec = pod.get("spec") or {}
    labels = spec.labels()
    wrong = {k: v for k, v in (pspec.get("nodeSelector") or {}).items() if labels.get(k) != v}
    if wrong:
        return f"nodeSelector {wrong} does not match the node's labels"
    for taint in spec.taints():
        if not _tolerates(pspec.get("tolerations") or [], taint):
            return f"untolerated taint {taint['key']}={taint.get('value', '')}:{taint['effect']}"
    if pspec.get("affinity", {}).get("nodeAffinity"):
        return "nodeAffinity is not supported by the e2e node"
    if len(bound) + 1 > spec.max_pods:
        return "too many pods"
    free = {k: quantity(v) for k, v in spec.allocatable().items()}
    for other in bound:
        for k, v in requests(other).items():
            free[k] = free.get(k, 0.0) - v
    for k, v in requests(pod).items():
        if v > 0 and free.get(k, 0.0) < v - 1e-9:
            return f"insufficient {k}: requests {v:g}, {max(free.get(k, 0.0), 0):g} free"
    return None


async def bind(kube: Kube, pod: dict[str, Any], node: str) -> bool:
    """POST pods/NAME/binding with a v1 Binding, as the scheduler does. False when another scheduler bound it
    first (409) or the pod is gone (404)."""
    meta = pod["metadata"]
    body = {"apiVersion": "v1", "kind": "Binding",
            "metadata": {"name": meta["name"], "namespace": meta["namespace"], "uid": meta.get("uid")},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node}}
    try:
        await kube.request("POST", f"{pods(meta['namespace'])}/{meta['name']}/binding", body=body)
    except KubeApiError as e:
        if e.status in (404, 409):
            return False
        raise
    return True
