"""The Helm chart: helm lint, helm template, and every rendered manifest through kubernetes-validate."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "kvpilot"
HELM = ROOT / ".venv" / "bin" / "helm"
K8S_VERSION = "1.30.0"

pytestmark = pytest.mark.skipif(not HELM.exists(), reason="helm not installed: run `make install`")


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, check=check, timeout=60)


def render(*sets: str) -> list[dict]:
    args = ["template", "kvpilot", str(CHART), "--namespace", "kvpilot-system", "--include-crds"]
    for s in sets:
        args += ["--set", s]
    return [d for d in yaml.safe_load_all(helm(*args).stdout) if d]


VARIANTS = {
    "default": (),
    "namespaces": ("watchNamespaces={team-a,team-b}",),
    "standalone": ("peering.enabled=false", "logLevel=DEBUG", "image.tag=dev"),
    "inference-pool": ("gatewayInferenceExtension.enabled=true",),
    "no-router": ("router.enabled=false",),
    "leader-worker-set": ("leaderWorkerSet.enabled=true", "router.enabled=false"),
}


@pytest.mark.parametrize("sets", list(VARIANTS.values()), ids=list(VARIANTS))
def test_helm_lint(sets):
    args = ["lint", str(CHART), "--strict"]
    for s in sets:
        args += ["--set", s]
    assert helm(*args, check=False).returncode == 0


@pytest.mark.parametrize("sets", list(VARIANTS.values()), ids=list(VARIANTS))
def test_rendered_manifests_validate(sets):
    docs = render(*sets)
    kinds = {d["kind"] for d in docs}
    assert {"CustomResourceDefinition", "ServiceAccount", "ClusterRole", "Deployment", "Service"} <= kinds
    crds = {d["metadata"]["name"]: d for d in docs if d["kind"] == "CustomResourceDefinition"}
    for doc in docs:
        if doc["apiVersion"].startswith("kopf.dev/"):
            # Custom resources: check them against their CRD's schema instead.
            name = {"ClusterKopfPeering": "clusterkopfpeerings.kopf.dev", "KopfPeering": "kopfpeerings.kopf.dev"}
            schema = crds[name[doc["kind"]]]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
            jsonschema.validate(doc, schema)
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def by_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def test_all_namespaces_rbac_is_least_privilege():
    docs = render()
    roles = {r["metadata"]["name"]: r for r in by_kind(docs, "ClusterRole")}
    # tests/test_rbac.py derives these from the operator's recorded calls; this pins the rendering.
    allowed = {
        ("kvpilot.io", "inferencedeployments"): {"get", "list", "watch", "patch"},
        ("kvpilot.io", "inferencedeployments/status"): {"patch"},
        ("kvpilot.io", "inferencedeployments/finalizers"): {"update"},
        ("kvpilot.io", "loraadapters"): {"get", "list", "watch", "patch"},
        ("kvpilot.io", "loraadapters/status"): {"patch"},
        ("apps", "deployments"): {"get", "create", "patch", "delete"},
        ("", "services"): {"create", "patch", "delete"},
        ("", "serviceaccounts"): {"create", "patch", "delete"},
        ("rbac.authorization.k8s.io", "roles"): {"create", "patch", "delete"},
        ("rbac.authorization.k8s.io", "rolebindings"): {"create", "patch", "delete"},
        ("discovery.k8s.io", "endpointslices"): {"get", "list", "watch"},  # held for the routers' Roles
        ("policy", "poddisruptionbudgets"): {"create", "patch", "delete"},
        ("", "pods"): {"list"},
        ("", "events"): {"create"},
        ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
        ("kopf.dev", "clusterkopfpeerings"): {"get", "list", "watch", "patch"},
    }
    seen = set()
    for role in roles.values():
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
            for group in rule["apiGroups"]:
                for res in rule["resources"]:
                    assert (group, res) in allowed, (group, res)
                    assert set(rule["verbs"]) <= allowed[(group, res)], (group, res, rule["verbs"])
                    seen.add((group, res))
    assert seen == set(allowed)
    assert not any(res == "secrets" for r in roles.values() for rule in r["rules"] for res in rule["resources"])
    bindings = by_kind(docs, "ClusterRoleBinding")
    assert {b["roleRef"]["name"] for b in bindings} == set(roles)
    assert not by_kind(docs, "RoleBinding")
    dep = by_kind(docs, "Deployment")[0]
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--all-namespaces" in args and "--peering=kvpilot" in args
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    assert [p["metadata"]["name"] for p in by_kind(docs, "ClusterKopfPeering")] == ["kvpilot"]
    sa = by_kind(docs, "ServiceAccount")[0]["metadata"]["name"]
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == sa


def workload_rules(docs) -> dict[tuple[str, str], set[str]]:
    role = next(r for r in by_kind(docs, "ClusterRole") if r["metadata"]["name"] == "kvpilot-workloads")
    return {(g, res): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"]
            for res in rule["resources"]}


def test_router_grants_cover_what_the_operator_grants_the_routers():
    """RBAC escalation prevention: the operator may create a Role only with every permission in it."""
    from kvpilot.operator import routing

    rules = workload_rules(render())
    for rule in routing.ROUTER_RULES:
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                assert set(rule["verbs"]) <= rules[(group, res)], (group, res)
    assert ("inference.networking.k8s.io", "inferencepools") not in rules  # off unless asked for
    assert not {"bind", "escalate"} & set().union(*rules.values())


def test_inference_pool_and_router_toggles():
    pools = workload_rules(render("gatewayInferenceExtension.enabled=true"))
    assert pools[("inference.networking.k8s.io", "inferencepools")] == {"create", "patch", "delete"}
    bare = workload_rules(render("router.enabled=false"))
    assert bare[("apps", "deployments")] == {"get", "create", "patch"} and bare[("", "services")] == {"create", "patch"}
    assert not {("", "serviceaccounts"), ("rbac.authorization.k8s.io", "roles"),
                ("discovery.k8s.io", "endpointslices")} & set(bare)


def test_leader_worker_set_toggle():
    """Off by default; on, the operator may write LeaderWorkerSets and scale them, and delete the Deployment
    it replaces (granted with the router anyway)."""
    lws = ("leaderworkerset.x-k8s.io", "leaderworkersets")
    assert lws not in workload_rules(render()) and (lws[0], "leaderworkersets/scale") not in workload_rules(render())
    for router in ("true", "false"):
        rules = workload_rules(render("leaderWorkerSet.enabled=true", f"router.enabled={router}"))
        assert rules[lws] == {"get", "create", "patch", "delete"}
        assert rules[(lws[0], "leaderworkersets/scale")] == {"patch"}
        assert "delete" in rules[("apps", "deployments")]
    assert "delete" not in workload_rules(render("router.enabled=false"))[("apps", "deployments")]


def test_watched_namespaces_get_rolebindings_and_namespaced_peering():
    docs = render("watchNamespaces={team-a,team-b}")
    rbs = by_kind(docs, "RoleBinding")
    assert sorted(rb["metadata"]["namespace"] for rb in rbs) == ["team-a", "team-b"]
    assert all(rb["roleRef"]["name"] == "kvpilot-workloads" for rb in rbs)
    assert [b["roleRef"]["name"] for b in by_kind(docs, "ClusterRoleBinding")] == ["kvpilot-cluster"]
    cluster_rules = next(r for r in by_kind(docs, "ClusterRole") if r["metadata"]["name"] == "kvpilot-cluster")["rules"]
    assert {"resources": ["namespaces"], "apiGroups": [""], "verbs": ["list", "watch"]} in cluster_rules
    assert sorted(p["metadata"]["namespace"] for p in by_kind(docs, "KopfPeering")) == ["team-a", "team-b"]
    assert not by_kind(docs, "ClusterKopfPeering")
    args = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args and "--all-namespaces" not in args


def test_standalone_and_image_options():
    docs = render("peering.enabled=false", "image.tag=dev", "logLevel=DEBUG")
    c = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    assert "--standalone" in c["args"] and "--log-level=DEBUG" in c["args"]
    assert c["image"] == "ghcr.io/kvpilot/operator:dev"
    assert not by_kind(docs, "ClusterKopfPeering")


def test_the_chart_ships_the_crd_the_operator_uses():
    docs = render()
    names = {d["metadata"]["name"] for d in by_kind(docs, "CustomResourceDefinition")}
    assert names == {"inferencedeployments.kvpilot.io", "loraadapters.kvpilot.io", "clusterkopfpeerings.kopf.dev",
                     "kopfpeerings.kopf.dev"}


@pytest.mark.parametrize("bad", ["logLevel=LOUD", "replicaCount=-1", "metrics.port=80", "image.pullPolicy=Sometimes",
                                 "unknownKey=1", "router.enabled=maybe", "gatewayInferenceExtension.typo=1"])
def test_values_schema_rejects_bad_values(bad):
    result = helm("template", "kvpilot", str(CHART), "--set", bad, check=False)
    assert result.returncode != 0 and "schema" in result.stderr.lower(), result.stderr


def test_values_schema_accepts_values_yaml():
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.validate(yaml.safe_load((CHART / "values.yaml").read_text()), schema)


def test_notes_explain_the_next_step(tmp_path):
    # helm template skips NOTES.txt: render its text through `tpl` from a wrapper template in a chart copy.
    chart = tmp_path / "kvpilot"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "NOTES.txt").rename(chart / "notes.src")
    (chart / "templates" / "notes.yaml").write_text('notes: |\n{{ tpl (.Files.Get "notes.src") . | indent 2 }}\n')
    for sets, scope in (((), "all namespaces"), (("watchNamespaces={a,b}",), "the namespaces a, b")):
        args = ["template", "kvpilot", str(chart), "--show-only", "templates/notes.yaml"]
        for s in sets:
            args += ["--set", s]
        out = yaml.safe_load(helm(*args).stdout)["notes"]
        assert "kubectl apply -f examples/inferencedeployment.yaml" in out
        assert scope in out
    assert (ROOT / "examples" / "inferencedeployment.yaml").exists()
