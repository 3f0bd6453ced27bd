"""EndpointSlice discovery against the kmock Kubernetes emulator, with credentials from a kubeconfig."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import kmock
import pytest
import yaml

from kvpilot.router.endpoints import EndpointSet, SliceWatcher
from kvpilot.router.kube import KubeClient
from kvpilot.router.prompt import ByteTokenizer
from kvpilot.router.server import ENDPOINTS_KEY, RouterSettings
from support.router_fakes import FakeReplica, RouterServer

pytestmark = pytest.mark.timeout(60)

SLICES = "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"


def endpoint_slice(name: str, service: str, eps: list[tuple[str, str, bool]]) -> dict[str, Any]:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": name, "namespace": "ns1", "labels": {"kubernetes.io/service-name": service}},
            "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
            "endpoints": [{"addresses": [ip], "conditions": {"ready": ready},
                           "targetRef": {"kind": "Pod", "name": pod, "namespace": "ns1"}} for pod, ip, ready in eps]}


async def until(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def api(tmp_path, monkeypatch) -> AsyncIterator[tuple[str, aiohttp.ClientSession]]:
    """kmock serving EndpointSlices, and a kubeconfig pointing at it."""
    emulator = kmock.KubernetesEmulator()
    emulator.resources["discovery.k8s.io/v1/endpointslices"] = dict(
        kind="EndpointSlice", singular="endpointslice", namespaced=True,
        verbs=["list", "watch", "get", "patch", "create", "delete"])
    async with emulator, kmock.Server(emulator) as server, aiohttp.ClientSession() as http:
        url = str(server.url).rstrip("/")
        cfg = {"apiVersion": "v1", "kind": "Config", "current-context": "k",
               "clusters": [{"name": "k", "cluster": {"server": url}}],
               "users": [{"name": "k", "user": {"token": "t"}}],
               "contexts": [{"name": "k", "context": {"cluster": "k", "user": "k"}}]}
        (tmp_path / "kubeconfig").write_text(yaml.safe_dump(cfg))
        monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        yield url, http


async def post_slice(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> None:
    async with http.post(url + SLICES.format(ns="ns1"), json=body) as r:
        assert r.status < 400, await r.text()


async def test_ready_addresses_of_the_service_are_watched(tmp_path, monkeypatch):
    async with api(tmp_path, monkeypatch) as (url, http):

        async def post(body: dict[str, Any]) -> None:
            await post_slice(http, url, body)

        await post(endpoint_slice("llm-a", "llm", [("p1", "10.0.0.1", True), ("p2", "10.0.0.2", False)]))
        await post(endpoint_slice("other-a", "other", [("q1", "10.9.0.1", True)]))
        kube = KubeClient.from_environment()
        eps = EndpointSet()
        watcher = SliceWatcher(kube, "ns1", "llm", eps, port_name="http", backoff=30.0)  # no relist: the watch must deliver
        task = asyncio.create_task(watcher.run())
        try:
            await until(lambda: len(eps) == 1)
            assert [(e.name, e.url) for e in eps.all()] == [("p1", "http://10.0.0.1:8000")]
            # p2 turns ready, a second slice appears: both are seen through the watch
            async with http.patch(url + SLICES.format(ns="ns1") + "/llm-a",
                                  json={"endpoints": endpoint_slice("llm-a", "llm", [
                                      ("p1", "10.0.0.1", True), ("p2", "10.0.0.2", True)])["endpoints"]}) as r:
                assert r.status < 400, await r.text()
            await post(endpoint_slice("llm-b", "llm", [("p3", "10.0.0.3", True)]))
            await until(lambda: {e.name for e in eps.all()} == {"p1", "p2", "p3"})
            async with http.delete(url + SLICES.format(ns="ns1") + "/llm-a") as r:
                assert r.status < 400
            await until(lambda: {e.name for e in eps.all()} == {"p3"})
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await kube.close()


async def test_router_with_service_discovery_serves_the_sliced_replica(tmp_path, monkeypatch):
    rep = await FakeReplica(host="127.0.0.6", name="sliced").start()
    async with api(tmp_path, monkeypatch) as (url, http):
        body = endpoint_slice("llm-a", "llm", [("pod-x", "127.0.0.6", True)])
        body["ports"] = [{"name": "http", "port": rep.port, "protocol": "TCP"}]
        await post_slice(http, url, body)
        rs = await RouterServer(RouterSettings(service="llm", namespace="ns1", port_name="http"),
                                tokenizer=ByteTokenizer()).start()
        try:
            assert rs.app is not None
            eps = rs.app[ENDPOINTS_KEY]
            await until(lambda: len(eps) == 1)
            async with http.post(rs.url + "/v1/completions", json={"model": "m", "prompt": "hi"}) as r:
                assert r.status == 200 and r.headers["X-Kvpilot-Endpoint"] == "pod-x"
                assert (await r.json())["choices"][0]["text"] == "hi from sliced"
        finally:
            await rs.stop()
            await rep.stop()
