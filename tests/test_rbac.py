"""RBAC derived from use: the operator runs against the emulator, which records every API call it makes (and
the finalizers check of OwnerReferencesPermissionEnforcement); each call must be allowed by the rules
`helm template` renders for that mode, and every rule the chart grants must be used by some call. The
operator runs with the scope and peering arguments of the rendered Deployment, next to the peering objects
the chart renders, so kopf's peering (the chart's default) is exercised like the rest."""

from __future__ import annotations

import pathlib
import subprocess

import pytest
import yaml

from operator_support import harness
from operator_support.calls import ApiCall
from operator_support.harness import CR_PATH, LORA_PATH, MetricsServer, cluster, eventually, operator
from operator_support.rbac import Authorizer, Grant, used_by

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "kvpilot"
HELM = ROOT / ".venv" / "bin" / "helm"
RELEASE_NS = "kvpilot-system"
LEGACY_FINALIZER = "kopf.zalando.org/KopfFinalizerMarker"

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow,
              pytest.mark.skipif(not HELM.exists(), reason="helm not installed: run `make install`")]

# mode: (helm --set values, what the run uses besides the basics). Peering and the builtin router are on
# unless the values turn them off; InferencePools (spec.router.mode inferencePool) and LeaderWorkerSets
# (spec.parallelism over several nodes) are off unless turned on.
MODES = {
    "cluster-wide": ((), {"router"}),
    "watch-namespaces": (("watchNamespaces={team-a,team-b}", "gatewayInferenceExtension.enabled=true",
                          "leaderWorkerSet.enabled=true"), {"router", "inferencePool", "lws"}),
    "standalone": (("peering.enabled=false", "router.enabled=false"), set()),
}
PEERINGS = {"ClusterKopfPeering": "clusterkopfpeerings", "KopfPeering": "kopfpeerings"}


def render(*sets: str) -> list[dict]:
    args = [str(HELM), "template", "kvpilot", str(CHART), "--namespace", RELEASE_NS]
    for s in sets:
        args += ["--set", s]
    out = subprocess.run(args, capture_output=True, text=True, check=True, timeout=60).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def authorizer(docs: list[dict]) -> Authorizer:
    sa = next(d for d in docs if d["kind"] == "ServiceAccount")["metadata"]["name"]
    return Authorizer(docs, sa, RELEASE_NS)


def cr(ns: str, name: str, spec: dict, finalizers: list[str] | None = None) -> dict:
    meta = {"name": name, "namespace": ns, **({"finalizers": finalizers} if finalizers else {})}
    return {"apiVersion": "kvpilot.io/v1alpha1", "kind": "InferenceDeployment", "metadata": meta, "spec": spec}


def operator_args(docs: list[dict]) -> tuple[list[str] | None, str | None]:
    """(namespaces (None: all), peering name (None: standalone)) from the rendered operator Deployment."""
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    namespaces = [a.removeprefix("--namespace=") for a in args if a.startswith("--namespace=")]
    peering = next((a.removeprefix("--peering=") for a in args if a.startswith("--peering=")), None)
    assert bool(namespaces) != ("--all-namespaces" in args), args
    assert (peering is None) == ("--standalone" in args), args
    return namespaces or None, peering


async def add_peerings(k, docs: list[dict]) -> None:
    """Create the peering objects the chart renders (templates/peering.yaml), as `helm install` would."""
    for doc in (d for d in docs if d["kind"] in PEERINGS):
        ns = doc["metadata"].get("namespace")
        where = f"namespaces/{ns}/" if ns else ""
        await k.call("POST", f"/apis/kopf.dev/v1/{where}{PEERINGS[doc['kind']]}", doc)


async def exercise(k, ns: str, metrics: MetricsServer, features: set[str]) -> None:
    """Create, update, status, `kubectl scale`, autoscaling, the router's modes on and off (those in
    features) and delete of one InferenceDeployment."""
    path = f"{CR_PATH.format(ns=ns)}/llm"
    await k.create_cr(ns, cr(ns, "llm", {"model": {"uri": "hf://org/m"}, "replicas": 2}))
    await eventually(lambda: k.deployment(ns, "llm"), what="Deployment")
    await eventually(lambda: k.get(f"/api/v1/namespaces/{ns}/services/llm"), what="Service")

    async def observed(gen: int):
        obj = await k.cr(ns, "llm")
        return obj if ((obj or {}).get("status") or {}).get("observedGeneration") == gen else None
    await eventually(lambda: observed(1), what="status of generation 1")

    await k.patch_cr(ns, "llm", {"spec": {"replicas": 1, "engine": {"maxNumSeqs": 7}}})
    await eventually(lambda: observed(2), what="status of generation 2")
    await k.set_deployment_status(ns, "llm", {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1})

    await k.call("PATCH", f"{path}/scale", {"spec": {"replicas": 2}})  # kubectl scale

    async def replicas(low: int):
        d = await k.deployment(ns, "llm")
        return d if d and d["spec"]["replicas"] >= low else None
    await eventually(lambda: replicas(2), what="scaled to 2")

    # Two ready pods at 95% KV-cache usage against a 50% target: the autoscaler wants more.
    metrics.kv = 0.95
    for pod in ("llm-a", "llm-b"):
        await k.add_pod(ns, pod, "llm", metrics.host, metrics.port, ready=True)
    await k.patch_cr(ns, "llm", {"spec": {"autoscaling": {
        "enabled": True, "minReplicas": 1, "maxReplicas": 4, "targetKVCacheUsage": 0.5,
        "stableWindowSeconds": 5, "panicWindowSeconds": 2, "metricsIntervalSeconds": 1}}})
    await eventually(lambda: replicas(3), what="autoscaled up")

    if "lws" in features:
        await exercise_lws(k, ns, metrics)
    if "router" in features:
        await k.patch_cr(ns, "llm", {"spec": {"router": {"enabled": True}}})
        await eventually(lambda: k.deployment(ns, "llm-router"), what="the router's Deployment")
        await k.patch_cr(ns, "llm", {"spec": {"router": {"enabled": False}}})
        # The operator removes the router's objects in order, its ServiceAccount last.
        await eventually(lambda: _gone(k, f"/api/v1/namespaces/{ns}/serviceaccounts/llm-router"),
                         what="the router removed")
    if "inferencePool" in features:
        picker = {"name": "epp", "port": {"number": 9002}}
        await k.patch_cr(ns, "llm", {"spec": {"router": {"enabled": True, "mode": "inferencePool",
                                                         "endpointPickerRef": picker}}})

        async def pool_reported():
            obj = await k.cr(ns, "llm")
            return ((obj or {}).get("status") or {}).get("router", {}).get("mode") == "inferencePool"
        await eventually(pool_reported, what="the InferencePool in the status")
        assert await k.get(f"/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools/llm")
        await k.patch_cr(ns, "llm", {"spec": {"router": {"enabled": False}}})
        await eventually(lambda: _gone(k, f"/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools/llm"),
                         what="the InferencePool removed")

    await exercise_lora(k, ns)
    await k.delete_cr(ns, "llm")
    await eventually(lambda: _gone(k, path), what="InferenceDeployment deleted")


async def exercise_lws(k, ns: str, metrics: MetricsServer) -> None:
    """Several nodes a replica: the Deployment gives way to a LeaderWorkerSet, which the autoscaler scales
    through its scale subresource, and back on one node the LeaderWorkerSet goes."""
    lws = f"{harness.LWS_PATH.format(ns=ns)}/llm"
    await k.patch_cr(ns, "llm", {"spec": {"parallelism": {"tensor": 2}, "resources": {"gpusPerNode": 1}}})
    await eventually(lambda: k.get(lws), what="the LeaderWorkerSet")
    await eventually(lambda: _gone(k, f"/apis/apps/v1/namespaces/{ns}/deployments/llm"), what="Deployment removed")
    await k.add_pod(ns, "llm-0", "llm", metrics.host, metrics.port, ready=True, labels=harness.LEADER_LABELS)

    async def scaled():
        obj = await k.get(lws)
        return obj if obj["spec"]["replicas"] >= 2 else None
    await eventually(scaled, what="the LeaderWorkerSet scaled")
    await k.patch_cr(ns, "llm", {"spec": {"resources": {"gpusPerNode": 8}}})
    await eventually(lambda: _gone(k, lws), what="the LeaderWorkerSet removed")
    await eventually(lambda: k.deployment(ns, "llm"), what="the Deployment again")


async def exercise_lora(k, ns: str) -> None:
    """A LoRAAdapter on the base: the operator's finalizer on and off, its status, and reconcile listing
    the adapters for their folders (engine.enableLora)."""
    lora = f"{LORA_PATH.format(ns=ns)}/sql"
    await k.patch_cr(ns, "llm", {"spec": {"engine": {"enableLora": True}}})
    await k.call("POST", LORA_PATH.format(ns=ns), {
        "apiVersion": "kvpilot.io/v1alpha1", "kind": "LoRAAdapter", "metadata": {"name": "sql", "namespace": ns},
        "spec": {"baseModel": "llm", "uri": "file:///opt/adapters/sql"}})

    async def reported():
        obj = await k.get(lora)
        return obj if ((obj or {}).get("status") or {}).get("conditions") and obj["metadata"].get("finalizers") \
            else None
    await eventually(reported, what="the LoRAAdapter's finalizer and status")
    await k.call("DELETE", lora)
    await eventually(lambda: _gone(k, lora), what="LoRAAdapter deleted")


async def _gone(k, path: str) -> bool:
    return await k.get(path) is None


async def operator_calls(monkeypatch, tmp_path, docs: list[dict], features: set[str]) -> list[ApiCall]:
    namespaces, peering = operator_args(docs)
    ns = namespaces[0] if namespaces else "ml"
    async with cluster(tmp_path) as k, MetricsServer("127.0.0.2") as m:
        await add_peerings(k, docs)
        # Left over from the kopf daemon era: the operator removes this finalizer at startup.
        await k.create_cr(ns, cr(ns, "old", {"model": {"uri": "hf://org/m"}}, [LEGACY_FINALIZER]))
        with operator(monkeypatch, tmp_path, k.url, namespaces=namespaces, peering=peering):
            await exercise(k, ns, m, features)
        return [c for c in k.calls if c.user]  # the operator's calls carry its token; the test's carry none


@pytest.mark.parametrize("mode", list(MODES))
async def test_rbac_allows_every_call_and_grants_nothing_unused(mode, monkeypatch, tmp_path):
    sets, features = MODES[mode]
    docs = render(*sets)
    calls = await operator_calls(monkeypatch, tmp_path, docs, features)
    kinds = {(c.verb, c.full_resource) for c in calls}
    # The run did what it was meant to: otherwise an empty record would pass.
    assert {("create", "deployments"), ("patch", "inferencedeployments/status"), ("create", "events"),
            ("update", "inferencedeployments/finalizers"), ("patch", "loraadapters/status"),
            ("patch", "loraadapters"), ("list", "loraadapters")} <= kinds, kinds
    peerings = {c.resource for c in calls if c.group == "kopf.dev" and c.verb == "patch"}
    assert peerings == {PEERINGS[d["kind"]] for d in docs if d["kind"] in PEERINGS}, peerings
    auth = authorizer(docs)
    denied = sorted({str(c) for c in calls if not auth.allows(c)})
    assert denied == [], "the chart's RBAC does not allow:\n" + "\n".join(denied)
    unused = sorted((g.group, g.resource, g.verb) for g in auth.grants() if not used_by(g, calls))
    assert unused == [], f"granted but never used: {unused}"


@pytest.mark.parametrize("mode", list(MODES))
def test_no_wildcards_and_no_secrets(mode):
    docs = render(*MODES[mode][0])
    for role in (d for d in docs if d["kind"] in ("ClusterRole", "Role")):
        for rule in role["rules"]:
            for field in ("apiGroups", "resources", "verbs"):
                assert not any("*" in v for v in rule[field]), (role["metadata"]["name"], rule)
            assert "secrets" not in rule["resources"]
            assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"])


def test_the_authorizer_denies_what_the_rules_do_not_grant():
    docs = render("watchNamespaces={team-a}")
    auth = authorizer(docs)
    create = ApiCall("create", "apps", "v1", "deployments", namespace="team-a")
    assert auth.allows(create)
    assert not auth.allows(ApiCall("create", "apps", "v1", "deployments", namespace="team-b"))  # not watched
    assert not auth.allows(ApiCall("list", "apps", "v1", "deployments"))  # cluster scope
    assert not auth.allows(ApiCall("get", "", "v1", "secrets", namespace="team-a"))
    assert not auth.allows(ApiCall("update", "apps", "v1", "deployments", namespace="team-a"))
    assert Grant("apps", "deployments", "create", "team-a") in auth.grants()
    assert not authorizer(render()).allows(ApiCall("create", "kopf.dev", "v1", "kopfpeerings", namespace="x"))


def test_standalone_chart_grants_no_peering():
    for sets in (("peering.enabled=false",), ("peering.enabled=false", "watchNamespaces={team-a}")):
        grants = authorizer(render(*sets)).grants()
        assert grants and not any(g.group == "kopf.dev" for g in grants)
