"""The EndpointSlice controller, for the emulator only (on a cluster kube-controller-manager runs it).

For each Service with a selector it keeps discovery.k8s.io/v1 EndpointSlices labelled
`kubernetes.io/service-name`, as the controller does: one endpoint per selected pod that has an IP and has
not ended, its conditions from the pod (ready: the pod's Ready condition and not terminating; serving: Ready;
terminating: a deletionTimestamp), a targetRef to the pod, and the Service's ports with each targetPort
resolved on that pod (a named one through its container ports). Pods whose ports resolve differently go to
different slices; a Service that selects nothing keeps one empty slice. Slices of a Service that is gone,
or that no longer has a selector, are deleted.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from .cluster import Kube, endpointslices, pod_ready, services, terminating
from .load import Endpoint

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
MANAGED_BY_LABEL = "endpointslice.kubernetes.io/managed-by"
MANAGER = "e2e.kvpilot.io/node-agent"  # not the real controller's value: these slices are the stand-in's


def selects(service: dict[str, Any], pod: dict[str, Any]) -> bool:
    sel = (service.get("spec") or {}).get("selector") or {}
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return bool(sel) and all(labels.get(k) == v for k, v in sel.items())


def _container_port(pod: dict[str, Any], name: str) -> int | None:
    for ctr in (pod.get("spec") or {}).get("containers") or []:
        for p in ctr.get("ports") or []:
            if p.get("name") == name:
                return int(p["containerPort"])
    return None


def resolve_ports(service: dict[str, Any], pod: dict[str, Any]) -> list[dict[str, Any]]:
    """The Service's ports as this pod serves them; a named targetPort the pod lacks is left out."""
    out = []
    for sp in (service.get("spec") or {}).get("ports") or []:
        target = sp.get("targetPort", sp.get("port"))
        port = _container_port(pod, target) if isinstance(target, str) and not target.isdigit() else int(target)
        if port is not None:
            out.append({"name": sp.get("name", ""), "port": port, "protocol": sp.get("protocol", "TCP")})
    return out


def endpoint(pod: dict[str, Any]) -> dict[str, Any]:
    meta, spec, st = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
    term = terminating(pod)
    ep: dict[str, Any] = {
        "addresses": [st["podIP"]],
        "conditions": {"ready": pod_ready(pod) and not term, "serving": pod_ready(pod), "terminating": term},
        "targetRef": {"kind": "Pod", "namespace": meta["namespace"], "name": meta["name"], "uid": meta.get("uid", "")},
    }
    if spec.get("nodeName"):
        ep["nodeName"] = spec["nodeName"]
    return ep


def _live(pod: dict[str, Any]) -> bool:
    st = pod.get("status") or {}
    return bool(st.get("podIP")) and st.get("phase") not in ("Succeeded", "Failed")


def _slice_name(service: str, ports: list[dict[str, Any]]) -> str:
    digest = hashlib.sha256(json.dumps(ports, sort_keys=True).encode()).hexdigest()[:5]
    return f"{service}-{digest}"


def desired(service: dict[str, Any], pod_list: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """name -> the EndpointSlice manifest, for one Service with a selector."""
    meta = service["metadata"]
    groups: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]] = {}
    for pod in sorted((p for p in pod_list if selects(service, p) and _live(p)), key=lambda p: p["metadata"]["name"]):
        ports = resolve_ports(service, pod)
        groups.setdefault(json.dumps(ports, sort_keys=True), (ports, []))[1].append(endpoint(pod))
    if not groups:
        groups[json.dumps([])] = ([], [])
    owner = {"apiVersion": "v1", "kind": "Service", "name": meta["name"], "uid": meta.get("uid", ""),
             "controller": True, "blockOwnerDeletion": True}
    out = {}
    for ports, eps in groups.values():
        name = _slice_name(meta["name"], ports)
        out[name] = {
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "namespace": meta["namespace"], "ownerReferences": [owner],
                         "labels": {SERVICE_NAME_LABEL: meta["name"], MANAGED_BY_LABEL: MANAGER}},
            "addressType": "IPv4", "endpoints": eps, "ports": ports,
        }
    return out


def _differs(live: dict[str, Any], want: dict[str, Any]) -> bool:
    return any(live.get(k) != want.get(k) for k in ("addressType", "endpoints", "ports"))


class EndpointSliceController:
    def __init__(self, kube: Kube, ns: str) -> None:
        self.kube = kube
        self.ns = ns
        self.writes = 0  # creates, patches and deletes: a pass that changes nothing writes nothing

    async def sync(self, pod_list: list[dict[str, Any]]) -> None:
        want: dict[str, dict[str, Any]] = {}
        for svc in await self.kube.list(services(self.ns)):
            if (svc.get("spec") or {}).get("selector"):
                want.update(desired(svc, pod_list))
        live = {s["metadata"]["name"]: s for s in await self.kube.list(endpointslices(self.ns))
                if ((s.get("metadata") or {}).get("labels") or {}).get(MANAGED_BY_LABEL) == MANAGER}
        for name, body in want.items():
            if name not in live:
                await self.kube.create(endpointslices(self.ns), body)
            elif _differs(live[name], body):
                # A merge patch replaces lists whole: the endpoints and ports are exactly these afterwards.
                await self.kube.patch(f"{endpointslices(self.ns)}/{name}",
                                      {k: body[k] for k in ("endpoints", "ports")})
            else:
                continue
            self.writes += 1
        for name in live.keys() - want.keys():
            await self.kube.delete(f"{endpointslices(self.ns)}/{name}")
            self.writes += 1


async def service_endpoints(kube: Kube, ns: str, service: str) -> list[Endpoint]:
    """The Service's ready, non-terminating endpoints from its EndpointSlices: where a client in the cluster
    (kube-proxy) sends a request."""
    eps = []
    for s in await kube.list(endpointslices(ns), label_selector=f"{SERVICE_NAME_LABEL}={service}"):
        if ((s.get("metadata") or {}).get("labels") or {}).get(SERVICE_NAME_LABEL) != service:
            continue  # the emulator does not filter by label
        port = next((p["port"] for p in s.get("ports") or [] if p.get("name") == "http"), None)
        for ep in s.get("endpoints") or []:
            cond = ep.get("conditions") or {}
            if port and cond.get("ready") is not False and not cond.get("terminating"):
                name = (ep.get("targetRef") or {}).get("name") or ep["addresses"][0]
                eps.append(Endpoint(name, f"http://{ep['addresses'][0]}:{port}"))
    return sorted(eps, key=lambda e: e.pod)
