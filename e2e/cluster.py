"""The Kubernetes API for the end-to-end runs: the operator's client (kvpilot.operator.kube) with a few
kubectl-like helpers, for the kmock emulator (emulator.py) or a real API server (target.py).

kmock stores objects as plain JSON and merges patches. A real API server also sets uid, generation,
resourceVersion and creationTimestamp, serves the pods/binding subresource and deletes a bound pod in two
steps (deletionTimestamp, then the kubelet's delete with grace 0). On the emulator `Kube.create` fills in
those fields and `Emulator` acts out binding and graceful deletion, so the agent's node code is the same
on both.
"""

from __future__ import annotations

import datetime
import itertools
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import kopf
import yaml

from kvpilot.operator import kube as client

GROUP, VERSION, PLURAL = "kvpilot.io", "v1alpha1", "inferencedeployments"
LORA_PLURAL = "loraadapters"
CRD_NAME = f"{PLURAL}.{GROUP}"
LORA_CRD_NAME = f"{LORA_PLURAL}.{GROUP}"
REPO = Path(__file__).resolve().parent.parent
CRD_FILE = REPO / "crds" / "inferencedeployment.yaml"
CRD_FILES = {CRD_NAME: CRD_FILE, LORA_CRD_NAME: REPO / "crds" / "loraadapter.yaml"}  # what `kubectl apply -f crds/` installs
EXAMPLE_CR = REPO / "examples" / "inferencedeployment.yaml"
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
LWS_GROUP, LWS_VERSION, LWS_PLURAL = "leaderworkerset.x-k8s.io", "v1", "leaderworkersets"
LWS_CRD_NAME = f"{LWS_PLURAL}.{LWS_GROUP}"
LWS_SCHEMA = REPO / "tests" / "schemas" / "leaderworkerset-v1.json"  # the published API, as the operator's tests read it
NODES = "/api/v1/nodes"
NAMESPACES = "/api/v1/namespaces"

_ALL = ["list", "watch", "get", "patch", "create", "delete"]
# What the emulator serves: the operator's resources plus what kopf needs to start ("backbone").
RESOURCES: dict[str, dict[str, Any]] = {
    f"{GROUP}/{VERSION}/{PLURAL}": dict(
        kind="InferenceDeployment", singular="inferencedeployment", namespaced=True, shortnames=["infd"],
        verbs=_ALL, subresources=["status", "scale"]),
    f"{GROUP}/{VERSION}/{LORA_PLURAL}": dict(
        kind="LoRAAdapter", singular="loraadapter", namespaced=True, shortnames=["lora"], verbs=_ALL,
        subresources=["status"]),
    "apps/v1/deployments": dict(kind="Deployment", singular="deployment", namespaced=True, verbs=_ALL,
                                subresources=["status", "scale"]),
    "v1/services": dict(kind="Service", singular="service", namespaced=True, verbs=_ALL),
    "policy/v1/poddisruptionbudgets": dict(kind="PodDisruptionBudget", singular="poddisruptionbudget",
                                           namespaced=True, verbs=_ALL),
    "v1/pods": dict(kind="Pod", singular="pod", namespaced=True, verbs=_ALL, subresources=["status", "binding"]),
    "v1/nodes": dict(kind="Node", singular="node", namespaced=False, verbs=_ALL, subresources=["status"]),
    "v1/events": dict(kind="Event", singular="event", namespaced=True, verbs=_ALL),
    "v1/namespaces": dict(kind="Namespace", singular="namespace", namespaced=False, verbs=_ALL),
    # The builtin router's objects (its identity and grant) and what it discovers the daemons through.
    "v1/serviceaccounts": dict(kind="ServiceAccount", singular="serviceaccount", namespaced=True, verbs=_ALL,
                               subresources=["token"]),
    "rbac.authorization.k8s.io/v1/roles": dict(kind="Role", singular="role", namespaced=True, verbs=_ALL),
    "rbac.authorization.k8s.io/v1/rolebindings": dict(kind="RoleBinding", singular="rolebinding", namespaced=True,
                                                      verbs=_ALL),
    "discovery.k8s.io/v1/endpointslices": dict(kind="EndpointSlice", singular="endpointslice", namespaced=True,
                                               verbs=_ALL),
    "apiextensions.k8s.io/v1/customresourcedefinitions": dict(
        kind="CustomResourceDefinition", singular="customresourcedefinition", namespaced=False, verbs=_ALL),
    # LeaderWorkerSet (multi-node replicas), with its status and scale subresources as the published API has
    # them; the agent plays its controller (leaderworkerset.py), the emulator checks what is written
    # (emulator.py, against tests/schemas/leaderworkerset-v1.json).
    f"{LWS_GROUP}/{LWS_VERSION}/{LWS_PLURAL}": dict(
        kind="LeaderWorkerSet", singular="leaderworkerset", namespaced=True, shortnames=["lws"], verbs=_ALL,
        subresources=["status", "scale"]),
}


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# The path helpers are the operator's, so the runs and the operator name a resource the same way.
collection = client.collection
deployments = client.deployments
pods = client.pods
events = client.events
inferencedeployments = client.inferencedeployments
services = client.services
serviceaccounts = client.serviceaccounts
leaderworkersets = client.leaderworkersets


def endpointslices(ns: str) -> str:
    return collection("discovery.k8s.io/v1", "endpointslices", ns)


class Kube(client.KubeClient):
    """The shared client (kvpilot.operator.kube), plus what the runs need of an emulated API server:
    server-assigned metadata on create. A kubelet's DELETE with DeleteOptions is the base's
    `delete(path, grace_period=, uid=)`."""

    def __init__(self, server: str | Callable[[], kopf.ConnectionInfo], session: aiohttp.ClientSession | None = None,
                 emulated: bool = True) -> None:
        super().__init__(server, session=session, field_manager="kvpilot-e2e", timeout=10.0)
        self.url = server.rstrip("/") if isinstance(server, str) else server().server
        self.emulated = emulated  # fill in what a real API server assigns on create
        self._rv = itertools.count(1)

    async def create(self, collection: str, obj: dict[str, Any]) -> dict[str, Any]:
        if self.emulated:
            meta = obj.setdefault("metadata", {})
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", now_iso())
            meta.setdefault("generation", 1)
            meta["resourceVersion"] = str(next(self._rv))
        return await super().create(collection, obj)

    def connection(self) -> kopf.ConnectionInfo:
        """Where the API server is and how this client logs in (a pod's kubeconfig copies server and CA)."""
        return self._login()

    # --- kubectl-like helpers

    async def apply_crd(self) -> None:
        """`kubectl apply -f crds/`: the emulator serves the resources anyway; this keeps the objects around."""
        for name in CRD_FILES:
            await self.create(CRDS, crd_manifest(name))
        if self.emulated:  # the emulator's cluster has LeaderWorkerSet installed (a cluster brings its own)
            await self.create(CRDS, lws_crd_manifest())

    async def apply_cr(self, ns: str, body: dict[str, Any]) -> dict[str, Any]:
        body = {**body, "metadata": {**body.get("metadata", {}), "namespace": ns}}
        return await self.create(inferencedeployments(ns), body)

    async def cr(self, ns: str, name: str) -> dict[str, Any] | None:
        return await self.get(f"{inferencedeployments(ns)}/{name}")

    async def deployment(self, ns: str, name: str) -> dict[str, Any] | None:
        return await self.get(f"{deployments(ns)}/{name}")


def crd_manifest(name: str = CRD_NAME) -> dict[str, Any]:
    return yaml.safe_load(CRD_FILES[name].read_text())


def lws_crd_manifest() -> dict[str, Any]:
    """The LeaderWorkerSet CRD as the emulator's "installed" add-on: the names, the served version and the
    status and scale subresources of the published one (leaderworkerset.x-k8s.io/v1); the objects are checked
    against tests/schemas/leaderworkerset-v1.json by the emulator, so the schema here keeps everything. On a
    cluster, LWS is installed from its own release (and its controller runs there)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": LWS_CRD_NAME},
        "spec": {
            "group": LWS_GROUP, "scope": "Namespaced",
            "names": {"kind": "LeaderWorkerSet", "listKind": "LeaderWorkerSetList", "plural": LWS_PLURAL,
                      "singular": "leaderworkerset", "shortNames": ["lws"]},
            "versions": [{
                "name": LWS_VERSION, "served": True, "storage": True,
                "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
                "subresources": {"status": {}, "scale": {
                    "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                    "labelSelectorPath": ".status.hpaPodSelector"}},
            }],
        },
        "status": {"conditions": [{"type": "Established", "status": "True"}]},
    }


def write_kubeconfig(path: Path, url: str, token: str = "e2e-token", namespace: str = "default",
                     cluster: dict[str, Any] | None = None) -> Path:
    """A kubeconfig with one context: `url` with a bearer token; `cluster` adds CA fields."""
    cfg = {
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": url, **(cluster or {})}}],
        "users": [{"name": "kmock", "user": {"token": token}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": namespace}}],
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def example_cr() -> dict[str, Any]:
    return yaml.safe_load(EXAMPLE_CR.read_text())


def condition(obj: dict[str, Any] | None, ctype: str) -> dict[str, Any] | None:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == ctype:
            return c
    return None


def pod_ready(pod: dict[str, Any]) -> bool:
    c = condition(pod, "Ready")
    return bool(c and c.get("status") == "True")


def terminating(obj: dict[str, Any]) -> bool:
    return bool(obj.get("metadata", {}).get("deletionTimestamp"))
