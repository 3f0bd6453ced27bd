"""The LeaderWorkerSet controller (leaderworkerset.x-k8s.io/v1), for the emulator only (on a cluster the LWS
controller does this): per group a leader pod from leaderTemplate and size - 1 worker pods from
workerTemplate, with the labels, annotations and environment the real controller gives them, the
all-or-nothing restart of RecreateGroupOnPodRestart, and the LWS's status.

As the real controller (kubernetes-sigs/lws) names and labels them:

- the leader of group g is `<lws>-<g>` (its leader StatefulSet's pod), its workers `<lws>-<g>-<w>`, w in
  1..size-1 (the group's worker StatefulSet); a name comes back only once the old pod of that name is gone;
- labels `leaderworkerset.sigs.k8s.io/name`, `.../group-index`, `.../worker-index` (0: the leader),
  `.../group-key` (sha1 of `<namespace>/<leader name>`) and `.../template-revision-hash`; annotations
  `.../size` and, on workers, `.../leader-name`;
- env LWS_LEADER_ADDRESS, LWS_GROUP_SIZE (first, before the template's) and LWS_WORKER_INDEX. The real
  LWS_LEADER_ADDRESS is the leader's DNS name through the LWS's headless Service (`<lws>-<g>.<lws>.<ns>`);
  there is no DNS here, so it is the leader's pod IP: the leader reads its own through the downward API
  (`status.podIP`, which the agent serves), a worker gets it as a value, which is why workers are created
  once the leader has an IP (the real startupPolicy LeaderCreated creates them with the leader).

RecreateGroupOnPodRestart: when a pod of a group restarts a container, fails, or is deleted, every pod of
the group is deleted and, once all are gone, the group is created again (new pods, new processes). Scaling
keeps groups 0..replicas-1 (the highest go first); a new template recreates one stale group at a time, and
only while every other group is ready (the operator's maxUnavailable 0).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

from .cluster import Kube, leaderworkersets, pod_ready, pods, terminating

PREFIX = "leaderworkerset.sigs.k8s.io"
NAME_LABEL = f"{PREFIX}/name"
GROUP_INDEX_LABEL = f"{PREFIX}/group-index"
WORKER_INDEX_LABEL = f"{PREFIX}/worker-index"
GROUP_KEY_LABEL = f"{PREFIX}/group-key"
REVISION_LABEL = f"{PREFIX}/template-revision-hash"
SIZE_ANNOTATION = f"{PREFIX}/size"
LEADER_NAME_ANNOTATION = f"{PREFIX}/leader-name"
RECREATE = "RecreateGroupOnPodRestart"


def revision(lws: dict[str, Any]) -> str:
    lwt = (lws.get("spec") or {}).get("leaderWorkerTemplate") or {}
    return hashlib.sha256(json.dumps(lwt, sort_keys=True).encode()).hexdigest()[:10]


def group_key(ns: str, leader: str) -> str:
    return hashlib.sha1(f"{ns}/{leader}".encode()).hexdigest()  # noqa: S324 - a key, as the controller's


def owned(pod: dict[str, Any], lws: dict[str, Any]) -> bool:
    return ((pod.get("metadata") or {}).get("labels") or {}).get(NAME_LABEL) == lws["metadata"]["name"]


def _label(pod: dict[str, Any], key: str) -> str | None:
    return ((pod.get("metadata") or {}).get("labels") or {}).get(key)


def _restarted_or_failed(pod: dict[str, Any]) -> bool:
    st = pod.get("status") or {}
    return st.get("phase") == "Failed" or any(int(c.get("restartCount") or 0) > 0
                                              for c in st.get("containerStatuses") or [])


def hpa_selector(name: str) -> str:
    """What the LWS's scale subresource reports as its selector: the leaders (one per group)."""
    return f"{NAME_LABEL}={name},{WORKER_INDEX_LABEL}=0"


class LeaderWorkerSets:
    def __init__(self, kube: Kube, ns: str, record: Callable[[str, str, dict[str, Any]], None]) -> None:
        self.kube = kube
        self.ns = ns
        self.record = record
        self._members: dict[str, set[str]] = {}  # leader uid -> the worker names created for it
        self._status: dict[str, dict[str, Any]] = {}
        self.recreated: list[tuple[str, int, str]] = []  # (lws, group, why), for the test's timeline

    def groups(self, lws: dict[str, Any], pod_list: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
        out: dict[int, list[dict[str, Any]]] = {}
        for p in pod_list:
            if owned(p, lws) and (g := _label(p, GROUP_INDEX_LABEL)) is not None:
                out.setdefault(int(g), []).append(p)
        return out

    async def sync(self, lws: dict[str, Any], pod_list: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One pass for one LeaderWorkerSet; returns the pod list, changed by what it did."""
        spec = lws.get("spec") or {}
        lwt = spec.get("leaderWorkerTemplate") or {}
        want = int(spec.get("replicas", 1))
        size = int(lwt.get("size", 1))
        policy = lwt.get("restartPolicy", RECREATE)
        rev = revision(lws)
        groups = self.groups(lws, pod_list)
        doomed: list[tuple[dict[str, Any], str]] = []
        ready_groups = {g for g, members in groups.items() if self._ready(members, size)}
        stale_done = False
        for g, members in sorted(groups.items()):
            live = [p for p in members if not terminating(p)]
            if not live:
                continue
            if g >= want:
                doomed += [(p, "scale-in") for p in live]
                continue
            why = self._broken(lws, g, members) if policy == RECREATE else None
            if why is None and not stale_done and any(_label(p, REVISION_LABEL) != rev for p in live) \
                    and ready_groups - {g} >= set(range(want)) - {g}:
                why, stale_done = "rollout", True  # one group at a time, the others all ready
            if why is not None:
                self.recreated.append((lws["metadata"]["name"], g, why))
                self.record(f"{lws['metadata']['name']}-{g}", "recreate-group", {"why": why})
                doomed += [(p, why) for p in live]
        for pod, why in doomed:
            self.record(pod["metadata"]["name"], "delete", {"why": why})
            await self.kube.delete(f"{pods(self.ns)}/{pod['metadata']['name']}")
        if doomed:
            pod_list = await self.kube.list(pods(self.ns))
            groups = self.groups(lws, pod_list)
        for g in range(want):
            members = groups.get(g, [])
            if not members:  # the group (or its last pod) is gone: a leader first, as the leader StatefulSet
                pod_list = [*pod_list, await self._create(lws, g, 0, size, rev, None)]
                continue
            leader = next((p for p in members if _label(p, WORKER_INDEX_LABEL) == "0"), None)
            if leader is None or terminating(leader) or not (leader.get("status") or {}).get("podIP"):
                continue  # workers once the leader has an address (their LWS_LEADER_ADDRESS)
            names = {p["metadata"]["name"] for p in members}
            for w in range(1, size):
                name = f"{leader['metadata']['name']}-{w}"
                if name not in names:
                    pod_list = [*pod_list, await self._create(lws, g, w, size, _label(leader, REVISION_LABEL) or rev,
                                                              leader)]
        return pod_list

    def _ready(self, members: list[dict[str, Any]], size: int) -> bool:
        live = [p for p in members if not terminating(p)]
        return len(live) == size and all(pod_ready(p) for p in live)

    def _broken(self, lws: dict[str, Any], g: int, members: list[dict[str, Any]]) -> str | None:
        """Why group g must start again as a whole (RecreateGroupOnPodRestart), or None."""
        for p in members:
            if terminating(p):
                return f"pod {p['metadata']['name']} deleted"
            if _restarted_or_failed(p):
                return f"pod {p['metadata']['name']} restarted"
        leader = next((p for p in members if _label(p, WORKER_INDEX_LABEL) == "0"), None)
        if leader is None:
            return f"leader {lws['metadata']['name']}-{g} gone"
        created = self._members.get(leader["metadata"].get("uid", ""), set())
        names = {p["metadata"]["name"] for p in members}
        missing = sorted(created - names)
        return f"pod {missing[0]} gone" if missing else None

    async def _create(self, lws: dict[str, Any], g: int, w: int, size: int, rev: str,
                      leader: dict[str, Any] | None) -> dict[str, Any]:
        meta = lws["metadata"]
        lwt = lws["spec"]["leaderWorkerTemplate"]
        template = lwt.get("leaderTemplate") if w == 0 and lwt.get("leaderTemplate") else lwt["workerTemplate"]
        tmeta = template.get("metadata") or {}
        leader_name = f"{meta['name']}-{g}"
        name = leader_name if w == 0 else f"{leader_name}-{w}"
        pod_spec = json.loads(json.dumps(template.get("spec") or {}))  # a copy: the env goes into it
        address: dict[str, Any] = (
            {"name": "LWS_LEADER_ADDRESS", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} if leader is None
            else {"name": "LWS_LEADER_ADDRESS", "value": leader["status"]["podIP"]})
        first = [address, {"name": "LWS_GROUP_SIZE", "value": str(size)},
                 {"name": "LWS_WORKER_INDEX", "value": str(w)}]
        for ctr in pod_spec.get("containers") or []:
            ctr["env"] = first + [e for e in ctr.get("env") or [] if e["name"] not in {x["name"] for x in first}]
        annotations = {**(tmeta.get("annotations") or {}), SIZE_ANNOTATION: str(size)}
        if leader is not None:
            annotations[LEADER_NAME_ANNOTATION] = leader_name
        body = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "name": name, "namespace": self.ns,
                "labels": {**(tmeta.get("labels") or {}), NAME_LABEL: meta["name"], GROUP_INDEX_LABEL: str(g),
                           WORKER_INDEX_LABEL: str(w), GROUP_KEY_LABEL: group_key(self.ns, leader_name),
                           REVISION_LABEL: rev},
                "annotations": annotations,
                # The leader belongs to the leader StatefulSet, a worker to its group's (which the leader owns).
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet",
                                     "name": meta["name"] if leader is None else leader_name,
                                     "uid": meta.get("uid", ""), "controller": True}],
            },
            "spec": {**pod_spec, "hostname": name, "subdomain": meta["name"]},
            "status": {"phase": "Pending"},
        }
        created = await self.kube.create(pods(self.ns), body)
        if leader is not None:
            self._members.setdefault(leader["metadata"].get("uid", ""), set()).add(name)
        self.record(name, "created", {"group": g, "worker": w})
        return created

    async def write_status(self, lws: dict[str, Any], pod_list: list[dict[str, Any]]) -> None:
        spec = lws.get("spec") or {}
        want = int(spec.get("replicas", 1))
        size = int((spec.get("leaderWorkerTemplate") or {}).get("size", 1))
        rev = revision(lws)
        groups = {g: m for g, m in self.groups(lws, pod_list).items() if g < want}
        live = {g: [p for p in m if not terminating(p)] for g, m in groups.items()}
        ready = sum(self._ready(m, size) for m in groups.values())
        updated = sum(1 for m in live.values() if m and all(_label(p, REVISION_LABEL) == rev for p in m))
        existing = sum(1 for m in live.values() if any(_label(p, WORKER_INDEX_LABEL) == "0" for p in m))
        available = ready >= want
        status = {
            "replicas": existing, "readyReplicas": ready, "updatedReplicas": updated,
            "hpaPodSelector": hpa_selector(lws["metadata"]["name"]),
            "conditions": [
                {"type": "Available", "status": "True" if available else "False",
                 "reason": "AllGroupsReady" if available else "GroupsNotReady",
                 "message": f"{ready}/{want} groups ready"},
                {"type": "Progressing", "status": "False" if available else "True",
                 "reason": "GroupsReady" if available else "GroupsProgressing",
                 "message": f"{updated} updated, {ready} ready of {want} groups"},
            ],
        }
        name = lws["metadata"]["name"]
        if self._status.get(name) != status:
            await self.kube.patch(f"{leaderworkersets(self.ns)}/{name}/status", {"status": status})
            self._status[name] = status
