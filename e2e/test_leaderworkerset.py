"""The agent's LeaderWorkerSet controller (leaderworkerset.py) and the emulator's LWS API, without processes:
the groups' pods with the real controller's names, labels and environment, RecreateGroupOnPodRestart,
scaling through the scale subresource, the status, and the emulator's check of what is written against
the published API (tests/schemas/leaderworkerset-v1.json)."""

from __future__ import annotations

from typing import Any

import pytest

from kvpilot.operator.kube import KubeApiError

from .cluster import CRDS, LWS_CRD_NAME, Kube, leaderworkersets, pods
from .emulator import emulator
from .leaderworkerset import (
    GROUP_INDEX_LABEL,
    GROUP_KEY_LABEL,
    LEADER_NAME_ANNOTATION,
    NAME_LABEL,
    SIZE_ANNOTATION,
    WORKER_INDEX_LABEL,
    LeaderWorkerSets,
    group_key,
    hpa_selector,
)

pytestmark = pytest.mark.timeout(60)
NS = "lws"


def lws(name: str = "big", replicas: int = 1, size: int = 3) -> dict[str, Any]:
    def template(role: str) -> dict[str, Any]:
        return {"metadata": {"labels": {"app": "big", "role": role}},
                "spec": {"containers": [{"name": "c", "image": "x", "env": [{"name": "A", "value": "1"}]}]}}

    return {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"replicas": replicas, "leaderWorkerTemplate": {
                "size": size, "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": template("leader"), "workerTemplate": template("worker")}}}


class Lab:
    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self.events: list[tuple[str, str]] = []
        self.ctl = LeaderWorkerSets(kube, NS, lambda pod, what, _detail: self.events.append((pod, what)))

    async def sync(self, name: str = "big") -> dict[str, dict[str, Any]]:
        obj = await self.kube.get(f"{leaderworkersets(NS)}/{name}")
        assert obj is not None
        pod_list = await self.ctl.sync(obj, await self.kube.list(pods(NS)))
        await self.ctl.write_status(obj, pod_list)
        return {p["metadata"]["name"]: p for p in await self.kube.list(pods(NS))}

    async def run(self, name: str, ready: bool = True) -> None:
        """What the kubelet writes of a running pod: an IP and, if `ready`, Ready."""
        await self.kube.patch(f"{pods(NS)}/{name}/status", {"status": {
            "phase": "Running", "podIP": f"10.0.0.{len(name)}",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "containerStatuses": [{"name": "c", "restartCount": 0, "ready": ready}]}})

    async def remove(self, name: str) -> None:
        await self.kube.delete(f"{pods(NS)}/{name}", grace_period=0)


def env(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod["spec"]["containers"][0]["env"]}


async def test_a_group_is_a_leader_then_its_workers_with_the_controllers_labels_and_env() -> None:
    async with emulator() as kube:
        assert await kube.get(f"{CRDS}/{LWS_CRD_NAME}") is None  # apply_crd installs it (target.py)
        await kube.apply_crd()
        crd = await kube.get(f"{CRDS}/{LWS_CRD_NAME}")
        assert crd["spec"]["versions"][0]["subresources"]["scale"]["labelSelectorPath"] == ".status.hpaPodSelector"
        await kube.create(leaderworkersets(NS), lws())
        lab = Lab(kube)
        assert set(await lab.sync()) == {"big-0"}  # workers need the leader's address first
        await lab.run("big-0")
        got = await lab.sync()
        assert set(got) == {"big-0", "big-0-1", "big-0-2"}
        for name, index in (("big-0", "0"), ("big-0-1", "1"), ("big-0-2", "2")):
            meta = got[name]["metadata"]
            assert meta["labels"][NAME_LABEL] == "big" and meta["labels"][GROUP_INDEX_LABEL] == "0"
            assert meta["labels"][WORKER_INDEX_LABEL] == index and meta["labels"]["app"] == "big"
            assert meta["labels"][GROUP_KEY_LABEL] == group_key(NS, "big-0")
            assert meta["annotations"][SIZE_ANNOTATION] == "3"
            e = env(got[name])
            assert list(e)[:3] == ["LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"] and e["A"] == "1"
            assert (e["LWS_GROUP_SIZE"], e["LWS_WORKER_INDEX"]) == ("3", index)
        assert got["big-0"]["metadata"]["labels"]["role"] == "leader"
        assert got["big-0-1"]["metadata"]["labels"]["role"] == "worker"
        assert got["big-0-1"]["metadata"]["annotations"][LEADER_NAME_ANNOTATION] == "big-0"
        assert env(got["big-0"])["LWS_LEADER_ADDRESS"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env(got["big-0-2"])["LWS_LEADER_ADDRESS"] == got["big-0"]["status"]["podIP"]


async def test_a_restart_in_a_group_recreates_the_whole_group_and_status_follows() -> None:
    async with emulator() as kube:
        await kube.create(leaderworkersets(NS), lws(size=2))
        lab = Lab(kube)
        await lab.sync()
        await lab.run("big-0")
        before = await lab.sync()
        await lab.run("big-0-1")
        await lab.sync()
        st = (await kube.get(f"{leaderworkersets(NS)}/big"))["status"]
        assert st["replicas"] == st["readyReplicas"] == 1 and st["hpaPodSelector"] == hpa_selector("big")
        # The worker's container restarted (the kubelet's restartCount): both pods go, the leader too.
        await kube.patch(f"{pods(NS)}/big-0-1/status", {"status": {"containerStatuses": [
            {"name": "c", "restartCount": 1, "ready": False}]}})
        after = await lab.sync()
        assert ("big-0", "recreate-group") in lab.events and ("big-0-1", "delete") in lab.events
        assert lab.ctl.recreated == [("big", 0, "pod big-0-1 restarted")]
        # Unbound pods go at once on the emulator, so the new leader comes in the same pass.
        assert set(after) == {"big-0"} and after["big-0"]["metadata"]["uid"] != before["big-0"]["metadata"]["uid"]
        st = (await kube.get(f"{leaderworkersets(NS)}/big"))["status"]
        assert st["readyReplicas"] == 0


async def test_a_deleted_worker_recreates_the_group() -> None:
    async with emulator() as kube:
        await kube.create(leaderworkersets(NS), lws(size=2))
        lab = Lab(kube)
        await lab.sync()
        await lab.run("big-0")
        await lab.sync()
        uid = (await kube.get(f"{pods(NS)}/big-0"))["metadata"]["uid"]
        await lab.remove("big-0-1")
        after = await lab.sync()
        assert lab.ctl.recreated == [("big", 0, "pod big-0-1 gone")]
        assert set(after) == {"big-0"} and after["big-0"]["metadata"]["uid"] != uid


async def test_scale_subresource_sets_the_groups() -> None:
    async with emulator() as kube:
        await kube.create(leaderworkersets(NS), lws(replicas=1, size=2))
        lab = Lab(kube)
        await lab.sync()
        path = f"{leaderworkersets(NS)}/big/scale"
        scale = await kube.get(path)
        assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 1
        scaled = await kube.patch(path, {"spec": {"replicas": 2}})
        assert scaled["spec"]["replicas"] == 2
        assert (await kube.get(f"{leaderworkersets(NS)}/big"))["spec"]["replicas"] == 2
        assert set(await lab.sync()) == {"big-0", "big-1"}
        await kube.patch(path, {"spec": {"replicas": 1}})
        assert set(await lab.sync()) == {"big-0"}  # the highest group goes
        with pytest.raises(KubeApiError) as e:
            await kube.patch(path, {"spec": {"replicas": -1}})
        assert e.value.status == 422


async def test_the_emulator_refuses_what_the_lws_api_refuses() -> None:
    async with emulator() as kube:
        bad = lws()
        bad["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Sometimes"
        with pytest.raises(KubeApiError) as e:
            await kube.create(leaderworkersets(NS), bad)
        assert e.value.status == 422 and "restartPolicy" in str(e.value)
        await kube.create(leaderworkersets(NS), lws())
        with pytest.raises(KubeApiError) as e:  # a patch is checked as its result
            await kube.patch(f"{leaderworkersets(NS)}/big", {"spec": {"leaderWorkerTemplate": {"size": 0}}})
        assert e.value.status == 422
