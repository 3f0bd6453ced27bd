"""The LoRAAdapter CRD as data: its schema, the API server's defaulting, and spec validation.

As for InferenceDeployments (crd.py), the operator applies the defaults itself and re-checks the CEL rules
in Python, so that an object the API server would have refused (or one written before a rule existed)
becomes a condition instead of a load that the daemons refuse.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import jsonschema

from kvpilot.operator import crd

CRD_RESOURCE = "loraadapter-crd.yaml"
CRD_PATH = Path(__file__).with_name(CRD_RESOURCE)

# Mirror the CEL rules on spec.uri.
URI_RE = re.compile(r"^(?:hf://[^/].*|pvc://[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:/.*)?|file:///.+)$", re.DOTALL)
DOTDOT_RE = re.compile(r"(?:^|/)\.\.(?:/|$)")
MAX_NAME_FROM_METADATA = 128
ALL = "all"


def load_crd() -> dict[str, Any]:
    return crd.read_crd(CRD_PATH)


def version_schema(version: str = "v1alpha1") -> dict[str, Any]:
    return crd.schema_of(load_crd(), version)


def spec_schema() -> dict[str, Any]:
    return version_schema()["properties"]["spec"]


def default_spec(spec: dict[str, Any] | None) -> dict[str, Any]:
    return crd.apply_defaults(dict(spec or {}), spec_schema())


@functools.cache
def _spec_validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(crd.strict_schema(spec_schema()))


def adapter_name(name: str, spec: dict[str, Any]) -> str:
    """What clients put in "model": spec.adapterName, else the object's name."""
    return spec.get("adapterName") or name


def replicas(spec: dict[str, Any]) -> int | None:
    """spec.replicas as a count; None for "all"."""
    value = spec.get("replicas", ALL)
    return None if value == ALL else int(value)


def rule_errors(name: str, spec: dict[str, Any]) -> list[str]:
    """The CRD's CEL rules (except the immutability transition rules), and what the schema leaves to the
    int-or-string type of spec.replicas."""
    errors = []
    if "adapterName" not in spec and len(name) > MAX_NAME_FROM_METADATA:
        errors.append("metadata.name is the adapter's name when spec.adapterName is unset: at most "
                      f"{MAX_NAME_FROM_METADATA} characters")
    uri = str(spec.get("uri", ""))
    if uri and not URI_RE.match(uri):
        errors.append("uri must start with hf://, pvc://claim or file:///")
    if DOTDOT_RE.search(uri):
        errors.append("uri must not contain '..' path segments")
    r = spec.get("replicas", ALL)
    if isinstance(r, bool) or not (r == ALL or isinstance(r, int)):
        errors.append(f'spec.replicas must be "all" or an integer, got {r!r}')
    return errors


def validate(name: str, spec: dict[str, Any]) -> list[str]:
    """All problems of a defaulted spec, as messages for a condition; empty when valid."""
    errors = sorted(_spec_validator().iter_errors(spec), key=lambda e: list(e.absolute_path))
    messages = [f"spec.{'.'.join(str(p) for p in e.absolute_path)}: {e.message}".replace("spec.:", "spec:")
                for e in errors]
    return messages or rule_errors(name, spec)
