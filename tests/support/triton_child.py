"""Triton kernels run on CPU tensors only under ``TRITON_INTERPRET=1``, which must be set before triton is
imported: a test module's ``test_triton_*`` tests run in a child pytest with it set."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def run_triton_tests_in_interpreter(test_file: str) -> None:
    """Run ``test_file``'s ``test_triton_*`` tests in a child under the interpreter; all must pass, none skip."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "test_triton_", test_file]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=Path(test_file).parents[1])
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-4000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-2000:]
