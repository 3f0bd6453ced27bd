"""The Kubernetes API for the end-to-end runs: the kmock emulator served on 127.0.0.1, and a small client
that plays `kubectl` (apply, get, list, delete) and the API server's bookkeeping the emulator lacks.

kmock stores objects as plain JSON and merges patches. A real API server also sets uid, generation,
resourceVersion and creationTimestamp; `Kube.create` fills those in so the operator sees what it would see
on a cluster.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import yaml

GROUP, VERSION, PLURAL = "kvpilot.io", "v1alpha1", "inferencedeployments"
REPO = Path(__file__).resolve().parent.parent
CRD_FILE = REPO / "crds" / "inferencedeployment.yaml"
EXAMPLE_CR = REPO / "examples" / "inferencedeployment.yaml"

_ALL = ["list", "watch", "get", "patch", "create", "delete"]
# What the emulator serves: the operator's resources plus what kopf needs to start ("backbone").
RESOURCES: dict[str, dict[str, Any]] = {
    f"{GROUP}/{VERSION}/{PLURAL}": dict(
        kind="InferenceDeployment", singular="inferencedeployment", namespaced=True, shortnames=["infd"],
        verbs=_ALL, subresources=["status", "scale"]),
    "apps/v1/deployments": dict(kind="Deployment", singular="deployment", namespaced=True, verbs=_ALL,
                                subresources=["status", "scale"]),
    "v1/services": dict(kind="Service", singular="service", namespaced=True, verbs=_ALL),
    "policy/v1/poddisruptionbudgets": dict(kind="PodDisruptionBudget", singular="poddisruptionbudget",
                                           namespaced=True, verbs=_ALL),
    "v1/pods": dict(kind="Pod", singular="pod", namespaced=True, verbs=_ALL, subresources=["status"]),
    "v1/events": dict(kind="Event", singular="event", namespaced=True, verbs=_ALL),
    "v1/namespaces": dict(kind="Namespace", singular="namespace", namespaced=False, verbs=_ALL),
    "apiextensions.k8s.io/v1/customresourcedefinitions": dict(
        kind="CustomResourceDefinition", singular="customresourcedefinition", namespaced=False, verbs=_ALL),
}


class ApiError(Exception):
    def __init__(self, method: str, path: str, status: int, text: str) -> None:
        super().__init__(f"{method} {path}: HTTP {status}: {text[:300]}")
        self.status = status


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def collection(api_version: str, plural: str, ns: str | None) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    return f"{base}/namespaces/{ns}/{plural}" if ns else f"{base}/{plural}"


def deployments(ns: str) -> str:
    return collection("apps/v1", "deployments", ns)


def pods(ns: str) -> str:
    return collection("v1", "pods", ns)


def events(ns: str) -> str:
    return collection("v1", "events", ns)


def inferencedeployments(ns: str) -> str:
    return collection(f"{GROUP}/{VERSION}", PLURAL, ns)


class Kube:
    """HTTP access to the emulator, as kubectl or a controller would do it."""

    def __init__(self, url: str, session: aiohttp.ClientSession) -> None:
        self.url = url.rstrip("/")
        self.session = session
        self._rv = itertools.count(1)

    async def request(self, method: str, path: str, body: Any = None,
                      content_type: str = "application/merge-patch+json") -> Any:
        headers = {"Content-Type": content_type if method == "PATCH" else "application/json"}
        async with self.session.request(method, self.url + path, json=body, headers=headers,
                                        timeout=aiohttp.ClientTimeout(total=10)) as resp:
            text = await resp.text()
            if resp.status >= 400:
                raise ApiError(method, path, resp.status, text)
            return await resp.json(content_type=None) if text else None

    async def get(self, path: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", path)
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def list(self, path: str) -> list[dict[str, Any]]:
        return list((await self.request("GET", path) or {}).get("items") or [])

    async def create(self, path: str, obj: dict[str, Any]) -> dict[str, Any]:
        """POST with the metadata an API server assigns on creation."""
        meta = obj.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", now_iso())
        meta.setdefault("generation", 1)
        meta["resourceVersion"] = str(next(self._rv))
        return await self.request("POST", path, obj)

    async def patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        return await self.request("PATCH", path, patch)

    async def delete(self, path: str) -> bool:
        try:
            await self.request("DELETE", path)
            return True
        except ApiError as e:
            if e.status == 404:
                return False
            raise

    # --- kubectl-like helpers

    async def apply_crd(self) -> None:
        """`kubectl apply -f crds/`: the emulator serves the resource anyway; this keeps the object around."""
        crd = yaml.safe_load(CRD_FILE.read_text())
        await self.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)

    async def apply_cr(self, ns: str, body: dict[str, Any]) -> dict[str, Any]:
        body = {**body, "metadata": {**body.get("metadata", {}), "namespace": ns}}
        return await self.create(inferencedeployments(ns), body)

    async def cr(self, ns: str, name: str) -> dict[str, Any] | None:
        return await self.get(f"{inferencedeployments(ns)}/{name}")

    async def deployment(self, ns: str, name: str) -> dict[str, Any] | None:
        return await self.get(f"{deployments(ns)}/{name}")


def write_kubeconfig(path: Path, url: str) -> Path:
    cfg = {
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": url}}],
        "users": [{"name": "kmock", "user": {"token": "e2e-token"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": "default"}}],
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


class Emulator(kmock.KubernetesEmulator):
    """kmock's emulator, with a request log that holds only the requests being served.

    kmock records every request and, to route a new one, scans that whole log, so a run of a few minutes
    (thousands of requests) slows down quadratically. The runs never assert on past requests, so the log
    keeps just the ones in flight, which the routing of each request needs to find itself.
    """

    async def _handle(self, request: Any) -> Any:
        log = getattr(self, "_requests", None)
        if not isinstance(log, list):  # another kmock version: leave it alone
            return await super()._handle(request)
        inflight: list[Any] = self.__dict__.setdefault("_e2e_inflight", [])
        inflight.append(request)
        log[:] = inflight
        try:
            return await super()._handle(request)
        finally:
            inflight.remove(request)


@contextlib.asynccontextmanager
async def emulator() -> AsyncIterator[Kube]:
    """The kmock Kubernetes emulator on a free port of 127.0.0.1, with our resources declared."""
    emu = Emulator()
    for key, info in RESOURCES.items():
        emu.resources[key] = info
    async with emu, kmock.Server(emu) as server, aiohttp.ClientSession() as session:
        yield Kube(str(server.url), session)


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
