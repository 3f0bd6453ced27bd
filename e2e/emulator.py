"""The kmock Kubernetes emulator on 127.0.0.1, with the pod semantics of a real API server that the node
agent relies on:

- POST pods/NAME/binding sets spec.nodeName and the PodScheduled condition (409 if already bound);
- DELETE of a pod bound to a node only marks it (deletionTimestamp, deletionGracePeriodSeconds) and holds
  it with a finalizer of the emulator's own (HOLD); the kubelet's DELETE with gracePeriodSeconds 0 then
  removes it;
- POST serviceaccounts/NAME/token (a TokenRequest, what a kubelet asks for a pod's projected token) answers
  with a token for an existing ServiceAccount, 404 otherwise. The emulator checks no token: any is fine;
- LeaderWorkerSets (leaderworkerset.x-k8s.io/v1, the add-on's API) are checked on every write against the
  published API (tests/schemas/leaderworkerset-v1.json; 422 with the errors), and their scale subresource
  is served as the API server serves a CRD's: GET and PATCH of an autoscaling/v1 Scale, whose spec.replicas
  is the object's and whose status carries status.replicas and the selector status.hpaPodSelector;
- EndpointSlice writes are refused (422) with an address a real API server refuses there: not an IP of the
  slice's addressType, unspecified, loopback, link-local (unicast or multicast). `loopback_endpoints=True`
  lets 127.0.0.0/8 through, for the pod network's loopback mode only (netns.py), where pods have no other
  address.

kmock itself serves neither (a POST to a named object is no action it knows, and a DELETE without
finalizers removes the object at once).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import functools
import ipaddress
import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import aiohttp.web
import attrs
import kmock

from .cluster import LWS_PLURAL, LWS_SCHEMA, RESOURCES, Kube

HOLD = "e2e.kvpilot.io/graceful-deletion"


@attrs.frozen
class Conflict(kmock.KubernetesError):
    status: int = 409
    reason: str = "Conflict"


def endpoint_address_errors(obj: Any, loopback_ok: bool = False) -> list[str]:
    """What kube-apiserver's EndpointSlice validation says of the slice's addresses (ValidateEndpointIP):
    each must be an IP of the addressType, and not unspecified, loopback or link-local."""
    if not isinstance(obj, dict):
        return []
    kind = obj.get("addressType", "IPv4")
    errors = []
    for i, ep in enumerate(obj.get("endpoints") or []):
        for j, raw in enumerate((ep or {}).get("addresses") or []):
            where = f"endpoints[{i}].addresses[{j}]"
            try:
                ip = ipaddress.ip_address(raw)
            except ValueError:
                errors.append(f"{where}: Invalid value: {raw!r}: must be a valid IP address")
                continue
            if kind in ("IPv4", "IPv6") and f"IPv{ip.version}" != kind:
                errors.append(f"{where}: Invalid value: {raw!r}: must be an {kind} address")
            if ip.is_unspecified:
                errors.append(f"{where}: Invalid value: {raw!r}: may not be unspecified")
            if ip.is_loopback and not loopback_ok:
                errors.append(f"{where}: Invalid value: {raw!r}: may not be in the loopback range "
                              "(127.0.0.0/8, ::1/128)")
            if ip.is_link_local:
                errors.append(f"{where}: Invalid value: {raw!r}: may not be in the link-local range "
                              "(169.254.0.0/16, fe80::/10)")
            if ip.is_multicast and (ip in ipaddress.ip_network("224.0.0.0/24") or str(ip).startswith("ff02:")):
                errors.append(f"{where}: Invalid value: {raw!r}: may not be in the link-local multicast range")
    return errors


@functools.cache
def _lws_validator() -> Any:
    import jsonschema

    return jsonschema.Draft7Validator(json.loads(LWS_SCHEMA.read_text()))


def lws_errors(obj: Any) -> list[str]:
    """What the LWS API (its CRD schema and admission webhook, as tests/schemas has them) says of an object;
    status and the server's metadata are the API server's, not the writer's."""
    if not isinstance(obj, dict):
        return ["the body is not an object"]
    body = {k: v for k, v in obj.items() if k != "status"}
    return [f"{'.'.join(str(x) for x in e.absolute_path) or '<root>'}: {e.message}"
            for e in _lws_validator().iter_errors(body)]


def _merged(old: Any, patch: Any) -> Any:
    """A JSON merge patch (RFC 7386), what kmock does with a PATCH body."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(old) if isinstance(old, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = _merged(out.get(k), v)
    return out


def scale_of(obj: dict[str, Any]) -> dict[str, Any]:
    """The autoscaling/v1 Scale of a LeaderWorkerSet (its CRD's specReplicasPath, statusReplicasPath and
    labelSelectorPath)."""
    meta, status = obj.get("metadata") or {}, obj.get("status") or {}
    out: dict[str, Any] = {
        "apiVersion": "autoscaling/v1", "kind": "Scale",
        "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion") if k in meta},
        "spec": {"replicas": int((obj.get("spec") or {}).get("replicas", 1))},
        "status": {"replicas": int(status.get("replicas", 0) or 0)},
    }
    if status.get("hpaPodSelector"):
        out["status"]["selector"] = status["hpaPodSelector"]
    return out


def _grace(request: Any, obj: dict[str, Any]) -> int:
    """The grace period a DELETE asks for: DeleteOptions body, then the query, then the pod's own."""
    body = request.data if isinstance(request.data, dict) else {}
    if body.get("gracePeriodSeconds") is not None:
        return int(body["gracePeriodSeconds"])
    if request.params.get("gracePeriodSeconds") is not None:
        return int(request.params["gracePeriodSeconds"])
    return int((obj.get("spec") or {}).get("terminationGracePeriodSeconds", 30))


class Emulator(kmock.KubernetesEmulator):
    """kmock's emulator with binding, graceful pod deletion and a request log of only the requests in flight.

    kmock records every request and, to route a new one, scans that whole log, so a run of a few minutes
    (thousands of requests) slows down quadratically. The runs never assert on past requests, so the log
    keeps just the ones in flight, which the routing of each request needs to find itself.
    """

    async def _handle(self, request: Any) -> Any:
        log = getattr(self, "_requests", None)
        if not isinstance(log, list):  # another kmock version: leave it alone
            return await self._pods_or_default(request)
        inflight: list[Any] = self.__dict__.setdefault("_e2e_inflight", [])
        inflight.append(request)
        log[:] = inflight
        try:
            return await self._pods_or_default(request)
        finally:
            inflight.remove(request)

    loopback_endpoints = False  # see the module doc: set for the loopback pod network only

    async def _pods_or_default(self, request: Any) -> Any:
        res = request.resource
        if (res is not None and res.plural == "endpointslices" and not request.subresource
                and request.method in (kmock.method.POST, kmock.method.PUT, kmock.method.PATCH)):
            errors = endpoint_address_errors(request.data, self.loopback_endpoints)
            if errors:
                raise kmock.KubernetesError(status=422, reason="Invalid", details={},
                                            message=f"EndpointSlice is invalid: {'; '.join(errors)}")
        if res is not None and res.plural == LWS_PLURAL:
            if request.subresource == "scale" and request.name:
                return await self._scale(request)
            if not request.subresource and request.method in (kmock.method.POST, kmock.method.PUT,
                                                              kmock.method.PATCH):
                await self._check_lws(request)
        if (res is not None and res.plural == "serviceaccounts" and request.name
                and request.method == kmock.method.POST and request.subresource == "token"):
            return await self._token(request)
        if res is not None and res.plural == "pods" and request.name:
            if request.method == kmock.method.POST and request.subresource == "binding":
                return await self._bind(request)
            if request.action == kmock.action.DELETE and not request.subresource:
                marked = await self._mark_deleted(request)
                if marked is not None:
                    return aiohttp.web.json_response(marked)
        return await super()._handle(request)

    def _stored(self, request: Any) -> Any:
        key = (request.resource, request.namespace, request.name)
        if key not in self._objects or self._objects[key].deleted:
            raise kmock.KubernetesObjectNotFoundError()
        return self._objects[key]

    async def _bind(self, request: Any) -> Any:
        target = ((request.data or {}).get("target") or {}).get("name")
        async with self._lock:
            obj = self._stored(request)
            node = (obj.raw.get("spec") or {}).get("nodeName")
            if node:
                raise Conflict(message=f"pod {request.name} is already assigned to node {node!r}")
            conditions = [c for c in (obj.raw.get("status") or {}).get("conditions") or []
                          if c.get("type") != "PodScheduled"]
            obj.patch({"spec": {"nodeName": target},
                       "status": {"conditions": [*conditions, {"type": "PodScheduled", "status": "True"}]}})
            await self._buses[request.resource].put({"type": "MODIFIED", "object": obj.raw})
        return aiohttp.web.json_response({"apiVersion": "v1", "kind": "Status", "status": "Success", "code": 201},
                                         status=201)

    async def _check_lws(self, request: Any) -> None:
        body = request.data
        if request.method == kmock.method.PATCH and request.name:
            key = (request.resource, request.namespace, request.name)
            async with self._lock:
                known = key in self._objects and not self._objects[key].deleted
                old = copy.deepcopy(self._objects[key].raw) if known else None
            if old is not None:  # an apply or merge patch of an existing object: check the result
                body = _merged(old, body)
        errors = lws_errors(body)
        if errors:
            raise kmock.KubernetesError(status=422, reason="Invalid", details={},
                                        message=f"LeaderWorkerSet is invalid: {'; '.join(errors)}")

    async def _scale(self, request: Any) -> Any:
        """The LWS's scale subresource: GET, or PATCH (merge) / PUT of its Scale's spec.replicas."""
        async with self._lock:
            obj = self._stored(request)
            if request.method == kmock.method.GET:
                return aiohttp.web.json_response(scale_of(obj.raw))
            if request.method not in (kmock.method.PATCH, kmock.method.PUT):
                raise kmock.KubernetesError(status=405, reason="MethodNotAllowed", details={},
                                            message=f"{request.method} of a Scale")
            scale = request.data if request.method == kmock.method.PUT else _merged(scale_of(obj.raw),
                                                                                    request.data)
            replicas = ((scale or {}).get("spec") or {}).get("replicas")
            if not isinstance(replicas, int) or replicas < 0:
                raise kmock.KubernetesError(status=422, reason="Invalid", details={},
                                            message="Scale spec.replicas must be a non-negative integer")
            obj.patch({"spec": {"replicas": replicas}})
            await self._buses[request.resource].put({"type": "MODIFIED", "object": obj.raw})
            return aiohttp.web.json_response(scale_of(obj.raw))

    async def _token(self, request: Any) -> Any:
        async with self._lock:
            self._stored(request)  # 404 for a ServiceAccount that does not exist, as the API server says
        spec = request.data if isinstance(request.data, dict) else {}
        seconds = int((spec.get("spec") or {}).get("expirationSeconds") or 3600)
        until = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=seconds)
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec.get("spec") or {},
                "status": {"token": f"e2e-sa-{request.name}-{secrets.token_hex(8)}",
                           "expirationTimestamp": until.strftime("%Y-%m-%dT%H:%M:%SZ")}}
        return aiohttp.web.json_response(body, status=201)

    async def _mark_deleted(self, request: Any) -> dict[str, Any] | None:
        """Graceful deletion of a bound pod; None lets kmock delete it (unbound, or never marked).

        kmock removes an object with a deletionTimestamp at its next change unless a finalizer holds it;
        HOLD is that finalizer, the emulator's stand-in for the API server's wait for the kubelet."""
        async with self._lock:
            obj = self._stored(request)
            raw = obj.raw
            meta = raw.get("metadata") or {}
            uid = ((request.data or {}).get("preconditions") or {}).get("uid") if isinstance(request.data, dict) \
                else None
            if uid is not None and uid != meta.get("uid"):
                raise Conflict(message=f"precondition failed: uid {uid}")
            grace = _grace(request, raw)
            finalizers = list(meta.get("finalizers") or [])
            if grace <= 0 and HOLD in finalizers:  # the kubelet's final delete
                rest = [f for f in finalizers if f != HOLD]
                obj.patch({"metadata": {"finalizers": rest}})
                if rest:
                    return obj.raw
                last = obj.raw
                obj.delete()
                await self._buses[request.resource].put({"type": "DELETED", "object": last})
                return last
            if not (raw.get("spec") or {}).get("nodeName") or grace <= 0:
                return None
            if meta.get("deletionTimestamp"):
                return raw  # already terminating: a shorter grace is not honoured here
            at = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=grace)
            obj.patch({"metadata": {"deletionTimestamp": at.strftime("%Y-%m-%dT%H:%M:%SZ"),
                                    "deletionGracePeriodSeconds": grace, "finalizers": [*finalizers, HOLD]}})
            await self._buses[request.resource].put({"type": "MODIFIED", "object": obj.raw})
            return obj.raw


@contextlib.asynccontextmanager
async def emulator(loopback_endpoints: bool = False) -> AsyncIterator[Kube]:
    """The emulator on a free port of 127.0.0.1, with our resources declared."""
    emu = Emulator()
    emu.loopback_endpoints = loopback_endpoints
    for key, info in RESOURCES.items():
        emu.resources[key] = info
    async with emu, kmock.Server(emu) as server, aiohttp.ClientSession() as session:
        yield Kube(str(server.url), session, emulated=True)
