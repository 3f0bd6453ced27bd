"""spec.parallelism over several nodes against the emulator with the real operator: a LeaderWorkerSet in place
of the Deployment (and back), the status from its groups, the autoscaler scaling groups through the LWS scale
subresource while scraping leaders only, and a cluster without the LeaderWorkerSet CRD."""

from __future__ import annotations

import json
import pathlib

import jsonschema
import pytest

from operator_support import harness
from operator_support.harness import LEADER_LABELS, LWS_KEY, LWS_PATH, MetricsServer, cluster, eventually
from operator_support.harness import operator as run_operator

pytestmark = pytest.mark.timeout(120)
NS = "ml"
LWS_SCHEMA = json.loads((pathlib.Path(__file__).parent / "schemas" / "leaderworkerset-v1.json").read_text())
DEPLOYMENT = f"/apis/apps/v1/namespaces/{NS}/deployments/llm"
LWS = f"{LWS_PATH.format(ns=NS)}/llm"
SERVICE = f"/api/v1/namespaces/{NS}/services/llm"
TWO_NODES = {"parallelism": {"tensor": 2, "pipeline": 2}, "resources": {"gpusPerNode": 2}}
ONE_NODE = {"parallelism": {"tensor": 2, "pipeline": 1}}


def cr(spec: dict) -> dict:
    return {"apiVersion": "kvpilot.io/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": "llm", "namespace": NS, "uid": "uid-1"},
            "spec": {"model": {"uri": "hf://org/m"}, **spec}}


def condition(obj: dict | None, ctype: str) -> dict | None:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == ctype), None)


async def gone(k, path: str) -> bool:
    return await k.get(path) is None


async def test_several_nodes_run_a_leader_worker_set_and_one_node_a_deployment(monkeypatch, tmp_path):
    async with cluster(tmp_path) as k:
        with run_operator(monkeypatch, tmp_path, k.url):
            await k.create_cr(NS, cr({"replicas": 2, **ONE_NODE}))
            dep = await eventually(lambda: k.get(DEPLOYMENT), what="Deployment")
            assert dep["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"

            await k.patch_cr(NS, "llm", {"spec": TWO_NODES})
            lws = await eventually(lambda: k.get(LWS), what="LeaderWorkerSet")
            jsonschema.validate({key: lws[key] for key in ("apiVersion", "kind", "spec")}
                                | {"metadata": {"name": lws["metadata"]["name"]}}, LWS_SCHEMA)
            assert lws["spec"]["replicas"] == 2 and lws["spec"]["leaderWorkerTemplate"]["size"] == 2
            assert lws["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
            await eventually(lambda: gone(k, DEPLOYMENT), what="the Deployment removed")
            svc = await k.get(SERVICE)
            assert svc["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"

            # The LWS controller reports one ready group of two: the CR's status counts groups.
            await k.set_status(LWS, {"replicas": 2, "readyReplicas": 1, "updatedReplicas": 2,
                                     "conditions": [{"type": "Available", "status": "True"}]})

            async def serving():
                obj = await k.cr(NS, "llm")
                c = condition(obj, "Ready")
                return obj if c and c["status"] == "True" else None
            obj = await eventually(serving, what="Ready from the LWS")
            assert condition(obj, "Ready")["message"] == "1/2 groups ready"
            assert obj["status"]["workload"] == "LeaderWorkerSet" and obj["status"]["readyReplicas"] == 1
            assert "leaderworkerset.sigs.k8s.io/worker-index=0" in obj["status"]["selector"]

            # Back on one node: a Deployment again, and the LWS goes.
            await k.patch_cr(NS, "llm", {"spec": {"resources": {"gpusPerNode": 4}}})
            await eventually(lambda: k.get(DEPLOYMENT), what="the Deployment again")
            await eventually(lambda: gone(k, LWS), what="the LeaderWorkerSet removed")
            # (The Service's selector drops the leader label on a real server, whose server-side apply removes
            # what the manager stops setting; the emulator's apply is a merge patch: tests/operator_support.)

            async def deployment_again():
                obj = await k.cr(NS, "llm")
                return obj if (obj.get("status") or {}).get("workload") == "Deployment" else None
            await eventually(deployment_again, what="status.workload Deployment")


async def test_the_autoscaler_scales_groups_through_the_scale_subresource(monkeypatch, tmp_path):
    async with cluster(tmp_path) as k, MetricsServer("127.0.0.2") as leader, MetricsServer("127.0.0.3") as worker:
        with run_operator(monkeypatch, tmp_path, k.url):
            spec = {**TWO_NODES, "autoscaling": {
                "enabled": True, "minReplicas": 1, "maxReplicas": 4, "targetKVCacheUsage": 0.5,
                "stableWindowSeconds": 5, "panicWindowSeconds": 2, "metricsIntervalSeconds": 1}}
            await k.create_cr(NS, cr(spec))
            lws = await eventually(lambda: k.get(LWS), what="LeaderWorkerSet")
            assert lws["spec"]["replicas"] == 1
            leader.kv, worker.fail = 0.95, True
            await k.add_pod(NS, "llm-0", "llm", leader.host, leader.port, ready=True, labels=LEADER_LABELS)
            # A worker of the group: no /metrics, never scraped, never counted as a replica.
            await k.add_pod(NS, "llm-0-1", "llm", worker.host, worker.port, ready=True,
                            labels={"leaderworkerset.sigs.k8s.io/worker-index": "1"})

            async def scaled():
                obj = await k.get(LWS)
                return obj if obj["spec"]["replicas"] >= 2 else None
            await eventually(scaled, what="the LWS scaled up")
            scales = [c for c in k.calls if c.user and c.resource == "leaderworkersets" and c.subresource == "scale"]
            assert scales and all(c.verb == "patch" for c in scales)
            assert not [c for c in k.calls if c.user and c.resource == "deployments" and c.verb == "patch"]
            assert worker.hits == 0 and leader.hits > 0

            async def reported():
                obj = await k.cr(NS, "llm")
                st = (obj or {}).get("status") or {}
                return st if st.get("metrics", {}).get("sampledPods") == 1 and st.get("lastScaleTime") else None
            st = await eventually(reported, what="the scale in the status")
            assert st["metrics"]["failedPods"] == 0


def without_lws_api(monkeypatch) -> list[str]:
    return harness.without_resource(monkeypatch, LWS_KEY)


async def test_without_the_lws_crd_a_condition_and_the_deployment_keeps_serving(monkeypatch, tmp_path):
    refused = without_lws_api(monkeypatch)
    async with cluster(tmp_path) as k:
        with run_operator(monkeypatch, tmp_path, k.url):
            await k.create_cr(NS, cr({}))
            await eventually(lambda: k.get(DEPLOYMENT), what="Deployment")
            await k.patch_cr(NS, "llm", {"spec": TWO_NODES})

            async def missing():
                obj = await k.cr(NS, "llm")
                c = condition(obj, "Ready")
                return obj if c and c["reason"] == "LeaderWorkerSetCRDMissing" else None
            obj = await eventually(missing, what="the Ready condition")
            c = condition(obj, "Ready")
            assert c["status"] == "False" and "install LeaderWorkerSet" in c["message"]
            assert condition(obj, "Progressing")["reason"] == "LeaderWorkerSetCRDMissing"
            # Nothing else broke: the Deployment from before still runs behind a Service that selects it.
            assert await k.get(DEPLOYMENT) is not None
            svc = await k.get(SERVICE)
            assert "leaderworkerset.sigs.k8s.io/worker-index" not in svc["spec"]["selector"]
            assert refused and len(refused) <= 6, refused  # retried with a long delay, not in a loop
