"""The agent as a node only (what it is on a cluster), against the emulator: the test creates Pods the way
the controller-manager does (no nodeName) and deletes them the way a ReplicaSet does (DELETE with the
default grace). It checks the Node, the binding subresource, pod status, graceful deletion and the fit
check; and the rolling update of the emulator-only ReplicaSet role.
"""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import pytest

from . import netns, procs
from .agent import NodeAgent
from .cluster import NODES, condition, deployments, pod_ready, pods
from .emulator import emulator
from .lifecycle import until
from .node import GPU, NodeSpec, bind, misfit, quantity
from .test_agent import deployment

pytestmark = pytest.mark.timeout(120)
NS = "agent-test"
NODE = NodeSpec("e2e-node-test", {"cpu": "2", "memory": "4Gi", GPU: "1"})


def pod(name: str, **spec_extra: object) -> dict:
    template = copy.deepcopy(deployment(1)["spec"]["template"])
    template["spec"]["nodeSelector"] = NODE.selector()
    template["spec"]["tolerations"] = [NODE.toleration()]
    template["spec"].update(spec_extra)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS, **template["metadata"]},
            "spec": template["spec"]}


def test_fit_check_selector_taint_and_resources() -> None:
    ok = pod("a")
    assert misfit(ok, NODE, []) is None
    assert "nodeSelector" in misfit(pod("b", nodeSelector={"disk": "ssd"}), NODE, [])
    assert "taint" in misfit(pod("c", tolerations=[]), NODE, [])
    assert misfit(pod("d", tolerations=[{"operator": "Exists"}]), NODE, []) is None
    # 500m each: four fit in 2 cpus, a fifth does not.
    assert misfit(ok, NODE, [pod("x")] * 3) is None
    assert "insufficient cpu" in misfit(ok, NODE, [pod("x")] * 4)
    gpu = pod("g")
    gpu["spec"]["containers"][0]["resources"] = {"limits": {GPU: "2"}}
    assert f"insufficient {GPU}" in misfit(gpu, NODE, [])
    assert quantity("1500m") == 1.5 and quantity("2Gi") == 2 * 2**30 and quantity("1k") == 1000


async def test_node_binds_runs_and_deletes_like_a_kubelet(tmp_path: Path) -> None:
    stop = asyncio.Event()
    network = netns.open_network()  # the run's pod network, as on a cluster: a namespace per pod where possible
    async with emulator() as kube:
        agent = NodeAgent(kube, NS, tmp_path, node=NODE, replicasets=False, network=network)
        task = asyncio.create_task(agent.run(stop))
        try:
            node = await until(lambda: kube.get(f"{NODES}/{NODE.name}"), 10, "the Node is registered")
            assert node["metadata"]["labels"]["kvpilot.io/e2e-node"] == NODE.name
            node = await until(lambda: _ready_node(kube), 10, "the Node is Ready")
            assert node["status"]["allocatable"]["cpu"] == "2" and node["status"]["allocatable"][GPU] == "1"
            assert node["spec"]["taints"] == NODE.taints()

            await kube.create(pods(NS), pod("fits"))
            await kube.create(pods(NS), pod("elsewhere", nodeSelector={"disk": "ssd"}))
            p = await until(lambda: _pod_ready(kube, "fits"), 30, "the pod is bound, started and Ready")
            assert p["spec"]["nodeName"] == NODE.name and condition(p, "PodScheduled")["status"] == "True"
            assert netns.is_pod_address(p["status"]["podIP"], network.mode) and p["status"]["podIPs"] == [
                {"ip": p["status"]["podIP"]}]
            att = agent.containers["fits"].net
            assert att is not None and att.ip == p["status"]["podIP"]
            if network.mode == "netns":  # the pod's sandbox: a namespace and a host link of its own
                assert att.netns in netns.netns_names() and att.link in netns.link_names()
            cs = p["status"]["containerStatuses"][0]
            assert cs["name"] == "web" and cs["ready"] and cs["restartCount"] == 0 and "running" in cs["state"]
            assert [e.what for e in agent.events_of("fits")][:3] == ["bound", "started", "ready"]
            # A second binding of the same pod is refused (409), as the API server refuses it.
            assert not await bind(kube, p, "another-node")

            other = await until(lambda: _unschedulable(kube, "elsewhere"), 10, "the misfit is reported")
            assert "nodeSelector" in condition(other, "PodScheduled")["message"]
            assert not other["spec"].get("nodeName")

            # A ReplicaSet's delete: marked first, the kubelet stops the process, then deletes with grace 0.
            assert await kube.delete(f"{pods(NS)}/fits")
            marked = await kube.get(f"{pods(NS)}/fits")
            assert marked is not None and marked["metadata"]["deletionTimestamp"]
            await until(lambda: _gone(kube, "fits"), 20, "the pod object is removed")
            steps = [e.what for e in agent.events_of("fits")]
            assert steps[-5:] == ["terminating", "prestop", "sigterm", "exited", "removed"], steps
            assert agent.containers["fits"].exit_code == 0
            if network.mode == "netns":  # its network went with it
                assert att.netns not in netns.netns_names() and att.link not in netns.link_names()
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
            network.close()
        assert await kube.get(f"{NODES}/{NODE.name}") is None  # the node leaves with the agent
    assert not procs.live()


async def test_replicaset_role_rolls_out_one_pod_at_a_time(tmp_path: Path) -> None:
    stop = asyncio.Event()
    async with emulator() as kube:
        agent = NodeAgent(kube, NS, tmp_path, node=NODE)
        task = asyncio.create_task(agent.run(stop))
        try:
            dep = deployment(1)
            dep["spec"]["template"]["spec"].update(nodeSelector=NODE.selector(), tolerations=[NODE.toleration()])
            dep["spec"]["strategy"] = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
            await kube.create(deployments(NS), dep)
            first = (await until(lambda: _ready(kube), 30, "one Ready pod"))[0]["metadata"]["name"]
            await kube.patch(f"{deployments(NS)}/web", {"spec": {"template": {"metadata": {"annotations": {"a": "c"}}}}})
            seen_ready: list[int] = []

            async def rolled() -> bool:
                ready = await _ready(kube)
                seen_ready.append(len(ready))
                return [p["metadata"]["name"] for p in ready] != [first] and len(await kube.list(pods(NS))) == 1
            await until(rolled, 40, "the rollout replaces the pod")
            assert min(seen_ready) >= 1  # maxUnavailable 0
            new = (await kube.list(pods(NS)))[0]
            assert new["metadata"]["annotations"] == {"a": "c"}
            old_events = agent.events_of(first)
            new_ready = agent.events_of(new["metadata"]["name"], "ready")[0].t
            assert next(e for e in old_events if e.what == "delete").t >= new_ready
            assert [e.what for e in old_events][-5:] == ["terminating", "prestop", "sigterm", "exited", "removed"]
            await until(lambda: _dep_updated(kube), 10, "Deployment status: 1 updated, ready replica")
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)


async def _ready_node(kube) -> dict | None:
    node = await kube.get(f"{NODES}/{NODE.name}")
    c = condition(node, "Ready")
    return node if c and c["status"] == "True" else None


async def _pod_ready(kube, name: str) -> dict | None:
    p = await kube.get(f"{pods(NS)}/{name}")
    return p if p is not None and pod_ready(p) else None


async def _unschedulable(kube, name: str) -> dict | None:
    p = await kube.get(f"{pods(NS)}/{name}")
    c = condition(p, "PodScheduled")
    return p if c and c["status"] == "False" and c.get("reason") == "Unschedulable" else None


async def _gone(kube, name: str) -> bool:
    return await kube.get(f"{pods(NS)}/{name}") is None


async def _ready(kube) -> list[dict]:
    return [p for p in await kube.list(pods(NS)) if pod_ready(p) and not p["metadata"].get("deletionTimestamp")]


async def _dep_updated(kube) -> bool:
    st = ((await kube.get(f"{deployments(NS)}/web")) or {}).get("status") or {}
    return st.get("updatedReplicas") == 1 and st.get("replicas") == 1 and st.get("readyReplicas") == 1
