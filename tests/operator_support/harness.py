"""Test harness: a stricter kmock Kubernetes emulator (emulator.py) on 127.0.0.1, the operator in kopf's
KopfRunner, and small aiohttp servers on 127.0.0.x that play the daemons' /metrics. The servers run on
event loops of their own (background.py), so stopping the operator never blocks what it talks to."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import aiohttp.web
import kmock
import yaml
from kopf.testing import KopfRunner

from kvpilot.operator import crd, kube, lora_crd

from .background import on_own_loop
from .calls import ApiCall
from .emulator import StrictEmulator

CR_PATH = "/apis/kvpilot.io/v1alpha1/namespaces/{ns}/inferencedeployments"
CR_KEY = "kvpilot.io/v1alpha1/inferencedeployments"
LORA_PATH = "/apis/kvpilot.io/v1alpha1/namespaces/{ns}/loraadapters"
LORA_KEY = "kvpilot.io/v1alpha1/loraadapters"
LWS_KEY = "leaderworkerset.x-k8s.io/v1/leaderworkersets"
LWS_PATH = "/apis/leaderworkerset.x-k8s.io/v1/namespaces/{ns}/leaderworkersets"
LEADER_LABELS = {"leaderworkerset.sigs.k8s.io/worker-index": "0"}  # what the LWS controller puts on a leader
ALL_VERBS = ["list", "watch", "get", "patch", "update", "create", "delete"]
RESOURCES = {
    CR_KEY: dict(kind="InferenceDeployment", singular="inferencedeployment", namespaced=True, shortnames=["infd"],
                 verbs=ALL_VERBS, subresources=["status", "scale"]),
    LORA_KEY: dict(kind="LoRAAdapter", singular="loraadapter", namespaced=True, shortnames=["lora"],
                   verbs=ALL_VERBS, subresources=["status"]),
    # As on a server, Deployment status is written only through /status (Cluster.set_deployment_status).
    "apps/v1/deployments": dict(kind="Deployment", singular="deployment", namespaced=True, verbs=ALL_VERBS,
                                subresources=["status", "scale"]),
    "v1/services": dict(kind="Service", singular="service", namespaced=True, verbs=ALL_VERBS,
                        subresources=["status"]),
    "policy/v1/poddisruptionbudgets": dict(kind="PodDisruptionBudget", singular="poddisruptionbudget",
                                           namespaced=True, verbs=ALL_VERBS, subresources=["status"]),
    "v1/pods": dict(kind="Pod", singular="pod", namespaced=True, verbs=ALL_VERBS, subresources=["status"]),
    # The router's children (spec.router, operator/routing.py) and what a router watches.
    "v1/serviceaccounts": dict(kind="ServiceAccount", singular="serviceaccount", namespaced=True, verbs=ALL_VERBS),
    "rbac.authorization.k8s.io/v1/roles": dict(kind="Role", singular="role", namespaced=True, verbs=ALL_VERBS),
    "rbac.authorization.k8s.io/v1/rolebindings": dict(kind="RoleBinding", singular="rolebinding", namespaced=True,
                                                      verbs=ALL_VERBS),
    "discovery.k8s.io/v1/endpointslices": dict(kind="EndpointSlice", singular="endpointslice", namespaced=True,
                                               verbs=ALL_VERBS),
    # The Gateway API Inference Extension's CRD (spec.router.mode inferencePool); a test may take it away.
    "inference.networking.k8s.io/v1/inferencepools": dict(kind="InferencePool", singular="inferencepool",
                                                          namespaced=True, verbs=ALL_VERBS),
    # LeaderWorkerSet's CRD (multi-node replicas, operator/lws.py), with its status and scale subresources as
    # the published API has them; tests play its controller (status, pods). A test may take it away.
    LWS_KEY: dict(kind="LeaderWorkerSet", singular="leaderworkerset", namespaced=True, shortnames=["lws"],
                  verbs=ALL_VERBS, subresources=["status", "scale"]),
    # kopf waits for these to be discoverable (its "backbone"), even cluster-wide.
    "v1/namespaces": dict(kind="Namespace", singular="namespace", namespaced=False, verbs=["get", "list", "watch"]),
    "apiextensions.k8s.io/v1/customresourcedefinitions": dict(
        kind="CustomResourceDefinition", singular="customresourcedefinition", namespaced=False,
        verbs=["list", "watch", "get"]),
    "v1/events": dict(kind="Event", singular="event", namespaced=True, verbs=["create", "list", "get"]),
    # kopf's peering objects, from charts/kvpilot/crds/kopf-peering.yaml.
    "kopf.dev/v1/clusterkopfpeerings": dict(kind="ClusterKopfPeering", singular="clusterkopfpeering",
                                            namespaced=False, verbs=ALL_VERBS),
    "kopf.dev/v1/kopfpeerings": dict(kind="KopfPeering", singular="kopfpeering", namespaced=True, verbs=ALL_VERBS),
}


def without_resource(monkeypatch: Any, key: str) -> list[str]:
    """The API server of a cluster without the CRD of ``key`` (a RESOURCES key, e.g. LeaderWorkerSet's or
    InferencePool's): 404 for the whole resource (kmock would answer any path). Returns the refused calls."""
    plural = "/" + key.rsplit("/", 1)[-1]
    refused: list[str] = []
    original = kube.KubeClient.request

    async def request(self: Any, method: str, path: str, **kwargs: Any) -> Any:
        if plural in path:
            refused.append(f"{method} {path}")
            raise kube.KubeApiError(404, "NotFound", "the server could not find the requested resource",
                                    method, path)
        return await original(self, method, path, **kwargs)

    monkeypatch.setattr(kube.KubeClient, "request", request)
    monkeypatch.delitem(RESOURCES, key)
    return refused


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Cluster:
    """HTTP access to the emulator, as a user or a controller would do it."""

    def __init__(self, emulator: StrictEmulator, url: str, session: aiohttp.ClientSession) -> None:
        self.emulator = emulator
        self.url = url.rstrip("/")
        self.session = session

    @property
    def calls(self) -> list[ApiCall]:
        """Every API call made so far, by anyone, as the authorizer sees it (a copy: the emulator's thread
        keeps appending)."""
        return list(self.emulator.calls)

    async def call(self, method: str, path: str, body: Any = None, content_type: str | None = None) -> Any:
        status, result = await self.try_call(method, path, body, content_type)
        assert status < 400, f"{method} {path}: {status} {str(result)[:300]}"
        return result

    async def try_call(self, method: str, path: str, body: Any = None,
                       content_type: str | None = None) -> tuple[int, Any]:
        """(HTTP status, decoded body), without failing on errors."""
        headers = {"Content-Type": content_type} if content_type else None
        data = json.dumps(body) if body is not None else None
        if data is not None and headers is None:
            headers = {"Content-Type": "application/merge-patch+json" if method == "PATCH" else "application/json"}
        async with self.session.request(method, self.url + path, data=data, headers=headers) as resp:
            text = await resp.text()
            return resp.status, (json.loads(text) if text else None)

    async def set_status(self, path: str, status: dict[str, Any]) -> dict[str, Any]:
        """Write an object's status through its status subresource (the main resource ignores status)."""
        return await self.call("PATCH", f"{path}/status", {"status": status})

    async def set_deployment_status(self, ns: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        return await self.set_status(f"/apis/apps/v1/namespaces/{ns}/deployments/{name}", status)

    async def delete_cr(self, ns: str, name: str) -> Any:
        return await self.call("DELETE", f"{CR_PATH.format(ns=ns)}/{name}")

    async def get(self, path: str) -> dict[str, Any] | None:
        async with self.session.get(self.url + path) as resp:
            return await resp.json() if resp.status == 200 else None

    async def items(self, path: str) -> list[dict[str, Any]]:
        return (await self.call("GET", path))["items"]

    async def create_cr(self, ns: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self.call("POST", CR_PATH.format(ns=ns), body)

    async def patch_cr(self, ns: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self.call("PATCH", f"{CR_PATH.format(ns=ns)}/{name}", body)

    async def cr(self, ns: str, name: str) -> dict[str, Any] | None:
        return await self.get(f"{CR_PATH.format(ns=ns)}/{name}")

    async def deployment(self, ns: str, name: str) -> dict[str, Any] | None:
        return await self.get(f"/apis/apps/v1/namespaces/{ns}/deployments/{name}")

    async def add_pod(self, ns: str, name: str, owner: str, ip: str, port: int, ready: bool,
                      labels: dict[str, str] | None = None) -> None:
        """A daemon pod; `labels` adds to the daemon labels (LEADER_LABELS: a LeaderWorkerSet group's leader)."""
        # Like a kubelet: the create sets no status, the status subresource does.
        await self.call("POST", f"/api/v1/namespaces/{ns}/pods", {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns,
                         "labels": {"app.kubernetes.io/name": "kvpilot-daemon", "kvpilot.io/inferencedeployment": owner,
                                    **(labels or {})},
                         "annotations": {"kvpilot.io/metrics-port": str(port)}},
        })
        await self.set_pod_ready(ns, name, ip, ready)

    async def set_pod_ready(self, ns: str, name: str, ip: str, ready: bool) -> None:
        await self.set_status(f"/api/v1/namespaces/{ns}/pods/{name}", pod_status(ip, ready))


def pod_status(ip: str, ready: bool) -> dict[str, Any]:
    return {"phase": "Running", "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}


async def eventually(check: Callable[[], Awaitable[Any]], timeout: float = 15.0, interval: float = 0.2,
                     what: str = "condition") -> Any:
    """Poll an async check until it returns a truthy value; fail with the last value otherwise."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}; last value: {last!r}")


@contextlib.asynccontextmanager
async def cluster(tmp_path: Any, validate: bool = False, without: tuple[str, ...] = ()) -> AsyncIterator[Cluster]:
    """A stricter kmock (see emulator.py); validate=True also rejects CRs that fail the CRD's schema or CEL
    rules with 422, as a real server does. `without` leaves resources out (e.g. LORA_KEY: a cluster whose
    chart upgrade did not install the LoRAAdapter CRD)."""
    catalog = {k: v for k, v in RESOURCES.items() if k not in without}

    def serve() -> contextlib.AbstractAsyncContextManager[tuple[StrictEmulator, str]]:
        # Built on the emulator's own loop, where its locks and watch buses are used.
        schemas = {CR_KEY: crd.version_schema(), LORA_KEY: lora_crd.version_schema()}
        return _serve(StrictEmulator(catalog=catalog, schemas=schemas, validate=validate))

    async with on_own_loop(serve, "kmock") as (emulator, url), aiohttp.ClientSession() as session:
        yield Cluster(emulator, url, session)


@contextlib.asynccontextmanager
async def _serve(emulator: StrictEmulator) -> AsyncIterator[tuple[StrictEmulator, str]]:
    async with emulator, kmock.Server(emulator) as server:
        yield emulator, str(server.url)


def write_kubeconfig(path: Any, url: str) -> str:
    cfg = {
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": url}}],
        "users": [{"name": "kmock", "user": {"token": "test-token"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
    }
    file = path / "kubeconfig"
    file.write_text(yaml.safe_dump(cfg))
    return str(file)


@contextlib.contextmanager
def operator(monkeypatch: Any, tmp_path: Any, url: str, metrics_port: int = 0,
             namespaces: list[str] | None = None, peering: str | None = None):
    """The real operator (kvpilot.operator.handlers) in kopf's runner thread: cluster-wide unless namespaces
    are given, standalone unless a peering name is given (as the chart runs it)."""
    monkeypatch.setenv("KUBECONFIG", write_kubeconfig(tmp_path, url))
    monkeypatch.setenv("KVPILOT_OPERATOR_METRICS_PORT", str(metrics_port))
    monkeypatch.setenv("KVPILOT_OPERATOR_METRICS_HOST", "127.0.0.1")
    monkeypatch.setenv("KVPILOT_SCRAPE_TIMEOUT", "0.5")
    monkeypatch.setenv("KVPILOT_OPERATOR_NAMESPACES", ",".join(namespaces or ()))
    monkeypatch.setenv("KVPILOT_OPERATOR_LORA_PERIOD", "0.3")
    scope = [f"--namespace={ns}" for ns in namespaces] if namespaces else ["-A"]
    mode = [f"--peering={peering}"] if peering else ["--standalone"]
    args = ["run", *scope, *mode, "-m", "kvpilot.operator.handlers"]
    with KopfRunner(args, timeout=30) as runner:
        yield runner


class MetricsServer:
    """Plays one daemon's /metrics with values the test controls (plain attributes, read by the server's
    own loop)."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.port = 0
        self.kv = 0.0
        self.waiting = 0.0
        self.running = 0.0
        self.fail = False
        self.hits = 0
        self._stack = contextlib.AsyncExitStack()

    async def _metrics(self, _request: aiohttp.web.Request) -> aiohttp.web.Response:
        self.hits += 1
        if self.fail:
            return aiohttp.web.Response(status=500, text="engine dead")
        text = (
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{model_name="m"}} {self.kv}\n'
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{model_name="m"}} {self.waiting}\n'
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="m"}} {self.running}\n'
        )
        return aiohttp.web.Response(text=text, content_type="text/plain")

    def routes(self, app: aiohttp.web.Application) -> None:
        app.router.add_get("/metrics", self._metrics)

    @contextlib.asynccontextmanager
    async def _serve(self) -> AsyncIterator[None]:
        app = aiohttp.web.Application()
        self.routes(app)
        runner = aiohttp.web.AppRunner(app)
        await runner.setup()
        try:
            await aiohttp.web.TCPSite(runner, self.host, 0).start()
            self.port = runner.addresses[0][1]
            yield
        finally:
            await runner.cleanup()

    async def __aenter__(self) -> MetricsServer:
        await self._stack.enter_async_context(on_own_loop(self._serve, f"metrics-{self.host}"))
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._stack.aclose()
