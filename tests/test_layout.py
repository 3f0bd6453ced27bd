"""The repository's top-level folders never stand in for another module.

`python -m pytest` (what `make test` runs) and `python -m kvpilot...` from the repository root put the
root first on `sys.path`, so a top-level folder that is a regular package wins over any installed
module of the same name: transformers' `from kernels import ...` once got our kernels.
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def top_level_packages() -> list[str]:
    return sorted(p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").is_file())


def shadowed(folders: list[str], installed: dict[str, list[str]], stdlib: frozenset[str]) -> dict[str, str]:
    """Each folder named like an installed module (-> its distributions) or a standard one."""
    return {name: ", ".join(installed.get(name, [])) or "the standard library"
            for name in folders if name in installed or name in stdlib}


def test_no_top_level_package_shadows_an_installed_or_standard_module() -> None:
    assert "daemon" in top_level_packages()  # the listing sees the regular packages
    assert "kernels" not in top_level_packages()  # a namespace folder, like operator/: it shadows nothing
    assert shadowed(top_level_packages(), importlib.metadata.packages_distributions(), sys.stdlib_module_names) == {}


def test_a_kernels_folder_would_be_caught() -> None:
    installed = {"kernels": ["kernels"], "torch": ["torch"]}
    assert shadowed(["kernels", "daemon", "json"], installed, frozenset({"json"})) == {
        "kernels": "kernels", "json": "the standard library"}
