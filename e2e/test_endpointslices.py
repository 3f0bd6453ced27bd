"""The agent's EndpointSlice controller and the pods' service-account credentials, against the kmock
emulator: the slices follow the pods as the controller would write them, and the router's own discovery
(kvpilot.router: a kubeconfig from KUBECONFIG, list then watch) finds the ready pods through them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvpilot.operator.kube import KubeApiError
from kvpilot.router.endpoints import EndpointSet, SliceWatcher
from kvpilot.router.kube import KubeClient

from . import podcreds
from .cluster import Kube, endpointslices, pods, serviceaccounts, services
from .emulator import emulator
from .endpointslices import MANAGED_BY_LABEL, SERVICE_NAME_LABEL, EndpointSliceController
from .lifecycle import until

pytestmark = pytest.mark.timeout(60)
NS = "slices"


def service(name: str = "web", target: object = "http") -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": NS},
            "spec": {"clusterIP": "None", "selector": {"app": "web"},
                     "ports": [{"name": "http", "port": 80, "targetPort": target, "protocol": "TCP"}]}}


async def add_pod(kube: Kube, name: str, ip: str | None, ready: bool, port: int = 8000, app: str = "web") -> None:
    ctr = {"name": "c", "image": "x", "ports": [{"name": "http", "containerPort": port}]}
    await kube.create(pods(NS), {"apiVersion": "v1", "kind": "Pod",
                                 "metadata": {"name": name, "namespace": NS, "labels": {"app": app}},
                                 "spec": {"nodeName": "n1", "containers": [ctr]}})
    await set_pod(kube, name, ip, ready)


async def set_pod(kube: Kube, name: str, ip: str | None, ready: bool) -> None:
    status = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    await kube.patch(f"{pods(NS)}/{name}/status", {"status": status})


async def slices_of(kube: Kube, svc: str) -> list[dict]:
    return [s for s in await kube.list(endpointslices(NS))
            if (s["metadata"].get("labels") or {}).get(SERVICE_NAME_LABEL) == svc]


async def sync(kube: Kube, ctl: EndpointSliceController) -> list[dict]:
    await ctl.sync(await kube.list(pods(NS)))
    return await slices_of(kube, "web")


def conditions(slice_: dict) -> dict[str, dict]:
    return {e["targetRef"]["name"]: e["conditions"] for e in slice_["endpoints"]}


async def test_slices_follow_the_pods_as_the_controller_writes_them() -> None:
    async with emulator() as kube:
        ctl = EndpointSliceController(kube, NS)
        await kube.create(services(NS), service())
        [empty] = await sync(kube, ctl)  # a Service that selects nothing keeps one empty slice
        assert empty["endpoints"] == [] and empty["metadata"]["labels"][MANAGED_BY_LABEL]
        await add_pod(kube, "a", "198.18.7.2", ready=True)
        await add_pod(kube, "b", "198.18.7.3", ready=False)
        await add_pod(kube, "c", None, ready=False)  # no IP yet: not an endpoint
        await add_pod(kube, "other", "198.18.7.9", ready=True, app="db")
        [s] = await sync(kube, ctl)
        assert s["addressType"] == "IPv4"
        assert s["ports"] == [{"name": "http", "port": 8000, "protocol": "TCP"}]  # the named targetPort
        assert [e["addresses"] for e in s["endpoints"]] == [["198.18.7.2"], ["198.18.7.3"]]
        assert conditions(s) == {"a": {"ready": True, "serving": True, "terminating": False},
                                 "b": {"ready": False, "serving": False, "terminating": False}}
        writes = ctl.writes
        await sync(kube, ctl)
        assert ctl.writes == writes, "a pass with nothing new wrote anyway"

        await set_pod(kube, "b", "198.18.7.3", ready=True)
        await kube.delete(f"{pods(NS)}/a")  # bound: only marked, as the API server does
        [s] = await sync(kube, ctl)
        assert conditions(s)["a"] == {"ready": False, "serving": True, "terminating": True}
        assert conditions(s)["b"]["ready"] is True

        await kube.delete(f"{services(NS)}/web")
        assert await sync(kube, ctl) == []


async def test_pods_resolving_the_port_differently_get_slices_of_their_own() -> None:
    async with emulator() as kube:
        ctl = EndpointSliceController(kube, NS)
        await kube.create(services(NS), service())
        await add_pod(kube, "a", "198.18.7.2", ready=True, port=8000)
        await add_pod(kube, "b", "198.18.7.3", ready=True, port=9000)
        got = {s["ports"][0]["port"]: [e["targetRef"]["name"] for e in s["endpoints"]] for s in await sync(kube, ctl)}
        assert got == {8000: ["a"], 9000: ["b"]}


async def test_a_pod_of_a_service_account_gets_a_token_and_the_router_discovers_through_it(tmp_path: Path,
                                                                                          monkeypatch) -> None:
    async with emulator() as kube:
        pod = {"metadata": {"name": "r-1", "namespace": NS, "uid": "u1"}, "spec": {"serviceAccountName": "router"}}
        with pytest.raises(KubeApiError) as missing:  # no such ServiceAccount: refused, as on a cluster
            await podcreds.mount(kube, pod, tmp_path)
        assert missing.value.status == 404
        await kube.create(serviceaccounts(NS), {"apiVersion": "v1", "kind": "ServiceAccount",
                                                "metadata": {"name": "router", "namespace": NS}})
        env = await podcreds.mount(kube, pod, tmp_path)
        token = (tmp_path / "serviceaccount" / "token").read_text()
        assert token.startswith("e2e-sa-router-") and env == {"KUBECONFIG": str(tmp_path / "serviceaccount" / "kubeconfig")}
        assert await podcreds.mount(kube, {**pod, "spec": {"serviceAccountName": "default"}}, tmp_path) == {}

        # The router's own client and watcher, reading what the controller writes.
        monkeypatch.setenv("KUBECONFIG", env["KUBECONFIG"])
        client = KubeClient.from_environment()
        assert client.host == kube.url and client._headers() == {"Authorization": f"Bearer {token}"}  # noqa: SLF001
        ctl = EndpointSliceController(kube, NS)
        await kube.create(services(NS), service())
        await add_pod(kube, "a", "198.18.7.2", ready=False)
        found = EndpointSet()
        watcher = asyncio.create_task(SliceWatcher(client, NS, "web", found, port_name="http").run())
        try:
            await sync(kube, ctl)
            await asyncio.sleep(0.5)
            assert found.all() == []  # not ready: not routed to
            await set_pod(kube, "a", "198.18.7.2", ready=True)
            await sync(kube, ctl)
            await until(lambda: found.all(), 5, "the router sees the ready pod")
            assert [(e.name, e.url) for e in found.all()] == [("a", "http://198.18.7.2:8000")]
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            await client.close()


async def test_the_emulator_refuses_loopback_addresses_as_an_api_server_does() -> None:
    """A real API server refuses loopback and link-local addresses in EndpointSlices; so does the emulator,
    unless the run's pods have nothing else (the loopback pod network)."""
    body = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": "s", "namespace": NS, "labels": {SERVICE_NAME_LABEL: "web"}},
            "endpoints": [{"addresses": ["127.0.0.2"]}], "ports": [{"name": "http", "port": 8000}]}
    async with emulator() as kube:
        with pytest.raises(KubeApiError) as e:
            await kube.create(endpointslices(NS), body)
        assert e.value.status == 422 and "loopback" in str(e.value)
        body["endpoints"] = [{"addresses": ["198.18.7.2"]}]
        await kube.create(endpointslices(NS), body)
        with pytest.raises(KubeApiError) as e:
            await kube.patch(f"{endpointslices(NS)}/s", {"endpoints": [{"addresses": ["169.254.1.1"]}]})
        assert e.value.status == 422 and "link-local" in str(e.value)
    async with emulator(loopback_endpoints=True) as kube:
        body["endpoints"] = [{"addresses": ["127.0.0.2"]}]
        await kube.create(endpointslices(NS), body)
