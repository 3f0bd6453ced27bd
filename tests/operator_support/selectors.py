"""Kubernetes label selectors (the ?labelSelector= string form), as the API server filters lists with them."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

Match = Callable[[Mapping[str, str]], bool]
_SET = re.compile(r"^\s*([^\s!=]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")
_EQ = re.compile(r"^\s*([^\s!=]+)\s*(==|=|!=)\s*([^\s,]*)\s*$")
_KEY = re.compile(r"^\s*(!?)\s*([^\s!=(),]+)\s*$")


def _split(selector: str) -> list[str]:
    # Commas separate requirements, except inside the parentheses of a set.
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(selector):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(selector[start:i])
            start = i + 1
    parts.append(selector[start:])
    return [p for p in parts if p.strip()]


def _requirement(text: str) -> Match:
    if m := _SET.match(text):
        key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",") if v.strip()}
        if op == "in":
            return lambda labels: labels.get(key) in values
        return lambda labels: labels.get(key) not in values
    if m := _EQ.match(text):
        key, op, value = m.groups()
        if op == "!=":
            return lambda labels: labels.get(key) != value
        return lambda labels: labels.get(key) == value
    if m := _KEY.match(text):
        negate, key = m.group(1) == "!", m.group(2)
        return lambda labels: (key in labels) != negate
    raise ValueError(f"labelSelector: cannot parse requirement {text.strip()!r}")


def parse(selector: str | None) -> Match:
    """A predicate on a labels mapping; raises ValueError (the server's 400) on a malformed selector."""
    requirements = [_requirement(p) for p in _split(selector or "")]
    return lambda labels: all(r(labels) for r in requirements)
