"""spec.router against the emulator with the real operator: the builtin router's children, scale to zero
and the wake-up on held requests, turning the router off, and the InferencePool with and without its CRD."""

from __future__ import annotations

import json
import pathlib

import aiohttp.web
import jsonschema
import pytest

from operator_support import harness
from operator_support.harness import MetricsServer, cluster, eventually, operator

pytestmark = pytest.mark.timeout(120)
NS = "ml"
POOL_KEY = "inference.networking.k8s.io/v1/inferencepools"
POOL_SCHEMA = json.loads((pathlib.Path(__file__).parent / "schemas" / "inferencepool-v1.json").read_text())
ROUTER_LABELS = {"app.kubernetes.io/name": "kvpilot-router", "kvpilot.io/inferencedeployment": "llm"}


class RouterMetrics(MetricsServer):
    """Plays a router's /metrics: the held gauge and one in-flight series."""

    def __init__(self, host: str) -> None:
        super().__init__(host)
        self.held = 0
        self.inflight = 0

    async def _metrics(self, _request: aiohttp.web.Request) -> aiohttp.web.Response:
        self.hits += 1
        text = ("# TYPE kvpilot:router_held_requests gauge\n"
                f"kvpilot:router_held_requests {self.held}\n"
                "# TYPE kvpilot:router_endpoint_inflight gauge\n"
                f'kvpilot:router_endpoint_inflight{{endpoint="llm-a"}} {self.inflight}\n')
        return aiohttp.web.Response(text=text, content_type="text/plain")


def cr(spec: dict) -> dict:
    return {"apiVersion": "kvpilot.io/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": "llm", "namespace": NS, "uid": "uid-1"}, "spec": spec}


def condition(obj: dict | None, ctype: str) -> dict | None:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == ctype), None)


async def add_router_pod(k, name: str, m: RouterMetrics) -> None:
    await k.call("POST", f"/api/v1/namespaces/{NS}/pods", {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": ROUTER_LABELS,
                     "annotations": {"kvpilot.io/metrics-port": str(m.port)}}})
    await k.set_pod_ready(NS, name, m.host, True)


def paths(ns: str) -> dict[str, str]:
    return {
        "sa": f"/api/v1/namespaces/{ns}/serviceaccounts/llm-router",
        "role": f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles/llm-router",
        "binding": f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings/llm-router",
        "daemons": f"/api/v1/namespaces/{ns}/services/llm-daemons",
        "router": f"/apis/apps/v1/namespaces/{ns}/deployments/llm-router",
        "pdb": f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets/llm-router",
    }


CPU_POOL = {"nodeSelector": {"node-pool": "cpu"},
            "tolerations": [{"key": "node-pool", "operator": "Equal", "value": "cpu", "effect": "NoSchedule"}]}
ROUTED = {"model": {"uri": "hf://org/m"}, "router": {"enabled": True, **CPU_POOL},
          "nodeSelector": {"gpu": "h100"},  # the daemons': not the routers'
          "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 2, "scaleToZeroAfterSeconds": 1,
                          "stableWindowSeconds": 5, "panicWindowSeconds": 2, "metricsIntervalSeconds": 1}}


async def replicas_are(k, n: int):
    d = await k.deployment(NS, "llm")
    return d if d and d["spec"]["replicas"] == n else None


async def test_builtin_router_scale_to_zero_wake_up_and_removal(monkeypatch, tmp_path):
    async with cluster(tmp_path, validate=True) as k, MetricsServer("127.0.0.2") as daemon, \
            RouterMetrics("127.0.0.4") as router:
        with operator(monkeypatch, tmp_path, k.url):
            await k.create_cr(NS, cr(ROUTED))
            children = {key: await eventually(lambda p=p: k.get(p), what=key) for key, p in paths(NS).items()}
            assert children["router"]["spec"]["replicas"] == 2
            router_pod = children["router"]["spec"]["template"]["spec"]
            assert router_pod["nodeSelector"] == CPU_POOL["nodeSelector"]  # through the API server's pruning
            assert router_pod["tolerations"] == CPU_POOL["tolerations"]
            assert "--replica-slots" in router_pod["containers"][0]["args"]
            assert children["role"]["rules"][0]["resources"] == ["endpointslices"]
            assert all(c["metadata"]["ownerReferences"][0]["uid"] == "uid-1" for c in children.values())
            svc = await k.get(f"/api/v1/namespaces/{NS}/services/llm")
            assert svc["spec"]["selector"] == ROUTER_LABELS
            await eventually(lambda: replicas_are(k, 1), what="a new model starts with one replica")

            # Idle daemon and idle routers: after scaleToZeroAfterSeconds the daemons go to zero.
            await k.add_pod(NS, "llm-a", "llm", daemon.host, daemon.port, ready=True)
            await add_router_pod(k, "llm-router-a", router)
            await k.set_deployment_status(NS, "llm-router", {"replicas": 2, "readyReplicas": 2})
            await eventually(lambda: replicas_are(k, 0), what="scaled to zero")
            await k.call("DELETE", f"/api/v1/namespaces/{NS}/pods/llm-a")

            # A held request wakes it at once.
            router.held = 1
            await eventually(lambda: replicas_are(k, 1), timeout=10, what="woken by a held request")

            async def held_reported():
                obj = await k.cr(NS, "llm")
                st = (obj or {}).get("status") or {}
                return obj if (st.get("router") or {}).get("heldRequests") == 1 else None
            obj = await eventually(held_reported, what="status.router.heldRequests")
            assert obj["status"]["router"]["readyReplicas"] == 2
            assert condition(obj, "RouterReady")["status"] == "True"

            # Router off: the Service selects the daemons again and the router's objects go.
            await k.patch_cr(NS, "llm", {"spec": {"router": {"enabled": False}, "autoscaling": {"minReplicas": 1}}})

            async def gone():
                return all([await k.get(p) is None for p in paths(NS).values()])
            await eventually(gone, what="router objects deleted")
            svc = await k.get(f"/api/v1/namespaces/{NS}/services/llm")
            assert svc["spec"]["selector"]["app.kubernetes.io/name"] == "kvpilot-daemon"


async def test_min_replicas_zero_without_router_is_refused_by_the_api(tmp_path):
    async with cluster(tmp_path, validate=True) as k:
        spec = {**ROUTED, "router": {"enabled": False}}
        status, body = await k.try_call("POST", harness.CR_PATH.format(ns=NS), cr(spec))
        assert status == 422 and "minReplicas 0 needs router.enabled" in json.dumps(body)


@pytest.mark.parametrize("router, fragment", [
    ({"tolerations": "node-pool=cpu:NoSchedule"}, "spec.router.tolerations"),
    ({"affinity": {"nodeAfinity": {}}}, "spec.router.affinity.nodeAfinity"),
])
async def test_wrong_router_scheduling_is_refused_by_the_api(tmp_path, router, fragment):
    async with cluster(tmp_path, validate=True) as k:
        spec = {"model": {"uri": "hf://org/m"}, "router": {"enabled": True, **router}}
        status, body = await k.try_call("POST", harness.CR_PATH.format(ns=NS), cr(spec))
        assert status == 422 and fragment in json.dumps(body), body


POOL_SPEC = {"model": {"uri": "hf://org/m"}, "router": {
    "enabled": True, "mode": "inferencePool", "endpointPickerRef": {"name": "epp", "port": {"number": 9002}}}}


async def test_inference_pool_is_emitted(monkeypatch, tmp_path):
    async with cluster(tmp_path) as k:
        with operator(monkeypatch, tmp_path, k.url):
            await k.create_cr(NS, cr(POOL_SPEC))
            pool = await eventually(lambda: k.get(f"/apis/{POOL_KEY.replace('/inferencepools', '')}/namespaces/"
                                                  f"{NS}/inferencepools/llm"), what="InferencePool")
            jsonschema.validate({key: pool[key] for key in ("apiVersion", "kind", "spec")}
                                | {"metadata": {"name": pool["metadata"]["name"]}}, POOL_SCHEMA)

            async def applied():
                obj = await k.cr(NS, "llm")
                c = condition(obj, "RouterReady")
                return obj if c and c["reason"] == "InferencePoolApplied" else None
            obj = await eventually(applied, what="RouterReady")
            assert obj["status"]["router"]["inferencePool"] == "llm"
            assert await k.get(paths(NS)["router"]) is None  # no router of ours in this mode


def without_pool_api(monkeypatch) -> list[str]:
    return harness.without_resource(monkeypatch, POOL_KEY)


async def test_without_the_inference_pool_crd_a_condition_and_serving_goes_on(monkeypatch, tmp_path):
    refused = without_pool_api(monkeypatch)
    async with cluster(tmp_path) as k:
        with operator(monkeypatch, tmp_path, k.url):
            await k.create_cr(NS, cr(POOL_SPEC))

            async def missing():
                obj = await k.cr(NS, "llm")
                c = condition(obj, "RouterReady")
                return c if c and c["reason"] == "InferencePoolCRDMissing" else None
            c = await eventually(missing, what="RouterReady condition")
            assert c["status"] == "False" and "Gateway API Inference Extension" in c["message"]
            assert await k.deployment(NS, "llm") is not None  # the daemons are deployed all the same
            assert await k.get(f"/api/v1/namespaces/{NS}/services/llm") is not None
            # Retried with a long delay, not in a loop: apply tries PATCH, then POST.
            assert 2 <= len(refused) <= 4, refused
