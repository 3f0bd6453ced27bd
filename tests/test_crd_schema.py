"""The InferenceDeployment CRD: one source of truth, a documented structural schema, defaults and CEL rules
that hold, and an example that validates. CEL rules run through a real CEL interpreter (cel-python)."""

from __future__ import annotations

import copy
import pathlib
from typing import Any

import celpy
import jsonschema
import pytest
import yaml

from kvpilot.operator import crd

ROOT = pathlib.Path(__file__).resolve().parents[1]
CRD_FILE = ROOT / "crds" / "inferencedeployment.yaml"
EXAMPLE = ROOT / "examples" / "inferencedeployment.yaml"


def test_one_source_of_truth_for_the_crd():
    source = CRD_FILE.read_bytes()
    chart_copy = (ROOT / "charts" / "kvpilot" / "crds" / "inferencedeployment.yaml").read_bytes()
    packaged = crd.CRD_PATH.read_bytes()
    assert chart_copy == source, "charts/kvpilot/crds/ differs from crds/: link it, do not copy"
    assert packaged == source, "the operator package's CRD differs from crds/"


def schema() -> dict[str, Any]:
    return crd.version_schema()


def walk(node: dict[str, Any], path: str = ""):
    yield path, node
    for key, sub in (node.get("properties") or {}).items():
        yield from walk(sub, f"{path}.{key}" if path else key)
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}{{}}")


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
    assert list(cols) == ["MODEL", "REPLICAS", "READY", "DESIRED", "KV%", "WAITING", "AGE", "URL"]
    assert cols["URL"]["priority"] == 1
    paths = {p for p, _ in walk(schema())}
    for col in v["additionalPrinterColumns"]:
        assert col["jsonPath"].lstrip(".") in paths | {"metadata.creationTimestamp"}, col
    for sub in ("spec.replicas", "status.replicas", "status.selector"):
        assert sub in paths


def test_structural_schema_with_descriptions_everywhere():
    for path, node in walk(schema()):
        if path in ("", "metadata") or path.endswith("[]") or path.endswith("{}"):
            continue
        assert node.get("description"), f"{path} has no description"
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"{path} has no type"
    auto = schema()["properties"]["spec"]["properties"]["autoscaling"]["properties"]
    assert auto["minReplicas"]["minimum"] == 1 and auto["targetKVCacheUsage"]["maximum"] == 1.0
    eng = schema()["properties"]["spec"]["properties"]["engine"]["properties"]
    assert eng["schedulingPolicy"]["enum"] == ["fcfs", "priority"]


def test_every_default_validates_against_its_own_field():
    found = 0
    for _path, node in walk(schema()):
        if "default" in node:
            found += 1
            jsonschema.validate(node["default"], crd.strict_schema(node))
            defaulted = crd.apply_defaults(copy.deepcopy(node["default"]), node)
            jsonschema.validate(defaulted, crd.strict_schema(node))
    assert found >= 30


def test_minimal_spec_defaults_to_a_valid_and_stable_spec():
    spec = crd.default_spec({"model": {"uri": "hf://org/m"}})
    assert crd.validate("x", spec) == []
    assert crd.default_spec(spec) == spec  # idempotent, like the API server's defaulting
    assert spec["autoscaling"]["metrics"]["kvCacheUsage"] == "vllm:kv_cache_usage_perc"
    assert spec["autoscaling"]["enabled"] is False and spec["replicas"] == 1
    assert cel_failures(obj("x", spec)) == []


def example() -> dict[str, Any]:
    return yaml.safe_load(EXAMPLE.read_text())


def test_example_validates_strictly_and_passes_the_cel_rules():
    ex = example()
    assert ex["apiVersion"] == "kvpilot.io/v1alpha1" and ex["kind"] == "InferenceDeployment"
    assert crd.schema_errors(ex["spec"]) == []  # strict: a typo'd field would fail here
    spec = crd.default_spec(ex["spec"])
    assert crd.validate(ex["metadata"]["name"], spec) == []
    assert cel_failures(obj(ex["metadata"]["name"], spec)) == []


# --- CEL ----------------------------------------------------------------------------------------------

def cel_rules() -> list[tuple[list[str], dict[str, Any], dict[str, Any]]]:
    """(path of keys, schema at that path, rule) for every x-kubernetes-validations rule."""
    out = []

    def visit(node, keys):
        for rule in node.get("x-kubernetes-validations") or []:
            out.append((keys, node, rule))
        for key, sub in (node.get("properties") or {}).items():
            visit(sub, [*keys, key])
    visit(schema(), [])
    return out


def typed(value: Any, node: dict[str, Any]) -> Any:
    """JSON -> what the API server hands CEL: numbers of `type: number` fields are doubles."""
    if node.get("type") == "number" and isinstance(value, int | float):
        return float(value)
    if isinstance(value, dict):
        props = node.get("properties") or {}
        return {k: typed(v, props.get(k, {})) for k, v in value.items()}
    if isinstance(value, list) and isinstance(node.get("items"), dict):
        return [typed(v, node["items"]) for v in value]
    return value


ENV = celpy.Environment()


def cel_failures(new: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
    failures = []
    for keys, node, rule in cel_rules():
        value, old_value = new, old
        for k in keys:
            value = value.get(k) if isinstance(value, dict) else None
            old_value = old_value.get(k) if isinstance(old_value, dict) else None
        if value is None:
            continue
        if "oldSelf" in rule["rule"] and old_value is None:
            continue  # transition rules only run on updates
        activation = {"self": celpy.json_to_cel(typed(value, node))}
        if old_value is not None:
            activation["oldSelf"] = celpy.json_to_cel(typed(old_value, node))
        result = ENV.program(ENV.compile(rule["rule"])).evaluate(activation)
        if not bool(result):
            failures.append(rule["message"])
    return failures


def obj(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "kvpilot.io/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": name}, "spec": spec}


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
])
def test_cel_rules_and_the_operators_python_mirror_agree(name, patch, message):
    spec = crd.default_spec({"model": {"uri": "hf://org/m"}})
    for key, value in patch.items():
        spec[key] = {**spec[key], **value}
    cel = cel_failures(obj(name, spec))
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
    assert any(field in m for m in cel_failures(obj("ok", spec)))
    assert crd.validate("ok", spec)  # the operator reports it too


def test_model_uri_is_immutable():
    old = obj("ok", crd.default_spec({"model": {"uri": "hf://org/a"}}))
    new = copy.deepcopy(old)
    new["spec"]["model"]["uri"] = "hf://org/b"
    assert "model.uri is immutable" in cel_failures(new, old)
    same = copy.deepcopy(old)
    same["spec"]["replicas"] = 3
    assert cel_failures(same, old) == []


@pytest.mark.parametrize("patch, fragment", [
    ({"replicas": -1}, "spec.replicas"),
    ({"engine": {"blockSize": 12}}, "spec.engine.blockSize"),
    ({"engine": {"schedulingPolicy": "lifo"}}, "spec.engine.schedulingPolicy"),
    ({"autoscaling": {"maxReplicas": 0}}, "spec.autoscaling.maxReplicas"),
    ({"service": {"type": "ExternalName"}}, "spec.service.type"),
    ({"enginee": {}}, "'enginee' was unexpected"),
])
def test_schema_rejects_bad_values(patch, fragment):
    spec = {"model": {"uri": "hf://org/m"}, **patch}
    errors = crd.validate("ok", crd.default_spec(spec))
    assert any(fragment in e for e in errors), errors
