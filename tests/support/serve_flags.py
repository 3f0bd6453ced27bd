"""The `kvpilot serve` flag table of docs/configuration.md, made from `kvpilot serve --help` (what users see).

    .venv/bin/python tests/support/serve_flags.py          # rewrite the table in docs/configuration.md (`make readme`)
    tests/test_readme.py checks that the table is current.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

TARGET = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
START, END = "<!-- serve-flags:start -->", "<!-- serve-flags:end -->"
_OPTION = re.compile(r"^  (-\S.*?)(?:\s{2,}(\S.*))?$")


def help_text() -> str:
    exe = Path(sys.executable).parent / "kvpilot"
    r = subprocess.run([str(exe), "serve", "--help"], capture_output=True, text=True, check=True, timeout=60,
                       env={**os.environ, "COLUMNS": "500"})
    return r.stdout


def options(text: str) -> list[tuple[str, str]]:
    """(flag spelling, help) for every option but --help, in --help's order."""
    rows: list[list[str]] = []
    for line in text.splitlines():
        m = _OPTION.match(line)
        if m:
            rows.append([m.group(1).strip(), m.group(2) or ""])
        elif rows and line.startswith("    ") and line.strip():
            rows[-1][1] = (rows[-1][1] + " " + line.strip()).strip()
        elif not line.strip() or not line.startswith(" "):
            rows.append(["", ""])  # a blank line or heading ends the option before it
    return [(flag, desc) for flag, desc in rows if flag and not flag.startswith("-h")]


def table(text: str) -> str:
    lines = ["| flag | meaning |", "|---|---|"]
    for flag, desc in options(text):
        shown = ", ".join(f"`{part.strip()}`" for part in flag.split(", "))
        lines.append(f"| {shown} | {desc.replace('|', '/')} |")
    return "\n".join(lines)


def section(text: str) -> str:
    return f"{START}\n{table(text)}\n{END}"


def main() -> int:
    doc = TARGET.read_text(encoding="utf-8")
    if START not in doc or END not in doc:
        print(f"{TARGET} lacks {START} ... {END}", file=sys.stderr)
        return 1
    new = re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: section(help_text()), doc, flags=re.S)
    TARGET.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
