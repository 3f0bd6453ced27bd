"""kopf + kmock integration: the real operator against the Kubernetes API emulator on 127.0.0.1."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from operator_support.harness import MetricsServer, cluster, eventually, free_port, operator

pytestmark = pytest.mark.timeout(120)
NS = "ml"


def cr(name: str, spec: dict, uid: str = "uid-1", generation: int = 1) -> dict:
    return {"apiVersion": "kvpilot.io/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": name, "namespace": NS, "uid": uid, "generation": generation,
                         "resourceVersion": "1"}, "spec": spec}


def condition(obj: dict | None, ctype: str) -> dict | None:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == ctype:
            return c
    return None


async def test_create_update_and_status(monkeypatch, tmp_path):
    metrics_port = free_port()
    async with cluster(tmp_path) as k:
        with operator(monkeypatch, tmp_path, k.url, metrics_port):
            spec = {"model": {"uri": "hf://org/model", "name": "m"}, "replicas": 2,
                    "resources": {"gpus": 2}, "autoscaling": {"metricsIntervalSeconds": 1}}
            await k.create_cr(NS, cr("llm", spec))

            dep = await eventually(lambda: k.deployment(NS, "llm"), what="Deployment")
            svc = await eventually(lambda: k.get(f"/api/v1/namespaces/{NS}/services/llm"), what="Service")
            pdb = await eventually(lambda: k.get(f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets/llm"),
                                   what="PDB")
            for child in (dep, svc, pdb):
                ref = child["metadata"]["ownerReferences"][0]
                assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == \
                    ("InferenceDeployment", "llm", "uid-1", True)
                assert child["metadata"]["labels"]["kvpilot.io/inferencedeployment"] == "llm"
            assert dep["spec"]["replicas"] == 2
            container = dep["spec"]["template"]["spec"]["containers"][0]
            assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
            assert "--max-num-seqs" in container["args"]
            assert svc["spec"]["ports"][0]["port"] == 8000

            async def written():
                obj = await k.cr(NS, "llm")
                return obj if condition(obj, "ScalingActive") and (obj.get("status") or {}).get("url") else None
            obj = await eventually(written, what="status")
            assert obj["status"]["selector"] == "app.kubernetes.io/name=kvpilot-daemon,kvpilot.io/inferencedeployment=llm"
            assert obj["status"]["url"] == "http://llm.ml.svc:8000/v1"
            assert obj["status"]["observedGeneration"] == 1
            assert condition(obj, "Ready")["status"] == "False"
            assert condition(obj, "ScalingActive")["reason"] == "AutoscalingDisabled"

            # A spec change patches the Deployment (args and replicas) and drops nothing else.
            await k.patch_cr(NS, "llm", {"metadata": {"generation": 2},
                                         "spec": {"replicas": 1, "engine": {"maxNumSeqs": 7}}})

            async def patched():
                d = await k.deployment(NS, "llm")
                args = d["spec"]["template"]["spec"]["containers"][0]["args"]
                return d if d["spec"]["replicas"] == 1 and args[args.index("--max-num-seqs") + 1] == "7" else None
            await eventually(patched, what="patched Deployment")
            # One replica: the PDB would block node drains, so it goes away.
            await eventually(lambda: _absent(k, f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets/llm"),
                             what="PDB removed")

            # The Deployment reports a ready pod: the CR's Ready condition follows.
            await k.set_deployment_status(NS, "llm", {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1})

            async def ready():
                obj = await k.cr(NS, "llm")
                c = condition(obj, "Ready")
                return obj if c and c["status"] == "True" and obj["status"].get("observedGeneration") == 2 else None
            obj = await eventually(ready, what="Ready=True")
            assert condition(obj, "Progressing")["reason"] == "Complete"
            assert obj["status"]["readyReplicas"] == 1

            async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{metrics_port}/metrics") as r:
                text = await r.text()
            assert 'kvpilot_operator_reconciles_total{name="llm",namespace="ml",result="ok"}' in text


async def _absent(k, path: str) -> bool:
    return await k.get(path) is None


async def test_invalid_spec_is_a_condition(monkeypatch, tmp_path):
    async with cluster(tmp_path) as k:
        with operator(monkeypatch, tmp_path, k.url):
            bad = {"model": {"uri": "s3://bucket/model"},
                   "autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}
            await k.create_cr(NS, cr("bad", bad, uid="uid-bad"))
            good = {"model": {"uri": "builtin://smollm2-135m"}}
            await k.create_cr(NS, cr("good", good, uid="uid-good"))

            async def reported():
                c = condition(await k.cr(NS, "bad"), "Progressing")
                return c if c and c["reason"] == "InvalidSpec" else None
            c = await eventually(reported, what="InvalidSpec condition")
            assert c["status"] == "False"
            assert "model.uri" in c["message"] and "minReplicas" in c["message"]
            assert condition(await k.cr(NS, "bad"), "Ready")["reason"] == "InvalidSpec"
            # The operator keeps working: the valid one is reconciled, the invalid one gets no children.
            await eventually(lambda: k.deployment(NS, "good"), what="Deployment of the valid CR")
            assert await k.deployment(NS, "bad") is None

            # Fixing the spec converges.
            await k.patch_cr(NS, "bad", {"spec": {"model": {"uri": "hf://org/m"}, "autoscaling": {"minReplicas": 1}}})
            dep = await eventually(lambda: k.deployment(NS, "bad"), what="Deployment after the fix")
            assert dep["spec"]["replicas"] == 1  # autoscaling on: starts at minReplicas


async def test_autoscaling_up_on_kv_pressure_and_down_after_delay(monkeypatch, tmp_path):
    delay = 6.0
    async with cluster(tmp_path) as k, MetricsServer("127.0.0.2") as m1, MetricsServer("127.0.0.3") as m2:
        with operator(monkeypatch, tmp_path, k.url):
            spec = {"model": {"uri": "builtin://smollm2-135m"},
                    "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4,
                                    "targetKVCacheUsage": 0.5, "stableWindowSeconds": 5, "panicWindowSeconds": 2,
                                    "scaleDownDelaySeconds": int(delay), "metricsIntervalSeconds": 1}}
            await k.create_cr(NS, cr("auto", spec, uid="uid-auto"))
            await eventually(lambda: k.deployment(NS, "auto"), what="Deployment")
            m1.kv = 0.2
            await k.add_pod(NS, "auto-a", "auto", "127.0.0.2", m1.port, ready=True)
            # A pod of another InferenceDeployment must not be scraped (labels are filtered client-side).
            await k.add_pod(NS, "other-a", "other", "127.0.0.3", m2.port, ready=True)

            async def sampled():
                obj = await k.cr(NS, "auto")
                st = (obj or {}).get("status") or {}
                return st if st.get("metrics", {}).get("sampledPods") == 1 else None
            st = await eventually(sampled, what="first metrics sample")
            assert st["metrics"]["kvCacheUsagePercent"] == 20
            assert (await k.deployment(NS, "auto"))["spec"]["replicas"] == 1

            # KV pressure: 0.95 on one pod against a 0.5 target wants 2 replicas.
            m1.kv = 0.95

            async def replicas(n):
                d = await k.deployment(NS, "auto")
                return d if d["spec"]["replicas"] == n else None
            await eventually(lambda: replicas(2), what="scale up to 2")
            assert m2.hits == 0

            # The new pod is still loading: capacity on its way, no further scale-up meanwhile.
            m2.kv = 0.0
            await k.add_pod(NS, "auto-b", "auto", "127.0.0.3", m2.port, ready=False)
            await asyncio.sleep(2.5)
            assert (await k.deployment(NS, "auto"))["spec"]["replicas"] == 2
            obj = await k.cr(NS, "auto")
            assert obj["status"]["lastScaleTime"]
            assert condition(obj, "ScalingActive")["status"] == "True"
            events = await k.items(f"/api/v1/namespaces/{NS}/events")
            assert any(e["reason"] == "ScaledUp" and e["involvedObject"]["name"] == "auto" for e in events)

            # Load drops: the replicas hold for at least the delay, then come down.
            await k.set_pod_ready(NS, "auto-b", "127.0.0.3", ready=True)
            m1.kv = m2.kv = 0.05
            lowered = time.monotonic()
            while time.monotonic() - lowered < delay:
                assert (await k.deployment(NS, "auto"))["spec"]["replicas"] == 2, "scaled down before the delay"
                await asyncio.sleep(0.2)
            await eventually(lambda: replicas(1), timeout=20, what="scale down to 1")
            events = await k.items(f"/api/v1/namespaces/{NS}/events")
            assert any(e["reason"] == "ScaledDown" for e in events)


async def test_python_m_entry_point_runs_the_operator(tmp_path):
    """`python -m kvpilot.operator` (what `kvpilot operator` calls) reconciles and stops cleanly on SIGTERM."""
    import os
    import signal
    import sys

    from operator_support.harness import write_kubeconfig

    async with cluster(tmp_path) as k:
        env = {**os.environ, "KUBECONFIG": write_kubeconfig(tmp_path, k.url)}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvpilot.operator", "-A", "--standalone", "--metrics-port", "0",
            "--log-level", "WARNING", env=env, cwd=str(tmp_path),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        try:
            await k.create_cr(NS, cr("cli", {"model": {"uri": "hf://org/m"}}, uid="uid-cli"))
            await eventually(lambda: k.deployment(NS, "cli"), timeout=30, what="Deployment from python -m")
        finally:
            proc.send_signal(signal.SIGTERM)
            out, _ = await asyncio.wait_for(proc.communicate(), timeout=20)
        assert proc.returncode == 0, out.decode()[-2000:]


async def test_restart_of_the_operator_causes_no_rollout(monkeypatch, tmp_path):
    """The resume after a restart re-applies the same manifests: the pod template (a rollout) stays as it was."""
    async with cluster(tmp_path) as k:
        spec = {"model": {"uri": "hf://org/m"}, "replicas": 2, "engine": {"extraArgs": ["--seed", "1"]}}
        with operator(monkeypatch, tmp_path, k.url):
            await k.create_cr(NS, cr("llm", spec, uid="uid-r"))
            before = await eventually(lambda: k.deployment(NS, "llm"), what="Deployment")
        # While it is down, the Service goes: its return shows that the restarted operator reconciled.
        await k.call("DELETE", f"/api/v1/namespaces/{NS}/services/llm")
        with operator(monkeypatch, tmp_path, k.url):
            await eventually(lambda: k.get(f"/api/v1/namespaces/{NS}/services/llm"), what="Service re-created")
            after = await k.deployment(NS, "llm")
        assert after["spec"]["template"] == before["spec"]["template"]
        assert after["spec"]["replicas"] == before["spec"]["replicas"] == 2
