"""kmock's KubernetesEmulator made stricter, closer to what kube-apiserver does on writes.

On top of kmock it records every API call (and what admission and RBAC escalation prevention authorize
besides), fills in server-owned metadata (uid, creationTimestamp, resourceVersion, generation), answers
409 to stale resourceVersions, keeps status and spec apart where a resource has a status subresource,
serves the scale subresource, speaks the patch types with their own semantics, prunes or rejects fields a
CRD does not declare, applies CRD defaults, filters lists and watches by label selector, and
garbage-collects children of deleted owners. README.md lists what is still different from a real server.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import datetime
import ipaddress
import itertools
import json
import uuid
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
import yaml

from kvpilot.operator import crd

from . import crd_checks, selectors
from .calls import RBAC_GROUP, ApiCall, escalation_checks, owner_checks, parse_call

SMP = "application/strategic-merge-patch+json"
APPLY = "application/apply-patch+yaml"
JSON_PATCH = "application/json-patch+json"
# Strategic merge patch: lists merged by key instead of replaced (from the core types' patchMergeKey tags).
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
              "volumeMounts": "mountPath", "imagePullSecrets": "name", "conditions": "type",
              "ports": ("containerPort", "port"), "tolerations": None}


def _error(status: int, reason: str, message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=status, reason=reason, message=message, details={})


def merge_patch(old: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: null removes, objects merge, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(old) if isinstance(old, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _merge_key(field: str, items: list[Any]) -> str | None:
    key = MERGE_KEYS.get(field)
    if isinstance(key, tuple):
        return next((k for k in key if any(isinstance(i, dict) and k in i for i in items)), None)
    return key


def strategic_merge(old: Any, patch: Any) -> Any:
    """Strategic merge patch for built-in types: like a merge patch, but keyed lists merge item by item
    and `$patch: delete` removes an item."""
    if not isinstance(patch, dict) or not isinstance(old, dict):
        return copy.deepcopy(patch)
    out = dict(old)
    for field, value in patch.items():
        key = _merge_key(field, [*(old.get(field) or []), *value]) if isinstance(value, list) else None
        if value is None:
            out.pop(field, None)
        elif key and isinstance(old.get(field), list):
            out[field] = _merge_list(old[field], value, key)
        elif isinstance(value, dict):
            out[field] = strategic_merge(old.get(field) or {}, value)
        else:
            out[field] = copy.deepcopy(value)
    return out


def _merge_list(old: list[Any], patch: list[Any], key: str) -> list[Any]:
    out = [copy.deepcopy(i) for i in old]
    for item in patch:
        index = next((n for n, o in enumerate(out) if isinstance(o, dict) and o.get(key) == item.get(key)), None)
        if item.get("$patch") == "delete":
            if index is not None:
                del out[index]
        elif index is None:
            out.append(copy.deepcopy(item))
        else:
            out[index] = strategic_merge(out[index], item)
    return out


def endpoint_address_errors(obj: Any) -> list[str]:
    """kube-apiserver's EndpointSlice address validation (ValidateEndpointIP): an IP of the slice's
    addressType, and not unspecified, loopback (127.0.0.0/8, ::1) or link-local (169.254.0.0/16, fe80::/10,
    224.0.0.0/24, ff02::/16)."""
    kind = obj.get("addressType", "IPv4") if isinstance(obj, dict) else "IPv4"
    errors = []
    for i, ep in enumerate((obj.get("endpoints") if isinstance(obj, dict) else None) or []):
        for j, raw in enumerate((ep or {}).get("addresses") or []):
            where = f"endpoints[{i}].addresses[{j}]: Invalid value: {raw!r}"
            try:
                ip = ipaddress.ip_address(raw)
            except ValueError:
                errors.append(f"{where}: must be a valid IP address")
                continue
            if kind in ("IPv4", "IPv6") and f"IPv{ip.version}" != kind:
                errors.append(f"{where}: must be an {kind} address")
            bad = [("unspecified", ip.is_unspecified), ("in the loopback range", ip.is_loopback),
                   ("in the link-local range", ip.is_link_local),
                   ("in the link-local multicast range", ip.is_multicast and (
                       ip in ipaddress.ip_network("224.0.0.0/24") or ip in ipaddress.ip_network("ff02::/16")))]
            errors += [f"{where}: may not be {what}" for what, hit in bad if hit]
    return errors


def _spec_part(obj: dict[str, Any]) -> dict[str, Any]:
    # What metadata.generation counts: everything but metadata and status.
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


def _key(resource: Any) -> str:
    return f"{resource.group}/{resource.version}/{resource.plural}" if resource.group else \
        f"{resource.version}/{resource.plural}"


@attrs.define(kw_only=True)
class StrictEmulator(kmock.KubernetesEmulator):
    catalog: dict[str, dict[str, Any]] = attrs.field(factory=dict)  # "group/version/plural" -> info
    schemas: dict[str, dict[str, Any]] = attrs.field(factory=dict)  # the same keys -> openAPIV3Schema
    validate: bool = False  # also reject CRs that fail their schema or CEL rules (422), as a server does
    calls: list[ApiCall] = attrs.field(factory=list, init=False)
    _versions: Any = attrs.field(factory=lambda: itertools.count(1), init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for key, info in self.catalog.items():
            self.resources[key] = info

    def _plural_of(self) -> dict[tuple[str, str], str]:
        out = {}
        for key, info in self.catalog.items():
            parts = key.split("/")
            out[(parts[0] if len(parts) == 3 else "", info["kind"])] = parts[-1]
        return out

    def _record(self, request: kmock.Request) -> ApiCall | None:
        auth = request.headers.get("Authorization", "")
        call = parse_call(request.method.value, request.url.path, request.params, auth.partition(" ")[2])
        if call is not None:
            self.calls.append(call)
            self.calls += owner_checks(call, request.data, self._plural_of())
        return call

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        # kmock cannot parse /api/v1/namespaces[/name] (it reads "namespaces" as a namespace prefix).
        parts = [p for p in raw_request.path.split("/") if p]
        if parts[:3] == ["api", "v1", "namespaces"] and len(parts) <= 4 and raw_request.method == "GET":
            return await self._namespaces(raw_request, parts[3] if len(parts) == 4 else None)
        return await super().__call__(raw_request)

    async def _namespaces(self, raw: aiohttp.web.BaseRequest, name: str | None) -> aiohttp.web.StreamResponse:
        """Namespaces exist where objects do (and `default`): enough for kopf's namespace observer."""
        auth = raw.headers.get("Authorization", "")
        call = parse_call("GET", raw.path, dict(raw.query), auth.partition(" ")[2])
        assert call is not None
        self.calls.append(call)
        known = sorted({"default"} | {ns for (_, ns, _), v in self.objects.items() if ns and not v.deleted})
        items = [{"apiVersion": "v1", "kind": "Namespace", "status": {"phase": "Active"},
                  "metadata": {"name": ns, "uid": f"ns-{ns}", "resourceVersion": "1"}} for ns in known]
        if name is not None:
            found = [i for i in items if i["metadata"]["name"] == name]
            if not found:
                return await self._render_error(kmock.KubernetesObjectNotFoundError())
            return aiohttp.web.json_response(found[0])
        if call.verb == "list":
            return aiohttp.web.json_response({"apiVersion": "v1", "kind": "NamespaceList", "items": items,
                                              "metadata": {"resourceVersion": "1"}})
        # A watch: the namespaces now, then nothing until the server's timeout ends the stream.
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(raw)
        for item in items:
            await response.write(json.dumps({"type": "ADDED", "object": item}).encode() + b"\n")
        await asyncio.sleep(float(raw.query.get("timeoutSeconds", 10)))
        await response.write_eof()
        return response

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        call = self._record(request)
        known = request.resource is not None and _key(request.resource) in self.catalog
        if call is not None and known:
            if call.subresource == "scale" and call.verb in ("get", "patch", "update"):
                return await self._scale(request, call)
            if call.verb in ("create", "update", "patch"):
                return await self._write(request, call)
            if call.verb == "delete" and call.name is not None:
                response = await super()._handle(request)
                await self._collect_garbage()
                return response
            if call.verb == "list":
                self._check_selector(request)
        return await super()._handle(request)

    # --- reads ------------------------------------------------------------------------------------------

    @staticmethod
    def _check_selector(request: kmock.Request) -> None:
        try:
            selectors.parse(request.params.get("labelSelector"))
        except ValueError as e:
            raise _error(400, "BadRequest", str(e)) from e

    async def _serve_list(self, request: kmock.Request) -> Any:
        result = await super()._serve_list(request)
        match = selectors.parse(request.params.get("labelSelector"))
        result["items"] = [o for o in result["items"] if match((o.get("metadata") or {}).get("labels") or {})]
        result["metadata"]["resourceVersion"] = str(next(self._versions))
        return result

    async def _serve_watch(self, request: kmock.Request) -> Any:
        match = selectors.parse(request.params.get("labelSelector"))
        async for event in super()._serve_watch(request):
            obj = event.get("object") if isinstance(event, dict) else None
            if obj is None or match((obj.get("metadata") or {}).get("labels") or {}):
                yield event

    # --- writes ---------------------------------------------------------------------------------------

    def _current(self, resource: Any, namespace: str | None, name: str | None) -> dict[str, Any] | None:
        key = (resource, namespace, name)
        if name is None or key not in self.objects or self.objects[key].deleted:
            return None
        return copy.deepcopy(self.objects[key].raw)

    async def _write(self, request: kmock.Request, call: ApiCall) -> aiohttp.web.StreamResponse:
        body = request.data if request.data is not None else yaml.safe_load(request.text or "null")
        if not isinstance(body, dict | list):
            raise _error(400, "BadRequest", "the request body is not a JSON object")
        info = self.catalog[_key(request.resource)]
        name = call.name
        if name is None and isinstance(body, dict):
            name = (body.get("metadata") or {}).get("name")
        async with self._lock:
            old = self._current(request.resource, call.namespace, name)
            if call.verb == "create":
                if old is not None:
                    raise _error(409, "AlreadyExists", f"{call.resource} {name!r} already exists")
                new = self._created(body, call, info)
            elif old is None:
                if request.headers.get("Content-Type", "").split(";")[0] != APPLY or call.subresource:
                    raise kmock.KubernetesObjectNotFoundError()
                # Server-side apply creates an absent object, and the server authorizes that as a create.
                self.calls.append(dataclasses.replace(call, verb="create"))
                new = self._created(body, call, info)
            else:
                new = self._updated(old, body, request, call, info)
            new = self._admit_custom(request, new, old)
            if request.resource.plural == "endpointslices" and (errors := endpoint_address_errors(new)):
                raise _error(422, "Invalid", f"EndpointSlice {name!r} is invalid: {'; '.join(errors)}")
            self.calls += escalation_checks(call, new, self._role_rules)
            return await self._store(request, call.namespace, new, old)

    def _role_rules(self, namespace: str | None, kind: str, name: str) -> list[dict[str, Any]] | None:
        plural = {"Role": "roles", "ClusterRole": "clusterroles"}.get(kind)
        for (resource, ns, n), value in self.objects.items():
            if (resource.group, resource.plural, ns, n) == (RBAC_GROUP, plural, namespace, name) and not value.deleted:
                return value.raw.get("rules") or []
        return None

    def _created(self, body: dict[str, Any], call: ApiCall, info: dict[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if call.namespace is not None and meta.get("namespace", call.namespace) != call.namespace:
            raise _error(400, "BadRequest", "the namespace of the object does not match the request's")
        if info.get("namespaced"):
            meta["namespace"] = call.namespace
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise _error(422, "Invalid", "metadata.name or metadata.generateName is required")
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        meta.pop("resourceVersion", None)
        meta.setdefault("uid", str(uuid.uuid4()))  # kept when given: tests pin owner references to it
        meta["creationTimestamp"] = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        meta["generation"] = 1
        meta.pop("deletionTimestamp", None)
        if "status" in info.get("subresources", ()):
            obj.pop("status", None)  # a create through the main resource sets no status
        return obj

    def _updated(self, old: dict[str, Any], body: Any, request: kmock.Request, call: ApiCall,
                 info: dict[str, Any]) -> dict[str, Any]:
        sent_version = (body.get("metadata") or {}).get("resourceVersion") if isinstance(body, dict) else None
        if call.verb == "update" and not sent_version and _key(request.resource) in self.schemas:
            raise _error(422, "Invalid", "metadata.resourceVersion must be specified for an update")
        if sent_version and sent_version != old["metadata"].get("resourceVersion"):
            raise _error(409, "Conflict", "Operation cannot be fulfilled: the object has been modified; "
                                          "please apply your changes to the latest version and try again")
        candidate = body if call.verb == "update" else self._patched(old, body, request)
        if call.subresource == "status":
            new = {**old, "status": candidate.get("status")}
            new = {k: v for k, v in new.items() if v is not None}
        elif call.subresource:
            raise kmock.KubernetesNotFoundError(reason="NotFound", message=f"no subresource {call.subresource}")
        else:
            new = copy.deepcopy(candidate)
            if "status" in info.get("subresources", ()):
                new.pop("status", None)  # the main resource ignores status
                if "status" in old:
                    new["status"] = old["status"]
        new["metadata"] = self._kept_metadata(old, new, call)
        return new

    @staticmethod
    def _kept_metadata(old: dict[str, Any], new: dict[str, Any], call: ApiCall) -> dict[str, Any]:
        if call.subresource == "status":
            return copy.deepcopy(old["metadata"])  # status writes change nothing else
        meta = dict(new.get("metadata") or {})
        for field in ("uid", "creationTimestamp", "name", "namespace", "deletionTimestamp", "generation"):
            if field in old["metadata"]:
                meta[field] = old["metadata"][field]
            else:
                meta.pop(field, None)
        if _spec_part(new) != _spec_part(old):
            meta["generation"] = old["metadata"].get("generation", 1) + 1
        return meta

    def _patched(self, old: dict[str, Any], body: Any, request: kmock.Request) -> dict[str, Any]:
        ctype = request.headers.get("Content-Type", "application/merge-patch+json").split(";")[0].strip()
        if ctype == JSON_PATCH:
            try:
                return jsonpatch.apply_patch(old, body)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
                raise _error(422, "Invalid", f"the JSON patch does not apply: {e}") from e
        if not isinstance(body, dict):
            raise _error(400, "BadRequest", "a merge patch must be a JSON object")
        if ctype == SMP:
            if _key(request.resource) in self.schemas:
                raise _error(415, "UnsupportedMediaType", "strategic merge patch is not supported on custom "
                                                          "resources: use a merge patch or server-side apply")
            return strategic_merge(old, body)
        return merge_patch(old, body)  # merge patch; server-side apply is approximated by it (README.md)

    def _admit_custom(self, request: kmock.Request, new: dict[str, Any], old: dict[str, Any] | None) -> dict:
        schema = self.schemas.get(_key(request.resource))
        if schema is None:
            return new
        pruned = crd_checks.prune_object(new, schema)
        if pruned != new and request.params.get("fieldValidation") not in ("Ignore", "Warn"):
            unknown = sorted(_unknown_paths(new, pruned))
            raise _error(422, "Invalid", f"unknown fields (the CRD prunes them): {', '.join(unknown)}")
        new = crd.apply_defaults(pruned, schema)
        if self.validate:
            errors = [*crd_checks.schema_errors(new.get("spec"), schema["properties"]["spec"], "spec."),
                      *crd_checks.cel_errors(new, schema, old)]
            if errors:
                raise _error(422, "Invalid", "; ".join(errors))
        return new

    async def _store(self, request: kmock.Request, namespace: str | None, new: dict[str, Any],
                     old: dict[str, Any] | None) -> aiohttp.web.StreamResponse:
        meta = new["metadata"]
        meta["resourceVersion"] = str(next(self._versions))
        key = (request.resource, namespace, meta["name"])
        if key in self.objects:
            self.objects[key].create(copy.deepcopy(new))
        else:
            self.objects[key] = copy.deepcopy(new)
        bus = self._buses[request.resource]
        await bus.put({"type": "ADDED" if old is None else "MODIFIED", "object": copy.deepcopy(new)})
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self.objects[key].delete()  # the last finalizer is gone: the object goes
            await bus.put({"type": "DELETED", "object": copy.deepcopy(new)})
        return aiohttp.web.json_response(new, status=201 if old is None else 200)

    async def _collect_garbage(self) -> None:
        """Background cascading deletion: objects whose owner is gone go too."""
        async with self._lock:
            while True:
                alive = {o["metadata"].get("uid") for o in (v.raw for v in self.objects.values() if not v.deleted)}
                orphans = [(key, v) for key, v in self.objects.items() if not v.deleted
                           and any(r.get("uid") not in alive for r in v.raw["metadata"].get("ownerReferences") or [])]
                if not orphans:
                    return
                for (resource, _, _), value in orphans:
                    raw = copy.deepcopy(value.raw)
                    value.delete()
                    await self._buses[resource].put({"type": "DELETED", "object": raw})

    # --- scale ------------------------------------------------------------------------------------------

    async def _scale(self, request: kmock.Request, call: ApiCall) -> aiohttp.web.StreamResponse:
        info = self.catalog[_key(request.resource)]
        if "scale" not in info.get("subresources", ()):
            raise kmock.KubernetesNotFoundError(reason="NotFound", message="no scale subresource")
        async with self._lock:
            old = self._current(request.resource, call.namespace, call.name)
            if old is None:
                raise kmock.KubernetesObjectNotFoundError()
            scale = _scale_of(old)
            if call.verb == "get":
                return aiohttp.web.json_response(scale)
            changed = request.data if call.verb == "update" else self._patched(scale, request.data, request)
            replicas = (changed.get("spec") or {}).get("replicas")
            if not isinstance(replicas, int) or replicas < 0:
                raise _error(422, "Invalid", "spec.replicas must be a non-negative integer")
            new = copy.deepcopy(old)
            new.setdefault("spec", {})["replicas"] = replicas
            new["metadata"] = self._kept_metadata(old, new, dataclasses.replace(call, subresource=""))
            await self._store(request, call.namespace, new, old)
            return aiohttp.web.json_response(_scale_of(new))


def _scale_of(obj: dict[str, Any]) -> dict[str, Any]:
    status = obj.get("status") or {}
    selector = status.get("selector")
    if selector is None and isinstance(obj.get("spec", {}).get("selector"), dict):
        labels = obj["spec"]["selector"].get("matchLabels") or {}
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    meta = obj["metadata"]
    return {"apiVersion": "autoscaling/v1", "kind": "Scale",
            "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion") if k in meta},
            "spec": {"replicas": (obj.get("spec") or {}).get("replicas", 0)},
            "status": {"replicas": status.get("replicas", 0), **({"selector": selector} if selector else {})}}


def _unknown_paths(value: Any, pruned: Any, path: str = "") -> list[str]:
    if isinstance(value, dict) and isinstance(pruned, dict):
        out = [f"{path}{k}" for k in value if k not in pruned]
        for k in value.keys() & pruned.keys():
            out += _unknown_paths(value[k], pruned[k], f"{path}{k}.")
        return out
    if isinstance(value, list) and isinstance(pruned, list):
        return [p for i, (v, q) in enumerate(zip(value, pruned, strict=False))
                for p in _unknown_paths(v, q, f"{path}{i}.")]
    return []
