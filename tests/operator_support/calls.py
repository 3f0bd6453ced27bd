"""API calls as the API server's authorizer sees them: verb, group, resource, subresource, namespace, name."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class ApiCall:
    verb: str  # get, list, watch, create, update, patch, delete, deletecollection
    group: str  # "" for the core group
    version: str
    resource: str  # the plural
    subresource: str = ""
    namespace: str | None = None  # None: a cluster-scope request
    name: str | None = None
    method: str = ""  # the HTTP method, or "admission" for checks an admission plugin makes
    path: str = ""
    user: str = ""  # the bearer token's owner: "" for the tests' own calls, which carry no token

    @property
    def full_resource(self) -> str:
        return f"{self.resource}/{self.subresource}" if self.subresource else self.resource

    def __str__(self) -> str:
        where = f"namespace {self.namespace}" if self.namespace is not None else "cluster scope"
        return f"{self.verb} {self.group or 'core'}/{self.full_resource} in {where} ({self.method} {self.path})"


def _verb(method: str, named: bool, query: Mapping[str, str]) -> str | None:
    # The request-info mapping of the API server (k8s.io/apiserver RequestInfoFactory).
    if method in ("GET", "HEAD"):
        if query.get("watch") in ("true", "1"):
            return "watch"
        return "get" if named else "list"
    if method == "DELETE":
        return "delete" if named else "deletecollection"
    return {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method)


def parse_call(method: str, path: str, query: Mapping[str, str], user: str = "") -> ApiCall | None:
    """The resource request a URL makes; None for discovery and other non-resource URLs."""
    parts = [p for p in path.split("/") if p]
    if len(parts) >= 3 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 4 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    namespace = None
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    resource, name = rest[0], (rest[1] if len(rest) > 1 else None)
    verb = _verb(method.upper(), name is not None, query)
    if verb is None:
        return None
    return ApiCall(verb, group, version, resource, "/".join(rest[2:]), namespace, name, method.upper(), path, user)


def owner_checks(call: ApiCall, body: Any, plural_of: Mapping[tuple[str, str], str]) -> list[ApiCall]:
    """What OwnerReferencesPermissionEnforcement authorizes for a write: setting blockOwnerDeletion on an
    owner reference needs `update` on the owner's finalizers subresource."""
    if call.verb not in ("create", "update", "patch") or not isinstance(body, dict):
        return []
    out = []
    for ref in (body.get("metadata") or {}).get("ownerReferences") or []:
        if not ref.get("blockOwnerDeletion"):
            continue
        group, _, version = ref["apiVersion"].rpartition("/")
        plural = plural_of.get((group, ref["kind"]), ref["kind"].lower() + "s")
        out.append(ApiCall("update", group, version, plural, "finalizers", call.namespace, ref["name"],
                           "admission", call.path, call.user))
    return out


RBAC_GROUP = "rbac.authorization.k8s.io"
RoleRules = Callable[[str | None, str, str], list[dict[str, Any]] | None]


def escalation_checks(call: ApiCall, obj: dict[str, Any], role_rules: RoleRules) -> list[ApiCall]:
    """What RBAC escalation prevention authorizes for a write of a Role or RoleBinding (as it is stored):
    the writer must hold every permission the Role grants, or the referenced role grants (the `escalate`
    and `bind` verbs, which skip this, are never granted by the chart). A binding to a role that does not
    exist needs `bind` on it. role_rules(namespace, kind, name) gives a stored role's rules, or None."""
    if call.group != RBAC_GROUP or call.subresource or call.verb not in ("create", "update", "patch"):
        return []
    if call.resource in ("roles", "clusterroles"):
        rules = obj.get("rules") or []
    elif call.resource in ("rolebindings", "clusterrolebindings"):
        ref = obj.get("roleRef") or {}
        rules = role_rules(call.namespace if ref.get("kind") == "Role" else None, ref.get("kind", ""),
                          ref.get("name", ""))
        if rules is None:
            plural = "roles" if ref.get("kind") == "Role" else "clusterroles"
            return [ApiCall("bind", RBAC_GROUP, "v1", plural, "", call.namespace, ref.get("name"),
                            "escalation", call.path, call.user)]
    else:
        return []
    out = []
    for rule in rules:
        for group in rule.get("apiGroups") or []:
            for res in rule.get("resources") or []:
                resource, _, sub = res.partition("/")
                for verb in rule.get("verbs") or []:
                    out += [ApiCall(verb, group, "", resource, sub, call.namespace, name, "escalation", call.path,
                                    call.user) for name in rule.get("resourceNames") or [None]]
    return out
