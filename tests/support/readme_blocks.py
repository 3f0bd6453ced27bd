"""The README as an executable spec: its fenced bash/python blocks and the marker that says how to run each.

A marker is an HTML comment on the line before the fence, invisible on GitHub:

    <!-- readme: run expect="Paris" -->      run as is; stdout must match the regex
    <!-- readme: serve -->                   starts the server the `client` blocks talk to (`make serve`)
    <!-- readme: client expect="Paris" -->   runs while that server is up, with its port in place of 8000
    <!-- readme: cluster -->                 needs a Kubernetes cluster: syntax-checked only
    <!-- readme: skip why="..." -->          not run here, with the reason

Every bash or python block must carry one, so a new example cannot slip past the tests.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

KINDS = ("run", "serve", "client", "cluster", "skip")
_FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.M | re.S)
_MARKER = re.compile(r"<!--\s*readme:\s*(\w+)(.*?)-->\s*$")


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    kind: str | None  # None: unmarked
    attrs: dict[str, str]
    line: int  # 1-based line of the opening fence

    @property
    def where(self) -> str:
        return f"README.md:{self.line} ({self.lang})"


def _attrs(text: str) -> dict[str, str]:
    out = {}
    for item in shlex.split(text):
        key, _, value = item.partition("=")
        out[key] = value
    return out


def blocks(path: Path, langs: tuple[str, ...] = ("bash", "python")) -> list[Block]:
    text = path.read_text(encoding="utf-8")
    out = []
    for m in _FENCE.finditer(text):
        lang = m.group(1)
        if lang not in langs:
            continue
        line = text.count("\n", 0, m.start()) + 1
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = _MARKER.search(before)
        kind, attrs = (marker.group(1), _attrs(marker.group(2))) if marker else (None, {})
        out.append(Block(lang, m.group(2), kind, attrs, line))
    return out
