"""The routing children (operator/routing.py): what spec.router renders, checked against the Kubernetes
schemas (kubernetes-validate) and the published InferencePool v1 API (tests/schemas/inferencepool-v1.json)."""

from __future__ import annotations

import copy
import json
import logging
import pathlib

import jsonschema
import kubernetes_validate
import pytest

from kvpilot.operator import crd, kube, resources, routing
from kvpilot.operator.reconcile import sync_routing
from kvpilot.operator.tick import Cr

META = {"name": "llm", "namespace": "ml", "uid": "u-1"}
K8S_VERSION = "1.30.0"
POOL_SCHEMA = json.loads((pathlib.Path(__file__).parent / "schemas" / "inferencepool-v1.json").read_text())
PICKER = {"name": "epp", "port": {"number": 9002}}


def spec(router: dict | None = None, **overrides) -> dict:
    return crd.default_spec({"model": {"uri": "hf://org/model"}, "router": router or {"enabled": True},
                             **overrides})


def builtin_children(s: dict) -> list[dict]:
    return [routing.render_service_account(META), routing.render_role(META), routing.render_role_binding(META),
            routing.render_daemons_service(META), routing.render_router_deployment(META, s),
            routing.render_router_pdb(META)]


def test_router_defaults_are_off_and_valid():
    s = crd.default_spec({"model": {"uri": "hf://org/model"}})
    assert s["router"] == {"enabled": False, "mode": "builtin", "replicas": 2, "extraArgs": [],
                           "resources": {"cpu": "1", "memory": "1Gi"}}
    assert not resources.builtin_router(s) and not crd.inference_pool(s)
    assert resources.render_service(META, s)["spec"]["selector"] == resources.selector_labels("llm")


@pytest.mark.parametrize("doc", builtin_children(spec()), ids=lambda d: d["kind"])
def test_builtin_children_are_valid_kubernetes_objects_owned_by_the_cr(doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    ref = doc["metadata"]["ownerReferences"][0]
    assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("InferenceDeployment", "llm", "u-1", True)
    assert doc["metadata"]["namespace"] == "ml"


def test_the_service_fronts_the_routers_and_the_routers_discover_the_daemons():
    s = spec()
    svc = resources.render_service(META, s)
    assert svc["metadata"]["name"] == "llm"
    assert svc["spec"]["selector"] == {"app.kubernetes.io/name": "kvpilot-router", "kvpilot.io/inferencedeployment": "llm"}
    headless = routing.render_daemons_service(META)
    assert headless["metadata"]["name"] == "llm-daemons" and headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"] == resources.selector_labels("llm")
    assert headless["spec"]["ports"][0]["name"] == "http"
    args = routing.render_router_deployment(META, s)["spec"]["template"]["spec"]["containers"][0]["args"]
    pairs = dict(zip(args[::2], args[1::2], strict=True))
    assert pairs["--service"] == "llm-daemons" and pairs["--namespace"] == "ml" and pairs["--port-name"] == "http"
    assert pairs["--port"] == "8000" and pairs["--block-size"] == "16"
    assert pairs["--tokenizer"] == s["model"]["uri"]


def test_router_pods_never_match_the_daemon_selector():
    pod = routing.render_router_deployment(META, spec())["spec"]["template"]
    assert not resources.matches_selector(pod["metadata"]["labels"], "llm")
    assert routing.matches_router(pod["metadata"]["labels"], "llm")
    daemon = resources.render_deployment(META, spec(), 1)["spec"]["template"]
    assert not routing.matches_router(daemon["metadata"]["labels"], "llm")


def test_router_deployment_replicas_image_resources_and_identity():
    s = spec({"enabled": True, "replicas": 3, "image": "example.com/router:1", "extraArgs": ["--load-cap", "0.5"],
              "resources": {"cpu": "2", "memory": "2Gi"}})
    dep = routing.render_router_deployment(META, s)
    assert dep["metadata"]["name"] == "llm-router" and dep["spec"]["replicas"] == 3
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["image"] == "example.com/router:1" and c["command"] == ["python", "-m", "kvpilot.router"]
    assert c["args"][-2:] == ["--load-cap", "0.5"]
    assert c["resources"]["limits"] == {"cpu": "2", "memory": "2Gi"}
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert pod["serviceAccountName"] == "llm-router"
    assert dep["spec"]["template"]["metadata"]["annotations"]["kvpilot.io/metrics-port"] == "8000"
    assert routing.render_router_deployment(META, spec())["spec"]["template"]["spec"]["containers"][0]["image"] \
        == spec()["image"]  # the daemon image ships the router too


def test_router_pdb_keeps_one_of_at_least_two():
    pdb = routing.render_router_pdb(META)
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": routing.router_selector_labels("llm")}}
    assert spec()["router"]["replicas"] >= 2


def test_the_router_may_read_endpointslices_and_nothing_else():
    role, binding = routing.render_role(META), routing.render_role_binding(META)
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "llm-router"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "llm-router", "namespace": "ml"}]


def pool_spec(**ref) -> dict:
    return spec({"enabled": True, "mode": "inferencePool", "endpointPickerRef": {**PICKER, **ref}})


def test_inference_pool_matches_the_published_v1_api():
    s = pool_spec()
    assert crd.validate("llm", s) == [] and crd.inference_pool(s) and not resources.builtin_router(s)
    pool = routing.render_inference_pool(META, s)
    jsonschema.validate(pool, POOL_SCHEMA)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["metadata"]["name"] == "llm"
    assert pool["spec"]["selector"] == {"matchLabels": resources.selector_labels("llm")}
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"] == {"name": "epp", "port": {"number": 9002}, "kind": "Service",
                                                 "group": "", "failureMode": "FailClose"}
    opened = routing.render_inference_pool(META, pool_spec(failureMode="FailOpen"))
    assert opened["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    # In inferencePool mode the Service keeps selecting the daemons: in-cluster clients need no gateway.
    assert resources.render_service(META, s)["spec"]["selector"] == resources.selector_labels("llm")


@pytest.mark.parametrize("mutate", [
    lambda p: p["spec"].update(targetPorts=[]),
    lambda p: p["spec"].update(targetPorts=[{"number": 8000}, {"number": 8001}]),
    lambda p: p["spec"]["endpointPickerRef"].pop("port"),
    lambda p: p["spec"]["endpointPickerRef"].update(failureMode="Sometimes"),
    lambda p: p["spec"]["selector"].update(matchLabels={}),
    lambda p: p["spec"]["selector"].update(matchExpressions=[]),
    lambda p: p["spec"].update(extensionRef={"name": "epp"}),  # the v1alpha2 field name
])
def test_the_inference_pool_schema_can_fail(mutate):
    pool = copy.deepcopy(routing.render_inference_pool(META, pool_spec()))
    mutate(pool)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pool, POOL_SCHEMA)


def test_rendering_is_pure():
    s = spec()
    before = copy.deepcopy(s)
    assert builtin_children(s) == builtin_children(s)
    assert s == before


# --- reconcile's routing step against a recording fake client -------------------------------------------

class FakeClient:
    """Records applies and deletes; `refuse` maps a path fragment to the HTTP status the server answers."""

    def __init__(self, refuse: dict[str, int] | None = None, existing: set[str] | None = None) -> None:
        self.calls: list[tuple[str, str]] = []
        self.refuse = refuse or {}
        self.existing = existing or set()

    def _check(self, verb: str, path: str) -> None:
        self.calls.append((verb, path))
        for fragment, status in self.refuse.items():
            if fragment in path:
                raise kube.KubeApiError(status, "Refused", "no", verb, path)

    async def apply(self, collection: str, manifest: dict) -> dict:
        self._check("apply", f"{collection}/{manifest['metadata']['name']}")
        return {**manifest, "status": {"replicas": 2, "readyReplicas": 2}}

    async def get(self, path: str) -> dict | None:
        self.calls.append(("get", path))
        return {"metadata": {}} if path in self.existing else None

    async def delete(self, path: str) -> bool:
        self._check("delete", path)
        return True


def cr_of(s: dict) -> Cr:
    return Cr(meta={**META, "generation": 1}, spec=s)


def run(coro):
    import asyncio
    return asyncio.run(coro)


LOG = logging.getLogger("test")


def test_the_router_is_up_before_the_service_points_at_it():
    client = FakeClient()
    router, error = run(sync_routing(client, cr_of(spec()), {}, LOG))
    applied = [p.rsplit("/", 2)[-2:] for v, p in client.calls if v == "apply"]
    assert applied == [["serviceaccounts", "llm-router"], ["roles", "llm-router"], ["rolebindings", "llm-router"],
                       ["services", "llm-daemons"], ["deployments", "llm-router"],
                       ["poddisruptionbudgets", "llm-router"], ["services", "llm"]]
    assert error is None and router["metadata"]["name"] == "llm-router"


def test_turning_the_router_off_repoints_the_service_first_then_deletes_the_router():
    client = FakeClient(existing={"/apis/apps/v1/namespaces/ml/deployments/llm-router"})
    run(sync_routing(client, cr_of(spec({"enabled": False})), {}, LOG))
    verbs = [(v, p.rsplit("/", 2)[-2]) for v, p in client.calls if v != "get"]
    assert verbs == [("apply", "services"), ("delete", "deployments"), ("delete", "poddisruptionbudgets"),
                     ("delete", "services"), ("delete", "rolebindings"), ("delete", "roles"),
                     ("delete", "serviceaccounts")]


def test_without_a_router_deployment_nothing_is_deleted():
    client = FakeClient()
    run(sync_routing(client, cr_of(spec({"enabled": False})), {}, LOG))
    assert not [c for c in client.calls if c[0] == "delete"]


def test_a_chart_without_router_grants_gives_a_condition_and_keeps_serving():
    client = FakeClient(refuse={"/serviceaccounts/": 403})
    router, error = run(sync_routing(client, cr_of(spec()), {}, LOG))
    assert router is None and error[0] == "RouterForbidden"
    service = [p for v, p in client.calls if v == "apply" and p.endswith("/services/llm")]
    assert service  # the Service still points somewhere: at the daemons


@pytest.mark.parametrize("status, reason", [(404, "InferencePoolCRDMissing"), (403, "InferencePoolForbidden")])
def test_an_inference_pool_the_cluster_cannot_take_is_a_reason_not_a_crash(status, reason):
    client = FakeClient(refuse={"/inferencepools/": status})
    router, error = run(sync_routing(client, cr_of(pool_spec()), {}, LOG))
    assert router is None and error[0] == reason


def test_leaving_inference_pool_mode_deletes_the_pool_only_if_one_was_applied():
    client = FakeClient()
    run(sync_routing(client, cr_of(spec({"enabled": False})), {"router": {"mode": "inferencePool"}}, LOG))
    assert ("delete", "/apis/inference.networking.k8s.io/v1/namespaces/ml/inferencepools/llm") in client.calls
    client = FakeClient()
    run(sync_routing(client, cr_of(spec({"enabled": False})), {"router": {"mode": "builtin"}}, LOG))
    assert not any("inferencepools" in p for _, p in client.calls)


def test_scale_to_zero_gives_held_requests_time_for_a_cold_start():
    def args(s: dict) -> list[str]:
        return routing.render_router_deployment(META, s)["spec"]["template"]["spec"]["containers"][0]["args"]
    zero = spec(autoscaling={"enabled": True, "minReplicas": 0})
    assert args(zero)[-2:] == ["--hold-timeout", "300"]
    assert "--hold-timeout" not in args(spec())
    mine = spec({"enabled": True, "extraArgs": ["--hold-timeout", "60"]}, autoscaling={"enabled": True, "minReplicas": 0})
    assert args(mine)[-2:] == ["--hold-timeout", "60"]  # the user's comes last, and argparse takes the last


# --- where router pods run, and what the router knows of the daemons ---------------------------------------

CPU_POOL = {"nodeSelector": {"node-pool": "cpu"},
            "tolerations": [{"key": "node-pool", "operator": "Equal", "value": "cpu", "effect": "NoSchedule"}],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "node-pool", "operator": "In", "values": ["cpu"]}]}]}}}}
GPU_POOL = {"nodeSelector": {"gpu": "h100"}, "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
            "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 1, "preference": {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}}]}}}


def router_pod(s: dict) -> dict:
    return routing.render_router_deployment(META, s)["spec"]["template"]["spec"]


def default_spread() -> dict:
    return router_pod(spec())["affinity"]["podAntiAffinity"]


def test_router_scheduling_fields_are_validated_and_copied():
    s = spec({"enabled": True, **CPU_POOL})
    assert crd.validate("llm", s) == []
    pod = router_pod(s)
    assert pod["nodeSelector"] == {"node-pool": "cpu"}
    assert pod["tolerations"] == CPU_POOL["tolerations"]
    assert pod["affinity"]["nodeAffinity"] == CPU_POOL["affinity"]["nodeAffinity"]
    assert pod["affinity"]["podAntiAffinity"] == default_spread()  # the user's nodeAffinity keeps the spread
    kubernetes_validate.validate(routing.render_router_deployment(META, s), K8S_VERSION, strict=True)


def test_router_tolerations_pass_through_verbatim():
    """Every Toleration form reaches the router pods as written: a node's own taint (what the e2e node
    carries), Exists for a key or for every taint, NoExecute with tolerationSeconds."""
    tolerations = [{"key": "kvpilot.io/e2e", "operator": "Equal", "value": "kvpilot-e2e-1a2b3c", "effect": "NoSchedule"},
                   {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute",
                    "tolerationSeconds": 30},
                   {"operator": "Exists"}]
    s = spec({"enabled": True, "tolerations": tolerations, "nodeSelector": {"kvpilot.io/e2e-node": "kvpilot-e2e-1a2b3c"}})
    assert crd.validate("llm", s) == []
    pod = router_pod(s)
    assert pod["tolerations"] == tolerations and pod["tolerations"] is not s["router"]["tolerations"]
    assert pod["nodeSelector"] == {"kvpilot.io/e2e-node": "kvpilot-e2e-1a2b3c"}
    kubernetes_validate.validate(routing.render_router_deployment(META, s), K8S_VERSION, strict=True)


def test_router_scheduling_fields_are_absent_when_unset():
    pod = router_pod(spec())
    assert "nodeSelector" not in pod and "tolerations" not in pod
    assert set(pod["affinity"]) == {"podAntiAffinity"}
    term = default_spread()["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["labelSelector"]["matchLabels"] == routing.router_selector_labels("llm")
    empty = router_pod(spec({"enabled": True, "nodeSelector": {}, "tolerations": []}))
    assert "nodeSelector" not in empty and "tolerations" not in empty


def test_routers_do_not_follow_the_daemons_onto_gpu_nodes():
    s = spec(**GPU_POOL)
    daemon = resources.render_deployment(META, s, 1)["spec"]["template"]["spec"]
    assert daemon["nodeSelector"] == {"gpu": "h100"} and daemon["tolerations"] == GPU_POOL["tolerations"]
    pod = router_pod(s)
    assert "nodeSelector" not in pod and "tolerations" not in pod
    assert "nodeAffinity" not in pod["affinity"]
    both = router_pod(spec({"enabled": True, **CPU_POOL}, **GPU_POOL))
    assert both["nodeSelector"] == {"node-pool": "cpu"} and both["tolerations"] == CPU_POOL["tolerations"]
    # ... and the daemons keep theirs: the router's fields are not copied the other way either.
    daemon = resources.render_deployment(META, spec({"enabled": True, **CPU_POOL}), 1)["spec"]["template"]["spec"]
    assert "nodeSelector" not in daemon and "tolerations" not in daemon and "affinity" not in daemon


def test_a_router_pod_anti_affinity_of_ones_own_replaces_the_default_spread():
    required = {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"topologyKey": "topology.kubernetes.io/zone",
         "labelSelector": {"matchLabels": routing.router_selector_labels("llm")}}]}
    pod = router_pod(spec({"enabled": True, "affinity": {"podAntiAffinity": required}}))
    assert pod["affinity"] == {"podAntiAffinity": required}


def test_rendered_scheduling_does_not_alias_the_spec():
    s = spec({"enabled": True, **CPU_POOL})
    pod = router_pod(s)
    pod["nodeSelector"]["x"] = "y"
    pod["tolerations"].append({"operator": "Exists"})
    pod["affinity"]["nodeAffinity"].clear()
    assert s["router"]["nodeSelector"] == CPU_POOL["nodeSelector"]
    assert s["router"]["tolerations"] == CPU_POOL["tolerations"]
    assert s["router"]["affinity"] == CPU_POOL["affinity"]


def router_cli_args(s: dict) -> list[str]:
    return router_pod(s)["containers"][0]["args"]


def parsed_slots(s: dict) -> float | None:
    from kvpilot.router.cli import build_parser  # the router's own parser: what the pod would run with
    return build_parser().parse_args(router_cli_args(s)).replica_slots


def daemon_max_num_seqs(s: dict) -> int:
    from kvpilot.daemon.args import parse_serve_args  # the daemon's own parser: what its pods run with
    return parse_serve_args(resources.daemon_args(META, s)[1:], environ={}).engine.max_num_seqs


@pytest.mark.parametrize("engine, slots", [
    ({}, 256),  # the CRD's default maxNumSeqs, as the daemons get it
    ({"maxNumSeqs": 32}, 32),
    ({"maxNumSeqs": 32, "extraArgs": ["--max-num-seqs", "8"]}, 8),  # the daemon's extraArgs come last, and win
    ({"maxNumSeqs": 32, "extraArgs": ["--max-num-seqs=12", "--dtype", "float16"]}, 12),
])
def test_the_router_knows_the_daemons_max_num_seqs(engine, slots):
    s = spec(engine=engine)
    assert daemon_max_num_seqs(s) == slots
    assert routing.daemon_max_num_seqs(s) == slots
    assert parsed_slots(s) == slots
    args = router_cli_args(s)
    assert args[args.index("--replica-slots") + 1] == str(slots)


def test_a_max_num_seqs_the_daemon_refuses_leaves_the_specs_value():
    s = spec(engine={"maxNumSeqs": 32, "extraArgs": ["--max-num-seqs", "many"]})
    with pytest.raises(SystemExit):
        daemon_max_num_seqs(s)  # the daemons never start with it
    assert parsed_slots(s) == 32


def test_router_extra_args_override_the_replica_slots():
    s = spec({"enabled": True, "extraArgs": ["--replica-slots", "4"]}, engine={"maxNumSeqs": 64})
    assert router_cli_args(s)[-2:] == ["--replica-slots", "4"]
    assert parsed_slots(s) == 4
