"""The set of ready replicas: a static list (dev, tests) or the Service's EndpointSlices, listed then watched."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from .kube import KubeClient, KubeError

log = logging.getLogger("kvpilot.router.endpoints")

SERVICE_NAME_LABEL = "kubernetes.io/service-name"


@dataclass(frozen=True, order=True)
class Endpoint:
    name: str  # stable identity: the pod name, else host:port (the consistent hash keys on it)
    url: str  # http://host:port, no trailing slash


class EndpointSet:
    """The ready endpoints now. Waiters (held requests) are woken when the first one appears."""

    def __init__(self) -> None:
        self._eps: dict[str, Endpoint] = {}
        self._nonempty = asyncio.Event()
        self.on_removed: list[Callable[[Endpoint], None]] = []

    def __len__(self) -> int:
        return len(self._eps)

    def all(self) -> list[Endpoint]:
        return list(self._eps.values())

    def get(self, name: str) -> Endpoint | None:
        return self._eps.get(name)

    def replace(self, endpoints: Iterable[Endpoint]) -> None:
        new = {e.name: e for e in endpoints}
        gone = [e for n, e in self._eps.items() if new.get(n) != e]
        if gone or new.keys() != self._eps.keys():
            log.info("endpoints", extra={"fields": {"ready": sorted(new), "removed": [e.name for e in gone]}})
        self._eps = new
        for e in gone:
            for cb in self.on_removed:
                cb(e)
        if new:
            self._nonempty.set()
        else:
            self._nonempty.clear()

    async def wait_nonempty(self, timeout: float) -> bool:
        if self._eps:
            return True
        try:
            await asyncio.wait_for(self._nonempty.wait(), timeout)
        except TimeoutError:
            return False
        return bool(self._eps)


def parse_static(spec: str) -> list[Endpoint]:
    """'http://10.0.0.1:8000,127.0.0.1:8001' -> endpoints named host:port."""
    out = []
    for raw in (s.strip() for s in spec.split(",")):
        if not raw:
            continue
        url = raw if "://" in raw else f"http://{raw}"
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
            raise ValueError(f"endpoint {raw!r}: expected http://host:port")
        out.append(Endpoint(name=parts.netloc, url=f"{parts.scheme}://{parts.netloc}"))
    return out


def slice_endpoints(slice_: dict[str, Any], port_name: str | None) -> list[Endpoint]:
    """The ready addresses of one EndpointSlice, on the named port (or its only/first TCP port)."""
    if slice_.get("addressType") not in ("IPv4", "IPv6"):
        return []
    ports = [p for p in slice_.get("ports") or [] if p.get("protocol", "TCP") == "TCP" and p.get("port")]
    if port_name:
        ports = [p for p in ports if p.get("name") == port_name]
    if not ports:
        return []
    port = int(ports[0]["port"])
    out = []
    for ep in slice_.get("endpoints") or []:
        cond = ep.get("conditions") or {}
        # ready unset means unknown, which the API says to treat as ready; terminating pods report false
        if cond.get("ready") is False or cond.get("terminating") is True:
            continue
        for addr in (ep.get("addresses") or [])[:1]:  # all addresses of one endpoint are the same pod
            host = f"[{addr}]" if ":" in addr else addr
            ref = ep.get("targetRef") or {}
            name = ref.get("name") if ref.get("kind", "Pod") == "Pod" and ref.get("name") else f"{host}:{port}"
            out.append(Endpoint(name=name, url=f"http://{host}:{port}"))
    return out


class SliceWatcher:
    """Lists then watches the Service's EndpointSlices; each change replaces the EndpointSet."""

    def __init__(self, kube: KubeClient, namespace: str, service: str, target: EndpointSet,
                 port_name: str | None = None, backoff: float = 1.0) -> None:
        self.kube = kube
        self.path = f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
        self.service = service
        self.selector = f"{SERVICE_NAME_LABEL}={service}"
        self.target = target
        self.port_name = port_name
        self.backoff = backoff
        self.slices: dict[str, dict[str, Any]] = {}
        self.synced = asyncio.Event()

    def _ours(self, slice_: dict[str, Any]) -> bool:
        # the server filters by the selector already; checking again costs nothing and guards emulators
        labels = (slice_.get("metadata") or {}).get("labels") or {}
        return labels.get(SERVICE_NAME_LABEL) == self.service

    def _publish(self) -> None:
        eps: dict[str, Endpoint] = {}
        for s in self.slices.values():  # one pod can sit in two slices for a moment: dedupe by name
            for e in slice_endpoints(s, self.port_name):
                eps[e.name] = e
        self.target.replace(eps.values())

    async def _list(self) -> str:
        result = await self.kube.get(self.path, {"labelSelector": self.selector})
        self.slices = {s["metadata"]["name"]: s for s in result.get("items") or [] if self._ours(s)}
        self._publish()
        self.synced.set()
        return str((result.get("metadata") or {}).get("resourceVersion") or "")

    async def _watch(self, rv: str) -> None:
        params = {"labelSelector": self.selector, "allowWatchBookmarks": "true", "timeoutSeconds": "300"}
        if rv:
            params["resourceVersion"] = rv
        async for ev in self.kube.watch(self.path, params):
            kind, obj = ev.get("type"), ev.get("object") or {}
            if kind == "ERROR":  # 410 Gone and friends: start over with a fresh list
                raise KubeError(int(obj.get("code") or 500), str(obj.get("message")))
            if kind in ("ADDED", "MODIFIED") and self._ours(obj):
                self.slices[obj["metadata"]["name"]] = obj
            elif kind in ("DELETED", "MODIFIED"):  # MODIFIED here: relabelled away from the Service
                self.slices.pop(obj["metadata"]["name"], None)
            else:  # BOOKMARK (only a resourceVersion) or something we do not know
                continue
            self._publish()

    async def run(self) -> None:
        """Forever: list, watch until the stream ends or fails, list again. Keeps the last set on errors."""
        while True:
            started = time.monotonic()
            try:
                rv = await self._list()
                await self._watch(rv)
                if time.monotonic() - started < self.backoff:  # a watch that ends at once must not spin
                    await asyncio.sleep(self.backoff)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the API server restarting or a network blip must not end discovery
                err = f"{type(exc).__name__}: {exc}"
                log.warning("endpointslice watch failed; retrying: %s", err, extra={"fields": {"error": err}})
                await asyncio.sleep(self.backoff)
