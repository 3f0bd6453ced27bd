"""What a request constrains its output to, validated up front so a bad schema is a 400, not a crash.

A `StructuredOutputSpec` is the engine-side form of OpenAI's `response_format` and vLLM's
`structured_outputs` extra (and its older `guided_*` names). `spec.grammar()` parses it into an
xgrammar `Grammar`: that parse is cheap (no tokenizer involved) and catches every syntax error, so
the request handler can call `validate()` synchronously; the costly, tokenizer-dependent compile
runs later on the compiler's thread pool.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal

import jsonschema

if TYPE_CHECKING:
    import xgrammar as xgr

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar", "structural_tag"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")

# Small models fall into endless whitespace when JSON allows any amount of it; a short cap keeps
# pretty-printing possible without that trap.
MAX_JSON_WHITESPACE = 4

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " and often "Check failed: ... is false: ".
_CPP_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")
_CHECK_FAILED = re.compile(r"^Check failed: .*? is false:\s*")


class StructuredOutputError(ValueError):
    """A schema, regex, choice list or grammar that cannot be used; `field` names the request field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def clean_xgrammar_error(exc: BaseException) -> str:
    """xgrammar's message without the C++ source location, trimmed to its first meaningful lines."""
    text = _CHECK_FAILED.sub("", _CPP_PREFIX.sub("", str(exc).strip()))
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    return " ".join(lines[:3])[:500] or type(exc).__name__


@dataclass(frozen=True)
class StructuredOutputSpec:
    """One constraint. `payload` is canonical text (compact JSON for schemas, choices and structural
    tags, key order kept; the source for regex and grammar), so equal constraints share a cache key."""

    kind: Kind
    payload: str
    field: str = field(default="structured_outputs", compare=False)  # for error messages only

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.payload)

    # ------------------------------------------------------------- constructors
    @classmethod
    def json_schema(cls, schema: Any, field: str = "structured_outputs.json") -> StructuredOutputSpec:
        schema = _load_json(schema, field)
        if not isinstance(schema, dict | bool):
            raise StructuredOutputError(field, f"a JSON schema must be an object or a boolean, got {type(schema).__name__}")
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as exc:
            where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
            raise StructuredOutputError(field, f"invalid JSON schema at {where}: {exc.message}") from None
        return cls("json_schema", _canonical(schema), field)

    @classmethod
    def json_object(cls, field: str = "response_format") -> StructuredOutputSpec:
        return cls("json_object", "", field)

    @classmethod
    def regex(cls, pattern: Any, field: str = "structured_outputs.regex") -> StructuredOutputSpec:
        if not isinstance(pattern, str) or not pattern:
            raise StructuredOutputError(field, "must be a non-empty string")
        return cls("regex", pattern, field)

    @classmethod
    def choice(cls, choices: Any, field: str = "structured_outputs.choice") -> StructuredOutputSpec:
        if not isinstance(choices, list) or not choices:
            raise StructuredOutputError(field, "must be a non-empty list of strings")
        if not all(isinstance(c, str) and c for c in choices):
            raise StructuredOutputError(field, "every choice must be a non-empty string")
        return cls("choice", json.dumps(list(dict.fromkeys(choices))), field)

    @classmethod
    def grammar(cls, text: Any, field: str = "structured_outputs.grammar") -> StructuredOutputSpec:
        if not isinstance(text, str) or not text.strip():
            raise StructuredOutputError(field, "must be a non-empty EBNF (GBNF) or Lark grammar")
        return cls("grammar", text, field)

    @classmethod
    def structural_tag(cls, tag: Any, field: str = "structured_outputs.structural_tag") -> StructuredOutputSpec:
        tag = _load_json(tag, field)
        if not isinstance(tag, dict):
            raise StructuredOutputError(field, "must be a structural tag object")
        return cls("structural_tag", _canonical(tag), field)

    # ------------------------------------------------------------- parsing
    def validate(self) -> StructuredOutputSpec:
        """Parse now (cheap); raises StructuredOutputError naming `field`. Returns self."""
        _ = self.parsed
        return self

    @cached_property
    def parsed(self) -> xgr.Grammar:
        """The xgrammar Grammar (tokenizer independent), parsed once per spec object."""
        try:
            return _to_grammar(self)
        except StructuredOutputError:
            raise
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar and pydantic parse errors
            raise StructuredOutputError(self.field, f"invalid {self.kind.replace('_', ' ')}: "
                                        f"{clean_xgrammar_error(exc)}") from None


def _to_grammar(spec: StructuredOutputSpec) -> xgr.Grammar:
    # xgrammar (which imports torch, 2.4 s) only when a grammar is parsed: the tool-call schemas and the
    # router's chat template import this module and never parse one
    import xgrammar as xgr

    if spec.kind == "json_schema":
        return xgr.Grammar.from_json_schema(spec.payload, max_whitespace_cnt=MAX_JSON_WHITESPACE)
    if spec.kind == "json_object":
        # OpenAI's json_object means "some JSON object", not any JSON value.
        return xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False,
                                            max_whitespace_cnt=MAX_JSON_WHITESPACE)
    if spec.kind == "regex":
        return xgr.Grammar.from_regex(spec.payload)
    if spec.kind == "choice":
        # An alternation of constant strings; xgrammar does the escaping.
        options = [{"type": "const_string", "value": c} for c in json.loads(spec.payload)]
        tag = {"type": "structural_tag", "format": {"type": "or", "elements": options}}
        return xgr.Grammar.from_structural_tag(xgr.StructuralTag.model_validate(tag))
    if spec.kind == "grammar":
        if "::=" in spec.payload:  # EBNF/GBNF rules; Lark uses ':'
            return xgr.Grammar.from_ebnf(spec.payload)
        return xgr.Grammar.from_lark(spec.payload)
    if spec.kind == "structural_tag":
        return xgr.Grammar.from_structural_tag(xgr.StructuralTag.model_validate_json(spec.payload))
    raise StructuredOutputError(spec.field, f"unknown kind {spec.kind!r}")


def _load_json(value: Any, field: str) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError as exc:
            raise StructuredOutputError(field, f"is not valid JSON: {exc}") from None
    return value


def _canonical(value: Any) -> str:
    # Key order is kept: xgrammar generates properties in the order the schema declares them.
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
