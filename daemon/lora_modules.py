"""`--lora-modules`: the adapters `kvpilot serve` loads at startup, in vLLM's two spellings.

    --lora-modules sql=/adapters/sql chat=hf://org/chat-lora
    --lora-modules '{"name": "sql", "path": "/adapters/sql", "base_model_name": "smollm2"}'

KVPILOT_LORA_MODULES takes the same items separated by whitespace, or a JSON array of them (JSON objects hold
spaces and commas, so they cannot simply be split).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

__all__ = ["LoRAModulePath", "parse_lora_module", "parse_lora_modules_env"]


@dataclass(frozen=True)
class LoRAModulePath:
    """One startup adapter: the name clients put in `model`, where it loads from, and (vLLM's JSON form
    only) the base model name /v1/models reports as its parent."""

    name: str
    path: str
    base_model_name: str | None = None


def _from_json(item: Any, text: str) -> LoRAModulePath:
    if not isinstance(item, dict):
        raise argparse.ArgumentTypeError(f"--lora-modules item {text!r}: expected name=path or a JSON object "
                                         "with 'name' and 'path'")
    unknown = set(item) - {"name", "path", "base_model_name"}
    if unknown:
        raise argparse.ArgumentTypeError(f"--lora-modules item {text!r}: unknown field(s) {sorted(unknown)} "
                                         "(allowed: name, path, base_model_name)")
    name, path, base = item.get("name"), item.get("path"), item.get("base_model_name")
    if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules item {text!r}: 'name' and 'path' must be non-empty "
                                         "strings")
    if base is not None and (not isinstance(base, str) or not base):
        raise argparse.ArgumentTypeError(f"--lora-modules item {text!r}: 'base_model_name' must be a non-empty "
                                         "string")
    return LoRAModulePath(name, path, base)


def parse_lora_module(text: str) -> LoRAModulePath:
    """One `--lora-modules` item. As in vLLM, `name=path` is the plain form when the text has an '=' and
    no ',' (a JSON object with two fields has a comma); anything else must be a JSON object."""
    text = text.strip()
    if "=" in text and "," not in text and not text.startswith("{"):
        name, _, path = text.partition("=")
        if not name or not path:
            raise argparse.ArgumentTypeError(f"--lora-modules item {text!r}: expected name=path")
        return LoRAModulePath(name, path)
    try:
        item = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"--lora-modules item {text!r}: neither name=path nor a JSON object") \
            from None
    return _from_json(item, text)


def parse_lora_modules_env(text: str) -> list[LoRAModulePath]:
    """KVPILOT_LORA_MODULES: a JSON array (of objects or name=path strings), else whitespace-separated items."""
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            items = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON array: {exc}") from None
        if not isinstance(items, list):
            raise argparse.ArgumentTypeError("expected a JSON array")
        return [parse_lora_module(i) if isinstance(i, str) else _from_json(i, json.dumps(i)) for i in items]
    return [parse_lora_module(part) for part in stripped.split()]
