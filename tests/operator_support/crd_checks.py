"""What kube-apiserver checks when it accepts a CustomResourceDefinition, and how it validates an object.

Re-implemented from the documented rules (structural schemas, defaulting, CEL validation rules), with
cel-python as the CEL interpreter, so a CRD that a real server would refuse fails in CI.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from typing import Any

import celpy
import jsonschema

from kvpilot.operator import crd

# OpenAPI fields a v1 CRD schema must not use (Kubernetes docs, "Validation" of CRDs).
FORBIDDEN_KEYS = {"$ref", "definitions", "dependencies", "deprecated", "discriminator", "id",
                  "patternProperties", "readOnly", "writeOnly", "xml", "additionalItems"}
# Fields of metadata the server knows the bounds of, so CEL cost estimation does not need a maxLength.
BOUNDED_META = {"name", "generateName"}
SELF_REF = re.compile(r"\b(?:self|oldSelf)((?:\.[A-Za-z_][A-Za-z0-9_]*\b(?!\s*\())*)")

_ENV = celpy.Environment()


def walk(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema node with a readable path: a.b for properties, a[] for items, a{} for map values."""
    yield path, node
    for key, sub in (node.get("properties") or {}).items():
        yield from walk(sub, f"{path}.{key}" if path else key)
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}{{}}")


# --- structural schema ------------------------------------------------------------------------------------

def _node_errors(path: str, node: dict[str, Any]) -> list[str]:
    where = path or "<root>"
    errors = [f"{where}: {key} is not allowed in a CRD schema" for key in FORBIDDEN_KEYS & node.keys()]
    int_or_string = node.get("x-kubernetes-int-or-string") is True
    if int_or_string and "type" in node:
        errors.append(f"{where}: x-kubernetes-int-or-string must not have a type")
    if not int_or_string and not node.get("type") and not node.get("x-kubernetes-preserve-unknown-fields"):
        errors.append(f"{where}: type is required")
    if "properties" in node and "additionalProperties" in node:
        errors.append(f"{where}: properties and additionalProperties are mutually exclusive")
    if node.get("additionalProperties") is False:
        errors.append(f"{where}: additionalProperties must not be false")
    if node.get("uniqueItems") is True:
        errors.append(f"{where}: uniqueItems must not be true")
    if node.get("type") == "array" and not isinstance(node.get("items"), dict):
        errors.append(f"{where}: an array needs items")
    if node.get("x-kubernetes-list-type") == "map":
        errors += _list_map_errors(where, node)
    return errors


def _list_map_errors(where: str, node: dict[str, Any]) -> list[str]:
    items = node.get("items") or {}
    keys = node.get("x-kubernetes-list-map-keys") or []
    if items.get("type") != "object" or not keys:
        return [f"{where}: a map list needs object items and x-kubernetes-list-map-keys"]
    props = items.get("properties") or {}
    return [f"{where}: list-map key {k} must be a required or defaulted scalar property" for k in keys
            if k not in props or props[k].get("type") not in ("string", "integer", "number", "boolean")
            or (k not in (items.get("required") or []) and "default" not in props[k])]


def _metadata_errors(root: dict[str, Any]) -> list[str]:
    meta = (root.get("properties") or {}).get("metadata")
    if meta is None:
        return []
    errors = [f"metadata: only type and properties may be set, not {k}"
              for k in sorted(meta.keys() - {"type", "properties"})]
    if meta.get("type") != "object":
        errors.append("metadata: type must be object")
    for key, sub in (meta.get("properties") or {}).items():
        if key not in BOUNDED_META or sub.get("type") != "string":
            errors.append(f"metadata.{key}: only name and generateName (strings) may be restricted")
    return errors


def structural_errors(root: dict[str, Any]) -> list[str]:
    """The structural-schema rules the server enforces for apiextensions.k8s.io/v1."""
    errors = [] if root.get("type") == "object" else ["<root>: type must be object"]
    for path, node in walk(root):
        if path == "metadata":
            continue
        errors += _node_errors(path, node)
    return errors + _metadata_errors(root)


# --- pruning, defaulting, validation ---------------------------------------------------------------------

def prune(value: Any, node: dict[str, Any]) -> Any:
    """The value without the fields the schema does not declare, as the server stores it."""
    if node.get("x-kubernetes-preserve-unknown-fields") or not isinstance(value, dict | list):
        return value
    if isinstance(value, list):
        items = node.get("items")
        return [prune(v, items) for v in value] if isinstance(items, dict) else value
    if isinstance(node.get("additionalProperties"), dict):
        return {k: prune(v, node["additionalProperties"]) for k, v in value.items()}
    props = node.get("properties") or {}
    return {k: prune(v, props[k]) for k, v in value.items() if k in props}


def prune_object(obj: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    """A whole custom resource pruned; apiVersion, kind and metadata are the server's own and stay."""
    pruned = prune(obj, root)
    for key in ("apiVersion", "kind", "metadata"):
        if key in obj:
            pruned[key] = obj[key]
    return pruned


def schema_errors(value: Any, node: dict[str, Any], where: str = "") -> list[str]:
    validator = jsonschema.Draft7Validator(_openapi_to_jsonschema(crd.strict_schema(node)))
    return [f"{where}{'.'.join(str(p) for p in e.absolute_path)}: {e.message}"
            for e in sorted(validator.iter_errors(value), key=lambda e: list(e.absolute_path))]


def _openapi_to_jsonschema(node: Any) -> Any:
    # x-kubernetes-int-or-string means "integer or string"; plain JSON Schema needs it said.
    if isinstance(node, list):
        return [_openapi_to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _openapi_to_jsonschema(v) for k, v in node.items()}
    if node.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
    return out


# --- CEL ---------------------------------------------------------------------------------------------------

def _typed(value: Any, node: dict[str, Any]) -> Any:
    """JSON -> what the server hands CEL: values of `type: number` fields are doubles."""
    if node.get("type") == "number" and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, dict):
        props = node.get("properties") or {}
        extra = node.get("additionalProperties") if isinstance(node.get("additionalProperties"), dict) else {}
        return {k: _typed(v, props.get(k, extra)) for k, v in value.items()}
    if isinstance(value, list) and isinstance(node.get("items"), dict):
        return [_typed(v, node["items"]) for v in value]
    return value


def _evaluate(rule: str, value: Any, node: dict[str, Any], old: Any) -> bool | str:
    activation = {"self": celpy.json_to_cel(_typed(value, node))}
    if old is not None:
        activation["oldSelf"] = celpy.json_to_cel(_typed(old, node))
    try:
        result = _ENV.program(_ENV.compile(rule)).evaluate(activation)
    except celpy.CELEvalError as e:
        return f"error evaluating rule: {e.args[0] if e.args else e}"
    if isinstance(result, celpy.CELEvalError):
        return f"error evaluating rule: {result.args[0] if result.args else result}"
    return bool(result)


def cel_errors(value: Any, node: dict[str, Any], old: Any = None, path: str = "") -> list[str]:
    """Every x-kubernetes-validations rule under node, run where the value has data, as the server does.

    Transition rules (those that read oldSelf) run only where an old value exists, i.e. on updates."""
    if value is None:
        return []
    errors = []
    for rule in node.get("x-kubernetes-validations") or []:
        if "oldSelf" in rule["rule"] and old is None:
            continue
        outcome = _evaluate(rule["rule"], value, node, old)
        if outcome is not True:
            detail = outcome if isinstance(outcome, str) else rule.get("message", rule["rule"])
            errors.append(f"{path or '<root>'}: {detail}")
    if isinstance(value, dict):
        for key, sub in (node.get("properties") or {}).items():
            old_sub = old.get(key) if isinstance(old, dict) else None
            errors += cel_errors(value.get(key), sub, old_sub, f"{path}.{key}" if path else key)
        if isinstance(node.get("additionalProperties"), dict):
            for key, item in value.items():
                errors += cel_errors(item, node["additionalProperties"], None, f"{path}[{key}]")
    if isinstance(value, list) and isinstance(node.get("items"), dict):
        for i, item in enumerate(value):
            errors += cel_errors(item, node["items"], None, f"{path}[{i}]")
    return errors


def default_errors(root: dict[str, Any]) -> list[str]:
    """Every default checked as the server does at CRD creation: pruned, valid against its own schema, and
    passing the CEL rules of its subtree; checked both bare and with the nested defaults filled in."""
    errors = []
    for path, node in walk(root):
        if "default" not in node:
            continue
        bare = node["default"]
        filled = crd.apply_defaults(copy.deepcopy(bare), node)
        if prune(bare, node) != bare:
            errors.append(f"{path}.default: has fields the schema prunes")
        for label, value in (("default", bare), ("defaulted default", filled)):
            errors += [f"{path} {label}: {e}" for e in schema_errors(value, node)]
            errors += [f"{path} {label}: {e}" for e in cel_errors(value, node, path=path)]
    return errors


# --- CEL compilation and cost --------------------------------------------------------------------------------

def _resolve(node: dict[str, Any], chain: list[str]) -> tuple[list[tuple[str, dict[str, Any]]], str | None]:
    """The schema nodes a field chain (self.a.b) passes through, and the first key the schema lacks."""
    out, here = [("self", node)], node
    for key in chain:
        if here.get("x-kubernetes-preserve-unknown-fields") or isinstance(here.get("additionalProperties"), dict):
            return out, None  # any key may be there: nothing more to check statically
        sub = (here.get("properties") or {}).get(key)
        if sub is None:
            return out, key
        out.append((key, sub))
        here = sub
    return out, None


def _bound_needed(node: dict[str, Any]) -> str | None:
    if node.get("type") == "object":
        return "maxProperties" if isinstance(node.get("additionalProperties"), dict) else None
    return {"string": "maxLength", "array": "maxItems"}.get(node.get("type", ""))


def _rule_errors(path: str, node: dict[str, Any], rule: str) -> list[str]:
    where = f"{path or '<root>'}: rule {rule!r}"
    try:
        _ENV.compile(rule)
    except celpy.CELParseError as e:
        return [f"{where} does not compile: {e}"]
    errors = []
    for match in SELF_REF.finditer(rule):
        chain = [c for c in match.group(1).split(".") if c]
        if path == "" and chain[:1] == ["metadata"]:
            if len(chain) > 1 and chain[1] not in BOUNDED_META:
                errors.append(f"{where} reads metadata.{chain[1]}: only name and generateName are visible")
            continue
        touched, missing = _resolve(node, chain)
        if missing is not None:
            errors.append(f"{where} reads {missing}, which the schema does not declare")
            continue
        # The last node is the data the rule works on; its size bounds the cost estimate.
        key, end = touched[-1]
        bound = _bound_needed(end)
        if bound and bound not in end and not (end.get("enum") and end.get("type") == "string"):
            errors.append(f"{where} reads {key} without {bound}")
    return errors


def rule_errors(root: dict[str, Any]) -> list[str]:
    """What the server checks statically for each x-kubernetes-validations rule: it compiles, it reads only
    declared fields, and every string, list or map it reads is bounded (maxLength, maxItems, maxProperties),
    or the server's cost estimate can exceed its budget and refuse the CRD."""
    return list(dict.fromkeys(e for path, node in walk(root) for rule in node.get("x-kubernetes-validations") or []
                              for e in _rule_errors(path, node, rule["rule"])))
