"""The README and docs/*.md as an executable spec: their fenced bash/python blocks and the marker that says
how to run each.

A marker is an HTML comment on the line before the fence, invisible on GitHub:

    <!-- readme: run expect="Paris" -->      run as is; stdout must match the regex
    <!-- readme: serve -->                   starts the server the `client` blocks talk to (`make serve`)
    <!-- readme: client expect="Paris" -->   runs while that server is up, with its port in place of 8000
    <!-- readme: cluster -->                 needs a Kubernetes cluster: syntax-checked only
    <!-- readme: skip why="..." -->          not run here, with the reason

Every bash or python block must carry one, so a new example cannot slip past the tests. There is one
`serve` block (the README's); `client` blocks in docs/*.md talk to that same server.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

KINDS = ("run", "serve", "client", "cluster", "skip")
ROOT = Path(__file__).resolve().parents[2]
_FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.M | re.S)
_MARKER = re.compile(r"<!--\s*readme:\s*(\w+)(.*?)-->\s*$")


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    kind: str | None  # None: unmarked
    attrs: dict[str, str]
    line: int  # 1-based line of the opening fence
    file: str = "README.md"  # relative to the repository root

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line} ({self.lang})"


def _attrs(text: str) -> dict[str, str]:
    out = {}
    for item in shlex.split(text):
        key, _, value = item.partition("=")
        out[key] = value
    return out


def doc_files(root: Path = ROOT) -> list[Path]:
    """The files whose examples are tests: README.md, then docs/*.md in name order."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def blocks(path: Path, langs: tuple[str, ...] = ("bash", "python")) -> list[Block]:
    text = path.read_text(encoding="utf-8")
    try:
        name = path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        name = path.name
    out = []
    for m in _FENCE.finditer(text):
        lang = m.group(1)
        if lang not in langs:
            continue
        line = text.count("\n", 0, m.start()) + 1
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = _MARKER.search(before)
        kind, attrs = (marker.group(1), _attrs(marker.group(2))) if marker else (None, {})
        out.append(Block(lang, m.group(2), kind, attrs, line, name))
    return out


def all_blocks(root: Path = ROOT) -> list[Block]:
    """Every marked-or-not bash/python block of README.md and docs/*.md."""
    return [b for path in doc_files(root) for b in blocks(path)]
