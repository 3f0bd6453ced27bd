"""The RBAC authorizer, run over rendered manifests: which API calls a service account may make."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from .calls import ApiCall


@dataclasses.dataclass(frozen=True)
class Grant:
    """One (group, resource[/subresource], verb) a rule grants, and where: None for every namespace."""

    group: str
    resource: str
    verb: str
    namespace: str | None


def _matches(rule: dict[str, Any], call: ApiCall) -> bool:
    groups, resources, verbs = rule.get("apiGroups") or [], rule.get("resources") or [], rule.get("verbs") or []
    names = rule.get("resourceNames") or []
    resource_ok = (call.full_resource in resources or "*" in resources
                   or (call.subresource and f"{call.resource}/*" in resources)
                   or (call.subresource and f"*/{call.subresource}" in resources))
    return ((call.group in groups or "*" in groups) and resource_ok and (call.verb in verbs or "*" in verbs)
            and (not names or call.name in names))


class Authorizer:
    """The rules bound to one service account: ClusterRoleBindings apply everywhere, RoleBindings in their
    namespace only, as the API server's RBAC authorizer evaluates them."""

    def __init__(self, docs: Iterable[dict[str, Any]], service_account: str, namespace: str) -> None:
        docs = list(docs)
        cluster_roles = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ClusterRole"}
        roles = {(d["metadata"].get("namespace"), d["metadata"]["name"]): d for d in docs if d["kind"] == "Role"}
        self.cluster_rules: list[dict[str, Any]] = []
        self.namespace_rules: dict[str, list[dict[str, Any]]] = {}
        for b in docs:
            if b["kind"] not in ("ClusterRoleBinding", "RoleBinding") or not self._binds(b, service_account, namespace):
                continue
            ref = b["roleRef"]
            ns = b["metadata"].get("namespace")
            role = cluster_roles.get(ref["name"]) if ref["kind"] == "ClusterRole" else roles.get((ns, ref["name"]))
            if role is None:
                raise ValueError(f"{b['kind']} {b['metadata']['name']} refers to a missing {ref['kind']} {ref['name']}")
            if b["kind"] == "ClusterRoleBinding":
                self.cluster_rules += role.get("rules") or []
            else:
                self.namespace_rules.setdefault(ns, []).extend(role.get("rules") or [])

    @staticmethod
    def _binds(binding: dict[str, Any], service_account: str, namespace: str) -> bool:
        return any(s.get("kind") == "ServiceAccount" and s.get("name") == service_account
                   and s.get("namespace") == namespace for s in binding.get("subjects") or [])

    def allows(self, call: ApiCall) -> bool:
        rules = self.cluster_rules
        if call.namespace is not None:
            rules = [*rules, *self.namespace_rules.get(call.namespace, [])]
        return any(_matches(r, call) for r in rules)

    def grants(self) -> set[Grant]:
        out = set()
        for ns, rules in [(None, self.cluster_rules), *self.namespace_rules.items()]:
            for r in rules:
                for g in r.get("apiGroups") or []:
                    for res in r.get("resources") or []:
                        out |= {Grant(g, res, v, ns) for v in r.get("verbs") or []}
        return out


def used_by(grant: Grant, calls: Iterable[ApiCall]) -> bool:
    """Whether some call needs the grant's group, resource and verb (in whichever bound namespace)."""
    return any(c.group == grant.group and c.full_resource == grant.resource and c.verb == grant.verb
               for c in calls)
