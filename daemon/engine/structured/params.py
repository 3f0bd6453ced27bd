"""Request fields -> StructuredOutputSpec, for both /v1/completions and /v1/chat/completions.

Accepted, at most one of them per request:
  response_format: {"type": "text" | "json_object"} or
                   {"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}
  structured_outputs: {"json" | "regex" | "choice" | "grammar" | "json_object" | "structural_tag": ...}
  guided_json / guided_regex / guided_choice / guided_grammar (vLLM's older names)
"""

from __future__ import annotations

import re
from typing import Any

from .spec import StructuredOutputError, StructuredOutputSpec

_SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_EXTRA_KEYS = {"json": StructuredOutputSpec.json_schema, "regex": StructuredOutputSpec.regex,
               "choice": StructuredOutputSpec.choice, "grammar": StructuredOutputSpec.grammar,
               "structural_tag": StructuredOutputSpec.structural_tag}
# vLLM's structured_outputs options that only pick a backend or tune it; harmless to accept.
_IGNORED_KEYS = {"backend", "disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                 "whitespace_pattern"}


def spec_from_request(body: dict[str, Any]) -> StructuredOutputSpec | None:
    """The (validated) constraint a request body asks for, or None. Raises StructuredOutputError."""
    found = [s for s in (_from_response_format(body), _from_extra(body), _from_guided(body)) if s is not None]
    if len(found) > 1:
        raise StructuredOutputError(found[1].field.split(".")[0], "only one of response_format, structured_outputs "
                                    "and guided_* may constrain the output")
    return found[0].validate() if found else None


def _from_response_format(body: dict[str, Any]) -> StructuredOutputSpec | None:
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise StructuredOutputError("response_format", "must be an object")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputSpec.json_object("response_format")
    if kind == "json_schema":
        return _json_schema_format(rf.get("json_schema"))
    if kind == "structural_tag":
        return StructuredOutputSpec.structural_tag(rf, "response_format")
    raise StructuredOutputError("response_format.type", f"must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def _json_schema_format(js: Any) -> StructuredOutputSpec:
    field = "response_format.json_schema"
    if not isinstance(js, dict):
        raise StructuredOutputError(field, "is required with type 'json_schema' and must be an object")
    name = js.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.match(name):
        raise StructuredOutputError(f"{field}.name", "is required: 1-64 characters of a-z, A-Z, 0-9, _ and -")
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise StructuredOutputError(f"{field}.strict", "must be a boolean")
    # The schema is always enforced (strict or not): undeclared properties are never generated.
    schema = js.get("schema", {"type": "object"})
    return StructuredOutputSpec.json_schema(schema, f"{field}.schema")


def _from_extra(body: dict[str, Any]) -> StructuredOutputSpec | None:
    so = body.get("structured_outputs")
    if so is None:
        return None
    if not isinstance(so, dict):
        raise StructuredOutputError("structured_outputs", "must be an object")
    unknown = set(so) - set(_EXTRA_KEYS) - _IGNORED_KEYS - {"json_object"}
    if unknown:
        raise StructuredOutputError("structured_outputs", f"unknown keys: {', '.join(sorted(unknown))}")
    set_keys = [k for k in (*_EXTRA_KEYS, "json_object") if so.get(k) not in (None, False)]
    if len(set_keys) != 1:
        raise StructuredOutputError("structured_outputs", "set exactly one of json, regex, choice, grammar, "
                                    f"json_object, structural_tag (got {len(set_keys)})")
    key = set_keys[0]
    if key == "json_object":
        return StructuredOutputSpec.json_object("structured_outputs.json_object")
    return _EXTRA_KEYS[key](so[key], f"structured_outputs.{key}")


def _from_guided(body: dict[str, Any]) -> StructuredOutputSpec | None:
    set_keys = [k for k in _GUIDED if body.get(k) is not None]
    if not set_keys:
        return None
    if len(set_keys) > 1:
        raise StructuredOutputError(set_keys[1], f"only one guided_* field may be set (got {', '.join(set_keys)})")
    name = set_keys[0]
    return _EXTRA_KEYS[_GUIDED[name]](body[name], name)
