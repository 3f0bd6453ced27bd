"""The `kvpilot` console script (kvpilot/cli.py): the installed script, serve and generate (the daemon's
kvpilot.daemon.cli), router and operator delegation."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "kvpilot"]
ENV = dict(os.environ)


def run_cli(*args: str, timeout: float = 120, env: dict | None = None, stdin: str | None = None):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          env={**ENV, **(env or {})}, input=stdin)


def test_console_script_is_installed_and_serve_help_lists_flags():
    script = Path(sys.executable).parent / "kvpilot"
    assert script.exists(), "pip install -e . should create the kvpilot console script"
    r = subprocess.run([str(script), "serve", "--help"], capture_output=True, text=True, timeout=60, env=ENV)
    assert r.returncode == 0, r.stderr
    for flag in ("--host", "--port", "--api-key", "--served-model-name", "--block-size", "--max-num-seqs",
                 "--max-num-batched-tokens", "--max-model-len", "--dtype", "--kv-cache-memory",
                 "--enable-prefix-caching", "--no-enable-prefix-caching", "--scheduling-policy",
                 "--max-queued-requests", "--shutdown-timeout"):
        assert flag in r.stdout, flag


def test_no_command_prints_help_and_fails():
    r = run_cli(timeout=60)
    assert r.returncode == 2 and "serve" in r.stdout and "generate" in r.stdout


def test_serve_exits_1_when_the_model_cannot_load(tmp_path):
    r = run_cli("serve", str(tmp_path / "no-such-model"), "--port", "0", timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "model failed to load" in r.stderr


@pytest.mark.slow
def test_generate_prints_greedy_text():
    r = run_cli("generate", "-", "--max-tokens", "6", "--kv-cache-memory", "64MiB", "--chat",
                stdin="What is the capital of France?", timeout=300, env={"KVPILOT_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip(), "generate printed nothing"


def test_generate_rejects_bad_sampling_values():
    r = run_cli("generate", "hi", "--temperature", "-1", timeout=60)
    assert r.returncode == 2 and "temperature" in r.stderr


def test_operator_subcommand_delegates():
    if importlib.util.find_spec("kvpilot.operator.__main__") is None:
        pytest.skip("kvpilot.operator.__main__ is not written yet")
    r = run_cli("operator", "--help", timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "usage" in r.stdout.lower() and "kvpilot serve" not in r.stdout
