"""The InferenceDeployment CRD as kube-apiserver judges it: a structural schema, defaults that pass their own
schema and CEL rules, rules that compile and are bounded, examples that validate. CEL runs in cel-python.
The checks run on crds/ and on the chart's copy, which is what `helm install` sends."""

from __future__ import annotations

import copy
import pathlib
from typing import Any

import pytest
import yaml

from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.operator import crd, lora_crd
from operator_support import crd_checks as checks

ROOT = pathlib.Path(__file__).resolve().parents[1]
CRD_FILE = ROOT / "crds" / "inferencedeployment.yaml"
CHART_CRDS = ROOT / "charts" / "kvpilot" / "crds"
EXAMPLES = ROOT / "examples"


CRD_FILES = sorted((ROOT / "crds").glob("*.yaml"))  # InferenceDeployment and LoRAAdapter


def crd_docs() -> list[tuple[str, dict[str, Any]]]:
    files = [*CRD_FILES, *sorted(CHART_CRDS.glob("*.yaml"))]
    return [(f"{f.relative_to(ROOT)}:{d['metadata']['name']}", d)
            for f in files for d in yaml.safe_load_all(f.read_text()) if d]


ALL_CRDS = crd_docs()
OUR_CRDS = [(name, d) for name, d in ALL_CRDS if d["spec"]["group"] == "kvpilot.io"]


def schemas_of(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [v["schema"]["openAPIV3Schema"] for v in doc["spec"]["versions"]]


def test_one_source_of_truth_for_the_crd():
    source = CRD_FILE.read_bytes()
    assert (CHART_CRDS / "inferencedeployment.yaml").read_bytes() == source, "the chart's CRD differs from crds/"
    assert crd.CRD_PATH.read_bytes() == source, "the operator package's CRD differs from crds/"
    lora = (ROOT / "crds" / "loraadapter.yaml").read_bytes()
    assert (CHART_CRDS / "loraadapter.yaml").read_bytes() == lora, "the chart's LoRAAdapter CRD differs from crds/"
    assert lora_crd.CRD_PATH.read_bytes() == lora, "the operator package's LoRAAdapter CRD differs from crds/"
    assert [f.name for f in CRD_FILES] == ["inferencedeployment.yaml", "loraadapter.yaml"]
    assert len(OUR_CRDS) == 4  # crds/ and the chart's copies are all checked below


def schema() -> dict[str, Any]:
    return crd.version_schema()


def test_names_scope_subresources_and_printer_columns():
    c = crd.load_crd()
    assert c["metadata"]["name"] == "inferencedeployments.kvpilot.io"
    assert c["spec"]["scope"] == "Namespaced" and c["spec"]["names"]["shortNames"] == ["infd"]
    v = c["spec"]["versions"][0]
    assert v["name"] == "v1alpha1" and v["served"] and v["storage"]
    assert v["subresources"]["status"] == {}
    assert v["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas",
                                          "statusReplicasPath": ".status.replicas",
                                          "labelSelectorPath": ".status.selector"}
    cols = {col["name"].upper(): col for col in v["additionalPrinterColumns"]}
    assert list(cols) == ["MODEL", "QUANT", "TP", "PP", "WORKLOAD", "REPLICAS", "READY", "DESIRED", "KV%", "WAITING",
                          "AGE", "ROUTER", "URL"]
    wide = ("URL", "ROUTER", "QUANT", "TP", "PP", "WORKLOAD")
    assert all(cols[c]["priority"] == 1 for c in wide)  # `-o wide`
    assert not any(col.get("priority") for c, col in cols.items() if c not in wide)
    assert (cols["TP"]["jsonPath"], cols["PP"]["jsonPath"]) == (".spec.parallelism.tensor", ".spec.parallelism.pipeline")
    assert cols["QUANT"]["jsonPath"] == ".spec.model.quantization"
    assert cols["ROUTER"]["jsonPath"] == ".status.router.readyReplicas"
    paths = {p for p, _ in checks.walk(schema())}
    for col in v["additionalPrinterColumns"]:
        assert col["jsonPath"].lstrip(".") in paths | {"metadata.creationTimestamp"}, col
    for sub in ("spec.replicas", "status.replicas", "status.selector"):
        assert sub in paths


# --- what the server checks when it accepts the CRD ------------------------------------------------------

@pytest.mark.parametrize("doc", [d for _, d in ALL_CRDS], ids=[n for n, _ in ALL_CRDS])
def test_structural_schema(doc):
    for s in schemas_of(doc):
        assert checks.structural_errors(s) == []


@pytest.mark.parametrize("doc", [d for _, d in ALL_CRDS], ids=[n for n, _ in ALL_CRDS])
def test_every_default_is_valid_bare_and_defaulted(doc):
    for s in schemas_of(doc):
        assert checks.default_errors(s) == []


@pytest.mark.parametrize("doc", [d for _, d in ALL_CRDS], ids=[n for n, _ in ALL_CRDS])
def test_rules_compile_read_declared_fields_and_are_bounded(doc):
    for s in schemas_of(doc):
        assert checks.rule_errors(s) == []


def test_there_are_defaults_and_rules_to_check():
    nodes = [n for _, n in checks.walk(schema())]
    assert sum("default" in n for n in nodes) >= 30
    assert sum(len(n.get("x-kubernetes-validations") or []) for n in nodes) >= 6


def test_descriptions_everywhere():
    for path, node in checks.walk(schema()):
        if path in ("", "metadata") or path.endswith("[]") or path.endswith("{}"):
            continue
        assert node.get("description"), f"{path} has no description"


def autoscaling_node(s: dict[str, Any]) -> dict[str, Any]:
    return s["properties"]["spec"]["properties"]["autoscaling"]


def router_node(s: dict[str, Any]) -> dict[str, Any]:
    return s["properties"]["spec"]["properties"]["router"]["properties"]


def test_the_refused_v1_32_crd_is_refused_here():
    """The rules as they were when a v1.32 server refused the CRD: read keys the `{}` default lacks."""
    s = copy.deepcopy(schema())
    autoscaling_node(s)["x-kubernetes-validations"][0]["rule"] = "self.minReplicas <= self.maxReplicas"
    errors = checks.default_errors(s)
    assert any("spec.autoscaling default" in e and "minReplicas" in e for e in errors), errors
    assert not any("defaulted default" in e for e in errors)  # with nested defaults it would pass


def test_a_default_that_breaks_a_rule_is_refused():
    s = copy.deepcopy(schema())
    autoscaling_node(s)["default"] = {"minReplicas": 9, "maxReplicas": 2}
    assert any("minReplicas must be <=" in e for e in checks.default_errors(s))
    s = copy.deepcopy(schema())
    autoscaling_node(s)["default"] = {"bogus": 1}
    assert any("prunes" in e for e in checks.default_errors(s))


@pytest.mark.parametrize("mutate, fragment", [
    (lambda s: s["properties"]["spec"]["properties"]["replicas"].pop("type"), "spec.replicas: type is required"),
    (lambda s: s["properties"]["spec"]["properties"]["nodeSelector"].update(properties={"a": {"type": "string"}}),
     "mutually exclusive"),
    (lambda s: s["properties"]["spec"]["properties"]["env"].pop("items"), "an array needs items"),
    (lambda s: s["properties"]["metadata"].update(default={}), "metadata: only type and properties"),
    (lambda s: s["properties"]["metadata"].update(properties={"labels": {"type": "object"}}),
     "only name and generateName"),
    (lambda s: s["properties"]["spec"]["properties"]["resources"]["properties"]["cpu"].update(type="string"),
     "int-or-string must not have a type"),
    (lambda s: s["properties"]["status"]["properties"]["conditions"]["items"]["required"].remove("type"),
     "list-map key type"),
    (lambda s: s["properties"]["spec"].update(additionalProperties=False), "mutually exclusive"),
    (lambda s: router_node(s)["tolerations"].pop("items"), "spec.router.tolerations: an array needs items"),
    (lambda s: router_node(s)["tolerations"]["items"]["properties"]["key"].pop("type"),
     "spec.router.tolerations[].key: type is required"),
    (lambda s: router_node(s)["nodeSelector"].update(properties={"a": {"type": "string"}}),
     "spec.router.nodeSelector: properties and additionalProperties"),
])
def test_structural_check_catches_what_the_server_refuses(mutate, fragment):
    s = copy.deepcopy(schema())
    mutate(s)
    errors = checks.structural_errors(s)
    assert any(fragment in e for e in errors), errors


def unbounded_list_rule(node: dict[str, Any]) -> None:
    node["x-kubernetes-validations"] = [{"rule": "self.all(a, a != '')"}]
    del node["maxItems"]


@pytest.mark.parametrize("mutate, fragment", [
    (lambda s: s["properties"]["spec"]["properties"]["model"]["properties"]["uri"].pop("maxLength"),
     "without maxLength"),
    (lambda s: unbounded_list_rule(s["properties"]["spec"]["properties"]["engine"]["properties"]["extraArgs"]),
     "without maxItems"),
    (lambda s: autoscaling_node(s)["x-kubernetes-validations"].append({"rule": "self.minReplica > 0"}),
     "reads minReplica, which the schema does not declare"),
    (lambda s: autoscaling_node(s)["x-kubernetes-validations"].append({"rule": "self.minReplicas >"}),
     "does not compile"),
])
def test_rule_check_catches_unbounded_or_broken_rules(mutate, fragment):
    s = copy.deepcopy(schema())
    mutate(s)
    errors = checks.rule_errors(s)
    assert any(fragment in e for e in errors), errors


# --- objects: the defaulted empty spec, the examples, wrong objects -------------------------------------

def obj(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "kvpilot.io/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": name}, "spec": spec}


def test_the_defaulted_empty_spec_passes_every_rule():
    empty = crd.default_spec({})
    assert empty["autoscaling"]["minReplicas"] == 1 and empty["engine"]["blockSize"] == 16
    assert checks.cel_errors(obj("x", empty), schema()) == []
    assert crd.schema_errors(empty) == ["spec: 'model' is a required property"]  # the one thing it lacks


def test_minimal_spec_defaults_to_a_valid_and_stable_spec():
    spec = crd.default_spec({"model": {"uri": "hf://org/m"}})
    assert crd.validate("x", spec) == []
    assert crd.default_spec(spec) == spec  # idempotent, like the API server's defaulting
    assert spec["autoscaling"]["metrics"]["kvCacheUsage"] == "vllm:kv_cache_usage_perc"
    assert spec["autoscaling"]["enabled"] is False and spec["replicas"] == 1
    assert checks.cel_errors(obj("x", spec), schema()) == []


def examples() -> list[dict[str, Any]]:
    return [d for f in sorted(EXAMPLES.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text())
            if d and d.get("kind") == "InferenceDeployment"]


# Routers on a tainted CPU pool, every scheduling field set (the example file leaves nodeSelector commented:
# applied as is, it would leave the routers Pending on a cluster without such nodes).
ROUTER_ON_CPU_POOL = obj("routed-cpu-pool", {
    "model": {"uri": "hf://org/m"},
    "nodeSelector": {"gpu": "h100"}, "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
    "router": {
        "enabled": True, "resources": {"cpu": "500m", "memory": "512Mi"},
        "nodeSelector": {"node-pool": "cpu"},
        "tolerations": [{"key": "node-pool", "operator": "Equal", "value": "cpu", "effect": "NoSchedule"},
                        {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute",
                         "tolerationSeconds": 30}],
        "affinity": {
            "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "node-pool", "operator": "In", "values": ["cpu"]}]}]}},
            "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"app": "r"}}}]}},
    },
})


def checked_examples() -> list[dict[str, Any]]:
    return [*examples(), ROUTER_ON_CPU_POOL]


@pytest.mark.parametrize("example", checked_examples(), ids=lambda e: e["metadata"]["name"])
def test_examples_are_pruned_valid_and_pass_the_rules(example):
    assert example["apiVersion"] == "kvpilot.io/v1alpha1"
    assert checks.prune_object(example, schema()) == example, "the example has fields the server would drop"
    assert crd.schema_errors(example["spec"]) == []
    defaulted = {**example, "spec": crd.default_spec(example["spec"])}
    assert checks.cel_errors(defaulted, schema()) == []
    assert crd.validate(example["metadata"]["name"], defaulted["spec"]) == []


def test_there_is_an_example():
    assert examples()


def test_the_router_example_places_its_routers():
    routed = [e for e in examples() if e["spec"].get("router", {}).get("mode", "builtin") == "builtin"
              and e["spec"].get("router", {}).get("enabled")]
    assert any({"tolerations", "affinity"} <= e["spec"]["router"].keys() for e in routed)
    assert "# nodeSelector:" in (EXAMPLES / "inferencedeployment-router.yaml").read_text()


PICKER = {"name": "epp", "port": {"number": 9002}}


@pytest.mark.parametrize("name, patch, message", [
    ("ok", {}, None),
    ("ok", {"model": {"uri": "s3://bucket/model"}}, "model.uri must start with"),
    ("ok", {"model": {"uri": "hf:///nothing"}}, "model.uri must start with"),
    ("ok", {"model": {"uri": "pvc://Bad_Claim/x"}}, "model.uri must start with"),
    ("ok", {"model": {"uri": "pvc://claim/sub/dir"}}, None),
    ("ok", {"model": {"uri": "file:///opt/m"}}, None),
    ("ok", {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}, "minReplicas must be <= "),
    ("ok", {"autoscaling": {"panicWindowSeconds": 200, "stableWindowSeconds": 100}}, "panicWindowSeconds"),
    ("x" * 51, {}, "metadata.name must be at most 50"),
    ("ok", {"autoscaling": {"minReplicas": 0}}, "minReplicas 0 needs router.enabled"),
    ("ok", {"autoscaling": {"minReplicas": 0}, "router": {"enabled": True}}, None),
    ("ok", {"autoscaling": {"minReplicas": 0}, "router": {"enabled": True, "mode": "inferencePool",
                                                          "endpointPickerRef": PICKER}}, "minReplicas 0 needs"),
    ("ok", {"router": {"enabled": True, "mode": "inferencePool"}}, "endpointPickerRef is required"),
    ("ok", {"router": {"enabled": True, "mode": "inferencePool", "endpointPickerRef": PICKER}}, None),
    ("ok", {"engine": {"gpuMemoryUtilization": 0.0}}, "engine.gpuMemoryUtilization must be in (0, 1]"),
    ("ok", {"engine": {"gpuMemoryUtilization": 0}}, "engine.gpuMemoryUtilization must be in (0, 1]"),
    ("ok", {"engine": {"gpuMemoryUtilization": 1}}, None),
    ("ok", {"engine": {"gpuMemoryUtilization": 0.05}}, None),
])
def test_cel_rules_and_the_operators_python_mirror_agree(name, patch, message):
    spec = crd.default_spec({"model": {"uri": "hf://org/m"}})
    for key, value in patch.items():
        spec[key] = {**spec[key], **value}
    cel = checks.cel_errors(obj(name, spec), schema())
    mirror = crd.rule_errors(name, spec)
    if message is None:
        assert cel == [] and mirror == []
    else:
        assert any(message in m for m in cel), cel
        assert any(message in m for m in mirror), mirror


@pytest.mark.parametrize("field, value", [("targetKVCacheUsage", 0.0), ("targetKVCacheUsage", 1.5),
                                          ("targetWaitingRequests", 0)])
def test_targets_out_of_range_fail_cel_and_schema(field, value):
    spec = crd.default_spec({"model": {"uri": "hf://org/m"}, "autoscaling": {field: value}})
    assert any(field in m for m in checks.cel_errors(obj("ok", spec), schema()))
    assert crd.validate("ok", spec)  # the operator reports it too


def test_model_uri_is_immutable():
    old = obj("ok", crd.default_spec({"model": {"uri": "hf://org/a"}}))
    new = copy.deepcopy(old)
    new["spec"]["model"]["uri"] = "hf://org/b"
    assert any("model.uri is immutable" in e for e in checks.cel_errors(new, schema(), old))
    same = copy.deepcopy(old)
    same["spec"]["replicas"] = 3
    assert checks.cel_errors(same, schema(), old) == []
    assert checks.cel_errors(new, schema()) == []  # a create has no old object: transition rules skip


@pytest.mark.parametrize("patch, fragment", [
    ({"replicas": -1}, "spec.replicas"),
    ({"engine": {"blockSize": 12}}, "spec.engine.blockSize"),
    ({"engine": {"schedulingPolicy": "lifo"}}, "spec.engine.schedulingPolicy"),
    ({"engine": {"longPrefillTokenThreshold": -1}}, "spec.engine.longPrefillTokenThreshold"),
    ({"engine": {"longPrefillTokenThreshold": "256"}}, "spec.engine.longPrefillTokenThreshold"),
    ({"engine": {"longPrefillTokenThreshold": 2.5}}, "spec.engine.longPrefillTokenThreshold"),
    ({"autoscaling": {"maxReplicas": 0}}, "spec.autoscaling.maxReplicas"),
    ({"autoscaling": {"minReplicas": -1}}, "spec.autoscaling.minReplicas"),
    ({"router": {"replicas": 1}}, "spec.router.replicas"),
    ({"router": {"mode": "envoy"}}, "spec.router.mode"),
    ({"router": {"mode": "inferencePool", "endpointPickerRef": {"name": "epp"}}}, "'port' is a required"),
    ({"router": {"mode": "inferencePool", "endpointPickerRef": {**PICKER, "failureMode": "Maybe"}}},
     "spec.router.endpointPickerRef.failureMode"),
    ({"service": {"type": "ExternalName"}}, "spec.service.type"),
    ({"router": {"tolerations": "node-pool=cpu:NoSchedule"}}, "spec.router.tolerations"),
    ({"router": {"tolerations": ["node-pool"]}}, "spec.router.tolerations.0"),
    ({"router": {"tolerations": [{"key": "k", "operator": "In"}]}}, "spec.router.tolerations.0.operator"),
    ({"router": {"tolerations": [{"key": "k", "effect": "NoRun"}]}}, "spec.router.tolerations.0.effect"),
    ({"router": {"tolerations": [{"key": "k", "tolerationSeconds": "30"}]}},
     "spec.router.tolerations.0.tolerationSeconds"),
    ({"router": {"tolerations": [{"key": "k", "operater": "Exists"}]}}, "'operater' was unexpected"),
    ({"router": {"nodeSelector": {"node-pool": 1}}}, "spec.router.nodeSelector.node-pool"),
    ({"router": {"nodeSelector": ["node-pool=cpu"]}}, "spec.router.nodeSelector"),
    ({"router": {"affinity": "cpu-pool"}}, "spec.router.affinity"),
    ({"router": {"affinity": {"nodeAfinity": {}}}}, "'nodeAfinity' was unexpected"),
    ({"router": {"affinity": {"nodeAffinity": []}}}, "spec.router.affinity.nodeAffinity"),
    ({"enginee": {}}, "'enginee' was unexpected"),
    ({"engine": {"kvCacheMemory": "0Gi"}}, "spec.engine.kvCacheMemory"),
    ({"engine": {"kvCacheMemory": "512m"}}, "spec.engine.kvCacheMemory"),
    ({"engine": {"kvCacheMemory": 1024}}, "spec.engine.kvCacheMemory"),
    ({"engine": {"kvCacheDtype": "int8"}}, "spec.engine.kvCacheDtype"),
    ({"model": {"uri": "hf://org/m", "quantization": "int8"}}, "spec.model.quantization"),
    ({"model": {"uri": "hf://org/m", "quantization": 8}}, "spec.model.quantization"),
    ({"engine": {"gpuMemoryUtilization": 1.5}}, "spec.engine.gpuMemoryUtilization"),
    ({"engine": {"gpuMemoryUtilization": "0.9"}}, "spec.engine.gpuMemoryUtilization"),
])
def test_schema_rejects_bad_values(patch, fragment):
    spec = {"model": {"uri": "hf://org/m"}, **patch}
    errors = crd.validate("ok", crd.default_spec(spec))
    assert any(fragment in e for e in errors), errors


@pytest.mark.parametrize("threshold, ok", [(-1, False), (-4096, False), (0, True), (1, True), (256, True),
                                           (1 << 20, True)])
def test_the_server_judges_long_prefill_token_threshold_like_the_daemon(threshold, ok):
    """minimum 0, as the daemon's own check; no rule against maxNumBatchedTokens, which the daemon does not
    enforce either (a threshold above the step budget only never binds)."""
    engine = {"longPrefillTokenThreshold": threshold, "maxNumBatchedTokens": 512}
    o = obj("ok", {"model": {"uri": "hf://org/m"}, "engine": engine})
    assert checks.prune_object(o, schema()) == o  # a declared field: not dropped on the way in
    errors = checks.schema_errors(o, schema())
    defaulted = obj("ok", crd.default_spec(o["spec"]))
    if ok:
        assert errors == [] and checks.cel_errors(defaulted, schema()) == []
        assert crd.validate("ok", defaulted["spec"]) == []
        EngineConfig(long_prefill_token_threshold=threshold, max_num_batched_tokens=512)
    else:
        assert any("spec.engine.longPrefillTokenThreshold" in e for e in errors), errors
        with pytest.raises(ValueError, match="long_prefill_token_threshold"):
            EngineConfig(long_prefill_token_threshold=threshold)


def test_long_prefill_token_threshold_is_typed_and_optional():
    node = schema()["properties"]["spec"]["properties"]["engine"]["properties"]["longPrefillTokenThreshold"]
    assert node["type"] == "integer" and node["minimum"] == 0
    assert "default" not in node  # unset leaves the daemon's default in charge
    assert "--long-prefill-token-threshold" in node["description"]


@pytest.mark.parametrize("router, fragment", [
    ({"tolerations": "node-pool=cpu:NoSchedule"}, "spec.router.tolerations: 'node-pool=cpu:NoSchedule' is not"),
    ({"tolerations": [{"operator": "Maybe"}]}, "spec.router.tolerations.0.operator"),
    ({"tolerations": [{"key": "k", "effect": "NoEvict"}]}, "spec.router.tolerations.0.effect"),
    ({"tolerations": [{"key": "k", "tolerationSeconds": "30s"}]}, "spec.router.tolerations.0.tolerationSeconds"),
    ({"affinity": ["nodeAffinity"]}, "spec.router.affinity"),
])
def test_the_server_rejects_wrong_router_scheduling(router, fragment):
    """The whole object as the API server validates it: schema errors, not pruning or a silent default."""
    bad = obj("ok", {"model": {"uri": "hf://org/m"}, "router": {"enabled": True, **router}})
    errors = checks.schema_errors(bad, schema())
    assert any(fragment in e for e in errors), errors
    good = obj("ok", crd.default_spec(ROUTER_ON_CPU_POOL["spec"]))
    assert checks.schema_errors(good, schema()) == [] and checks.cel_errors(good, schema()) == []


def test_router_affinity_is_typed_at_the_top_and_open_below():
    router = ROUTER_ON_CPU_POOL["spec"]["router"]
    spec = {"model": {"uri": "hf://org/m"},
            "router": {**router, "affinity": {**router["affinity"], "nodeAfinity": {"x": 1}},
                       "tolerations": [{**router["tolerations"][0], "tolerationSecond": 5}]}}
    pruned = checks.prune_object(obj("ok", spec), schema())["spec"]["router"]
    assert pruned["affinity"] == router["affinity"]  # the typo goes; the core/v1 subtrees stay whole
    assert pruned["tolerations"][0] == router["tolerations"][0]
    assert pruned["nodeSelector"] == router["nodeSelector"]
    node = schema()["properties"]["spec"]["properties"]["router"]["properties"]
    assert not node["affinity"].get("x-kubernetes-preserve-unknown-fields")
    assert not node["tolerations"]["items"].get("x-kubernetes-preserve-unknown-fields")
    assert "default" not in node["nodeSelector"] and "default" not in node["tolerations"]  # absent: nothing set


def test_pruning_drops_unknown_fields_but_keeps_open_ones():
    spec = {"model": {"uri": "hf://org/m", "typo": 1}, "affinity": {"nodeAffinity": {"x": 1}},
            "nodeSelector": {"gpu": "h100"}, "tolerations": [{"key": "k", "operator": "Exists"}]}
    pruned = checks.prune_object(obj("ok", spec) | {"extra": 1}, schema())
    assert "extra" not in pruned and "typo" not in pruned["spec"]["model"]
    assert pruned["spec"]["affinity"] == spec["affinity"] and pruned["spec"]["tolerations"] == spec["tolerations"]
    assert pruned["spec"]["nodeSelector"] == {"gpu": "h100"} and pruned["metadata"] == {"name": "ok"}
