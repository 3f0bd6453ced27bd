"""The InferenceDeployment CRD as data: its schema, the API server's defaulting, and spec validation.

The operator applies the schema's defaults itself (as the API server would) so that it behaves the same on a
cluster and on an API emulator, and re-checks the CEL rules in Python so an invalid spec becomes a condition.
"""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from kvpilot import sizes
from kvpilot.operator import parallelism, resources

CRD_RESOURCE = "inferencedeployment-crd.yaml"
CRD_PATH = Path(__file__).with_name(CRD_RESOURCE)

# Mirrors the CEL rule on spec.model.uri in the CRD.
URI_RE = re.compile(r"^(?:(?:hf|builtin)://[^/].*|pvc://[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:/.*)?|file:///.+)$")
MAX_NAME_LEN = 50
LWS_NAME_RE = re.compile(r"^[a-z](?:[-a-z0-9]*[a-z0-9])?$")  # a DNS-1035 label, as LeaderWorkerSets need


@functools.cache
def read_crd(path: Path) -> dict[str, Any]:
    # A file beside this module (package data), read by path: kvpilot.operator is a namespace package.
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def schema_of(doc: dict[str, Any], version: str = "v1alpha1") -> dict[str, Any]:
    """The openAPIV3Schema of ``version`` in a CRD document."""
    for v in doc["spec"]["versions"]:
        if v["name"] == version:
            return v["schema"]["openAPIV3Schema"]
    raise KeyError(version)


def load_crd() -> dict[str, Any]:
    return read_crd(CRD_PATH)


def version_schema(version: str = "v1alpha1") -> dict[str, Any]:
    return schema_of(load_crd(), version)


def spec_schema() -> dict[str, Any]:
    return version_schema()["properties"]["spec"]


def apply_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """Structural defaulting like the API server: fill absent properties that have a default, recursively."""
    if isinstance(value, dict) and schema.get("type") == "object":
        out = dict(value)
        props = schema.get("properties", {})
        for key, sub in props.items():
            if key not in out and "default" in sub:
                out[key] = copy.deepcopy(sub["default"])
            if key in out and out[key] is not None:
                out[key] = apply_defaults(out[key], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in out.keys() - props.keys():
                out[key] = apply_defaults(out[key], extra)
        return out
    if isinstance(value, list) and "items" in schema:
        return [apply_defaults(item, schema["items"]) for item in value]
    return value


def default_spec(spec: dict[str, Any]) -> dict[str, Any]:
    return apply_defaults(spec or {}, spec_schema())


def strict_schema(schema: Any) -> Any:
    """The schema with unknown object fields forbidden, as kubectl's strict field validation does."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v) for k, v in schema.items() if k != "default"}
    if "default" in schema:
        out["default"] = schema["default"]
    if (
        schema.get("type") == "object"
        and "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.cache
def _spec_validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(strict_schema(spec_schema()))


def schema_errors(spec: dict[str, Any]) -> list[str]:
    errors = sorted(_spec_validator().iter_errors(spec), key=lambda e: list(e.absolute_path))
    return [f"spec.{'.'.join(str(p) for p in e.absolute_path)}: {e.message}".replace("spec.:", "spec:") for e in errors]


def rule_errors(name: str, spec: dict[str, Any]) -> list[str]:
    """The CRD's CEL rules (except the immutability transition rule), re-checked on a defaulted spec."""
    errors = []
    if len(name) > MAX_NAME_LEN:
        errors.append(f"metadata.name must be at most {MAX_NAME_LEN} characters")
    uri = str(spec.get("model", {}).get("uri", ""))
    if uri and not URI_RE.match(uri):
        errors.append("model.uri must start with hf://, pvc://claim/, builtin:// or file:///")
    errors += router_rule_errors(spec)
    errors += parallelism.rule_errors(spec)
    if parallelism.multi_node(spec) and not LWS_NAME_RE.match(name):
        errors.append(parallelism.LWS_NAME_MESSAGE)
    e = spec.get("engine") or {}
    if isinstance(e.get("gpuMemoryUtilization"), int | float) and not e["gpuMemoryUtilization"] > 0.0:
        errors.append("engine.gpuMemoryUtilization must be in (0, 1]")
    if isinstance(e.get("distributedTimeout"), int | float) and not e["distributedTimeout"] > 0.0:
        errors.append("engine.distributedTimeout must be > 0")
    # The schema's pattern is the daemon's grammar, but Python's $ also passes "20Gi\n", which the API
    # server's RE2 and the daemon refuse: ask the daemon's own parser.
    if isinstance(e.get("kvCacheMemory"), str) and not sizes.is_size(e["kvCacheMemory"]):
        errors.append(f"engine.kvCacheMemory is not a size: {e['kvCacheMemory']!r}")
    errors += speculative_rule_errors(e.get("speculative"))
    if isinstance(e.get("maxCpuLoras"), int) and isinstance(e.get("maxLoras"), int) and e["maxCpuLoras"] < e["maxLoras"]:
        errors.append("engine.maxCpuLoras must be >= engine.maxLoras")
    a = spec.get("autoscaling", {})
    try:
        if a["minReplicas"] > a["maxReplicas"]:
            errors.append("autoscaling.minReplicas must be <= autoscaling.maxReplicas")
        if a["panicWindowSeconds"] > a["stableWindowSeconds"]:
            errors.append("autoscaling.panicWindowSeconds must be <= autoscaling.stableWindowSeconds")
        if not 0.0 < a["targetKVCacheUsage"] <= 1.0:
            errors.append("autoscaling.targetKVCacheUsage must be in (0, 1]")
        if "targetWaitingRequests" in a and not a["targetWaitingRequests"] > 0.0:
            errors.append("autoscaling.targetWaitingRequests must be > 0")
    except (KeyError, TypeError):
        pass  # already reported by the schema check
    return errors


def speculative_rule_errors(s: Any) -> list[str]:
    """The CEL rules on spec.engine.speculative (its fields' types are the schema's to check)."""
    if not isinstance(s, dict):
        return []
    errors = []
    lo, hi = s.get("promptLookupMin"), s.get("promptLookupMax")
    if isinstance(lo, int) and isinstance(hi, int) and lo > hi:
        errors.append("engine.speculative.promptLookupMin must be <= engine.speculative.promptLookupMax")
    if s.get("method") != "ngram" and (lo is not None or hi is not None):
        errors.append("engine.speculative.promptLookupMin and promptLookupMax are for method ngram")
    if (s.get("method") == "draft_model") != ("model" in s):
        errors.append("engine.speculative.model is required for method draft_model and not allowed for ngram")
    return errors


def router_rule_errors(spec: dict[str, Any]) -> list[str]:
    """The CEL rules on spec.router and on minReplicas 0, which needs our router to wake the model."""
    errors = []
    r = spec.get("router") or {}
    if r.get("mode") == "inferencePool" and not r.get("endpointPickerRef"):
        errors.append("router.endpointPickerRef is required when router.mode is inferencePool")
    if (spec.get("autoscaling") or {}).get("minReplicas", 1) == 0 and not resources.builtin_router(spec):
        errors.append("autoscaling.minReplicas 0 needs router.enabled true in router.mode builtin: with no pod "
                      "left, only the router's held requests can wake the model")
    return errors


def inference_pool(spec: dict[str, Any]) -> bool:
    r = spec.get("router") or {}
    return bool(r.get("enabled")) and r.get("mode") == "inferencePool"


def validate(name: str, spec: dict[str, Any]) -> list[str]:
    """All problems of a defaulted spec, as messages for a status condition; empty when valid."""
    errors = schema_errors(spec)
    # The CEL rules assume a schema-valid spec, so they run only when the schema check passed.
    return errors or rule_errors(name, spec)
