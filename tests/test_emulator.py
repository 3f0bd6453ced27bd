"""The stricter kmock harness behaves like kube-apiserver where the operator depends on it."""

from __future__ import annotations

import time

import pytest

from operator_support import selectors
from operator_support.calls import parse_call
from operator_support.emulator import strategic_merge
from operator_support.harness import CR_PATH, cluster, eventually, operator

pytestmark = pytest.mark.timeout(60)
NS = "ml"
DEP = f"/apis/apps/v1/namespaces/{NS}/deployments"


def cr(name: str = "llm", **spec) -> dict:
    return {"apiVersion": "kvpilot.io/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": name, "namespace": NS}, "spec": {"model": {"uri": "hf://org/m"}, **spec}}


def deployment(name: str = "web", replicas: int = 1) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "labels": {"app": name}},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                     "template": {"spec": {"containers": [{"name": "a", "image": "a:1"},
                                                          {"name": "b", "image": "b:1"}]}}}}


async def test_generation_counts_spec_changes_only(tmp_path):
    async with cluster(tmp_path) as k:
        created = await k.create_cr(NS, cr(replicas=1) | {"status": {"replicas": 9}})
        assert created["metadata"]["generation"] == 1 and "status" not in created
        assert created["metadata"]["uid"] and created["metadata"]["creationTimestamp"]
        assert created["spec"]["engine"]["blockSize"] == 16  # the CRD's defaults are applied
        labelled = await k.patch_cr(NS, "llm", {"metadata": {"labels": {"a": "b"}, "generation": 40}})
        assert labelled["metadata"]["generation"] == 1  # metadata changes and client values do not count
        status = await k.set_status(f"{CR_PATH.format(ns=NS)}/llm", {"replicas": 2})
        assert status["metadata"]["generation"] == 1 and status["status"] == {"replicas": 2}
        changed = await k.patch_cr(NS, "llm", {"spec": {"replicas": 3}})
        assert changed["metadata"]["generation"] == 2
        versions = {created["metadata"]["resourceVersion"], labelled["metadata"]["resourceVersion"],
                    status["metadata"]["resourceVersion"], changed["metadata"]["resourceVersion"]}
        assert len(versions) == 4


async def test_status_and_spec_are_written_through_their_own_endpoints(tmp_path):
    async with cluster(tmp_path) as k:
        await k.create_cr(NS, cr(replicas=1))
        main = await k.patch_cr(NS, "llm", {"status": {"replicas": 5}})
        assert "status" not in main  # the main resource ignores status
        sub = await k.call("PATCH", f"{CR_PATH.format(ns=NS)}/llm/status",
                           {"spec": {"replicas": 7}, "metadata": {"labels": {"x": "y"}}, "status": {"replicas": 5}})
        assert sub["spec"]["replicas"] == 1 and "labels" not in sub["metadata"]  # status ignores the rest
        assert sub["status"] == {"replicas": 5}


async def test_deployment_status_is_written_through_status_only(tmp_path):
    async with cluster(tmp_path) as k:
        created = await k.call("POST", DEP, deployment() | {"status": {"readyReplicas": 3}})
        assert "status" not in created  # a create sets no status
        main = await k.call("PATCH", f"{DEP}/web", {"spec": {"replicas": 2}, "status": {"readyReplicas": 3}})
        assert "status" not in main and main["metadata"]["generation"] == 2
        sub = await k.set_deployment_status(NS, "web", {"replicas": 2, "readyReplicas": 1})
        assert sub["status"] == {"replicas": 2, "readyReplicas": 1} and sub["metadata"]["generation"] == 2
        kept = await k.call("PATCH", f"{DEP}/web", {"spec": {"replicas": 3}, "status": None})
        assert kept["status"] == {"replicas": 2, "readyReplicas": 1}  # the main resource cannot drop it either
        scale = await k.call("GET", f"{DEP}/web/scale")
        assert scale["spec"]["replicas"] == 3 and scale["status"]["replicas"] == 2


async def test_stale_resource_version_is_a_conflict(tmp_path):
    async with cluster(tmp_path) as k:
        first = await k.create_cr(NS, cr())
        await k.patch_cr(NS, "llm", {"spec": {"replicas": 2}})
        stale = {"metadata": {"resourceVersion": first["metadata"]["resourceVersion"]}, "spec": {"replicas": 3}}
        status, body = await k.try_call("PATCH", f"{CR_PATH.format(ns=NS)}/llm", stale)
        assert status == 409 and body["reason"] == "Conflict"
        current = await k.cr(NS, "llm")
        replaced = dict(current, spec={**current["spec"], "replicas": 4})
        assert (await k.call("PUT", f"{CR_PATH.format(ns=NS)}/llm", replaced))["spec"]["replicas"] == 4
        status, _ = await k.try_call("PUT", f"{CR_PATH.format(ns=NS)}/llm", replaced)  # now stale
        assert status == 409
        assert (await k.cr(NS, "llm"))["spec"]["replicas"] == 4


async def test_unknown_fields_are_rejected_unless_asked_to_prune(tmp_path):
    async with cluster(tmp_path) as k:
        status, body = await k.try_call("POST", CR_PATH.format(ns=NS), cr(enginee={"x": 1}))
        assert status == 422 and "spec.enginee" in body["message"]
        await k.create_cr(NS, cr())
        status, body = await k.try_call("PATCH", f"{CR_PATH.format(ns=NS)}/llm/status", {"status": {"typo": 1}})
        assert status == 422 and "status.typo" in body["message"]
        pruned = await k.call("PATCH", f"{CR_PATH.format(ns=NS)}/llm?fieldValidation=Ignore",
                              {"spec": {"typo": 1, "replicas": 2}})
        assert "typo" not in pruned["spec"] and pruned["spec"]["replicas"] == 2


async def test_validation_rejects_what_the_crd_rules_forbid(tmp_path):
    async with cluster(tmp_path, validate=True) as k:
        bad = cr(autoscaling={"minReplicas": 5, "maxReplicas": 2})
        status, body = await k.try_call("POST", CR_PATH.format(ns=NS), bad)
        assert status == 422 and "minReplicas must be <=" in body["message"]
        await k.create_cr(NS, cr())
        status, body = await k.try_call("PATCH", f"{CR_PATH.format(ns=NS)}/llm", {"spec": {"model": {"uri": "hf://o/x"}}})
        assert status == 422 and "immutable" in body["message"]


async def test_patch_types_on_deployments_and_custom_resources(tmp_path):
    async with cluster(tmp_path) as k:
        await k.call("POST", DEP, deployment())
        smp = {"spec": {"template": {"spec": {"containers": [{"name": "b", "image": "b:2"}]}}}}
        merged = await k.call("PATCH", f"{DEP}/web", smp, "application/strategic-merge-patch+json")
        images = [c["image"] for c in merged["spec"]["template"]["spec"]["containers"]]
        assert images == ["a:1", "b:2"]  # merged by name
        replaced = await k.call("PATCH", f"{DEP}/web", smp, "application/merge-patch+json")
        assert [c["name"] for c in replaced["spec"]["template"]["spec"]["containers"]] == ["b"]
        jp = [{"op": "replace", "path": "/spec/replicas", "value": 3}]
        assert (await k.call("PATCH", f"{DEP}/web", jp, "application/json-patch+json"))["spec"]["replicas"] == 3
        await k.create_cr(NS, cr())
        status, _ = await k.try_call("PATCH", f"{CR_PATH.format(ns=NS)}/llm", {"spec": {"replicas": 2}},
                                     "application/strategic-merge-patch+json")
        assert status == 415


async def test_apply_creates_and_scale_subresource(tmp_path):
    async with cluster(tmp_path) as k:
        applied = await k.call("PATCH", f"{DEP}/web?fieldManager=t&force=true", deployment(replicas=2),
                               "application/apply-patch+yaml")
        assert applied["metadata"]["generation"] == 1
        assert [c.verb for c in k.calls if c.resource == "deployments"] == ["patch", "create"]
        scale = await k.call("GET", f"{DEP}/web/scale")
        assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 2 and scale["status"]["selector"] == "app=web"
        await k.call("PATCH", f"{DEP}/web/scale", {"spec": {"replicas": 5}})
        assert (await k.deployment(NS, "web"))["spec"]["replicas"] == 5
        await k.create_cr(NS, cr(replicas=1))
        await k.call("PATCH", f"{CR_PATH.format(ns=NS)}/llm/scale", {"spec": {"replicas": 4}})
        got = await k.cr(NS, "llm")
        assert got["spec"]["replicas"] == 4 and got["metadata"]["generation"] == 2


async def test_label_selectors_filter_lists(tmp_path):
    async with cluster(tmp_path) as k:
        for name, labels in (("a", {"app": "x", "tier": "gpu"}), ("b", {"app": "x"}), ("c", {"app": "y"})):
            await k.call("POST", f"/api/v1/namespaces/{NS}/pods",
                         {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels}})
        names = {}
        for sel in ("app=x", "app=x,tier", "app in (x,y),!tier", "app!=x"):
            items = await k.items(f"/api/v1/namespaces/{NS}/pods?labelSelector={sel}")
            names[sel] = sorted(p["metadata"]["name"] for p in items)
        assert names == {"app=x": ["a", "b"], "app=x,tier": ["a"], "app in (x,y),!tier": ["b", "c"], "app!=x": ["c"]}
        status, _ = await k.try_call("GET", f"/api/v1/namespaces/{NS}/pods?labelSelector=a in b")
        assert status == 400


async def test_deleting_an_owner_collects_its_children(tmp_path):
    async with cluster(tmp_path) as k:
        owner = await k.create_cr(NS, cr())
        child = deployment() | {"metadata": {"name": "web", "ownerReferences": [
            {"apiVersion": "kvpilot.io/v1alpha1", "kind": "InferenceDeployment", "name": "llm",
             "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}]}}
        await k.call("POST", DEP, child)
        admission = [c for c in k.calls if c.method == "admission"]
        assert [(c.verb, c.full_resource, c.name) for c in admission] == \
            [("update", "inferencedeployments/finalizers", "llm")]
        await k.delete_cr(NS, "llm")
        assert await k.deployment(NS, "web") is None


async def test_writing_roles_records_the_escalation_checks(tmp_path):
    rbac = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}"
    rules = [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list"]},
             {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"], "resourceNames": ["p"]}]
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "r"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "r"},
               "subjects": [{"kind": "ServiceAccount", "name": "r", "namespace": NS}]}
    want = {("get", "endpointslices", "", None), ("list", "endpointslices", "", None), ("get", "pods", "log", "p")}

    def checks() -> set:
        out = {(c.verb, c.resource, c.subresource, c.name) for c in k.calls if c.method == "escalation"}
        assert {c.namespace for c in k.calls if c.method == "escalation"} <= {NS}
        return out
    async with cluster(tmp_path) as k:
        await k.call("POST", f"{rbac}/rolebindings", binding)
        assert checks() == {("bind", "roles", "", "r")}  # no such Role: binding it needs `bind`
        await k.call("DELETE", f"{rbac}/rolebindings/r")
        k.emulator.calls.clear()
        await k.call("POST", f"{rbac}/roles", {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                                               "metadata": {"name": "r"}, "rules": rules})
        assert checks() == want  # writing a Role needs what it grants
        k.emulator.calls.clear()
        await k.call("POST", f"{rbac}/rolebindings", binding)
        assert checks() == want  # and so does binding it


@pytest.mark.parametrize("method, path, query, expected", [
    ("GET", "/api/v1/pods", {}, ("list", "", "pods", "", None)),
    ("GET", "/api/v1/namespaces/ml/pods", {"watch": "true"}, ("watch", "", "pods", "", "ml")),
    ("GET", "/api/v1/namespaces", {}, ("list", "", "namespaces", "", None)),
    ("GET", "/api/v1/namespaces/ml", {}, ("get", "", "namespaces", "", None)),
    ("PATCH", "/apis/kvpilot.io/v1alpha1/namespaces/ml/inferencedeployments/x/status", {},
     ("patch", "kvpilot.io", "inferencedeployments", "status", "ml")),
    ("PUT", "/apis/apps/v1/namespaces/ml/deployments/x/scale", {}, ("update", "apps", "deployments", "scale", "ml")),
    ("POST", "/api/v1/namespaces/ml/events", {}, ("create", "", "events", "", "ml")),
    ("DELETE", "/api/v1/namespaces/ml/pods", {}, ("deletecollection", "", "pods", "", "ml")),
])
def test_calls_map_to_the_authorizers_verbs(method, path, query, expected):
    c = parse_call(method, path, query)
    assert (c.verb, c.group, c.resource, c.subresource, c.namespace) == expected
    assert parse_call("GET", "/apis/kvpilot.io/v1alpha1", {}) is None  # discovery is no resource request


def test_strategic_merge_deletes_items_and_selector_parses():
    old = {"env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]}
    assert strategic_merge(old, {"env": [{"name": "A", "$patch": "delete"}]}) == {"env": [{"name": "B", "value": "2"}]}
    match = selectors.parse("a notin (1,2), b==3")
    assert match({"a": "0", "b": "3"}) and not match({"a": "1", "b": "3"}) and not match({"a": "0"})
    with pytest.raises(ValueError, match="labelSelector"):
        selectors.parse("a in")


async def test_operator_with_peering_stops_at_once_and_leaves_the_peering(monkeypatch, tmp_path):
    """The emulator answers on its own loop while KopfRunner's exit blocks the test's: kopf's last PATCH,
    which takes it out of the peering object, is served at once instead of waiting out the runner's timeout."""
    peering = "/apis/kopf.dev/v1/clusterkopfpeerings/kvpilot"
    async with cluster(tmp_path) as k:
        await k.call("POST", "/apis/kopf.dev/v1/clusterkopfpeerings",
                     {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "kvpilot"}})

        async def peers():
            return ((await k.get(peering)) or {}).get("status")
        with operator(monkeypatch, tmp_path, k.url, peering="kvpilot"):
            await eventually(peers, what="the operator in the peering object")
            stopping = time.monotonic()
        assert time.monotonic() - stopping < 15
        assert not await peers()  # kopf's goodbye was served
