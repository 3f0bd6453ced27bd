"""The images' build contexts: each Dockerfile copies every folder `pip install .` needs, and no folder the
repository no longer has. The daemon image once lacked router/ (added after it was written) and the operator
image still copied an old kernels folder after it was renamed: both builds failed at COPY or at install."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILES = sorted((ROOT / "docker").glob("Dockerfile.*"))


def copied_paths(dockerfile: Path) -> list[str]:
    """The sources of each `COPY <src>... <dest>` (build-context paths, no --from stages)."""
    sources: list[str] = []
    for line in dockerfile.read_text().splitlines():
        parts = line.split()
        if parts[:1] == ["COPY"] and not any(p.startswith("--from") for p in parts):
            sources += [p for p in parts[1:-1] if not p.startswith("--")]
    return sources


def package_folders() -> set[str]:
    setuptools_cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {folder.split("/")[0] for folder in setuptools_cfg["package-dir"].values()}


def test_there_are_images_to_check() -> None:
    assert {p.name for p in DOCKERFILES} >= {"Dockerfile.daemon", "Dockerfile.operator"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_each_image_copies_every_package_folder_and_only_what_exists(dockerfile: Path) -> None:
    sources = copied_paths(dockerfile)
    assert "pyproject.toml" in sources
    assert package_folders() <= {s.rstrip("/") for s in sources}
    assert [s for s in sources if not (ROOT / s).exists()] == []


def test_a_context_of_what_the_daemon_image_copies_builds_a_wheel(tmp_path: Path) -> None:
    # what `pip install .` inside the image sees: only the copied paths
    context = tmp_path / "context"
    context.mkdir()
    for src in copied_paths(ROOT / "docker" / "Dockerfile.daemon"):
        if (ROOT / src).is_dir():
            shutil.copytree(ROOT / src, context / src, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / src, context / src)
    out = tmp_path / "wheel"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out), str(context)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = out.glob("kvpilot-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for module in ("kvpilot/router/__main__.py", "kvpilot/kernels/ops.py", "kvpilot/kernels/csrc/cpu_simd.h",
                   "kvpilot/daemon/engine/models/quantization/unquantized.py", "kvpilot/cli.py", "kvpilot/common/protocol.py",
                   "kvpilot/operator/__main__.py"):
        assert module in names
    assert any(re.fullmatch(r"kvpilot/kernels/csrc/\w+\.c", n) for n in names)
