"""`python -m kvpilot.router` flags and their KVPILOT_ROUTER_* environment defaults."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvpilot.router.cli import build_parser, settings_from_args


def test_flags_become_settings():
    ns = build_parser().parse_args(["--endpoints", "127.0.0.1:1", "--no-prefix", "--session", "header:X-Chat",
                                    "--load-cap", "0.5", "--hold-timeout", "3"])
    s = settings_from_args(ns)
    assert not s.picker.prefix and s.picker.session and s.picker.load_cap == 0.5
    assert s.session_source == "header:X-Chat" and s.proxy.hold_timeout == 3.0
    assert s.picker.slots is None and s.tokenize_threads == 2 and s.tokenize_inline_chars == 1024
    ns = build_parser().parse_args(["--endpoints", "127.0.0.1:1", "--replica-slots", "8", "--queue-weight", "2",
                                    "--kv-weight", "0.5", "--tokenize-threads", "0", "--tokenize-inline-chars", "99"])
    s = settings_from_args(ns)
    assert (s.picker.slots, s.picker.queue_weight, s.picker.kv_weight) == (8.0, 2.0, 0.5)
    assert (s.tokenize_threads, s.tokenize_inline_chars) == (0, 99)
    assert s.tokenize_max_pending is None  # the pool's default: a few per thread
    ns = build_parser().parse_args(["--endpoints", "127.0.0.1:1", "--tokenize-max-pending", "0"])
    assert settings_from_args(ns).tokenize_max_pending == 0


def test_spill_and_adapter_flags_become_settings():
    s = settings_from_args(build_parser().parse_args(["--endpoints", "127.0.0.1:1"]))
    assert (s.picker.spill_margin, s.picker.spill_kv_margin, s.picker.adapter, s.models_interval) == (2.0, 0.5, True, 5.0)
    ns = build_parser().parse_args(["--endpoints", "127.0.0.1:1", "--spill-margin", "inf", "--spill-kv-margin", "0.25",
                                    "--no-adapter-affinity", "--models-interval", "30"])
    s = settings_from_args(ns)
    assert s.picker.spill_margin == float("inf") and s.picker.spill_kv_margin == 0.25
    assert not s.picker.adapter and s.models_interval == 30.0


def test_environment_sets_defaults_and_flags_win(monkeypatch):
    monkeypatch.setenv("KVPILOT_ROUTER_SERVICE", "llm")
    monkeypatch.setenv("KVPILOT_ROUTER_LOAD", "false")
    monkeypatch.setenv("KVPILOT_ROUTER_BLOCK_SIZE", "32")
    monkeypatch.setenv("KVPILOT_ROUTER_TOKENIZE_MAX_PENDING", "3")
    s = settings_from_args(build_parser().parse_args([]))
    assert s.service == "llm" and not s.picker.load and s.block_size == 32 and s.tokenize_max_pending == 3
    s = settings_from_args(build_parser().parse_args(["--block-size", "16"]))
    assert s.block_size == 16


@pytest.mark.parametrize("argv", [[], ["--endpoints", "x:1", "--session", "cookie"],
                                  ["--endpoints", "x:1", "--tokenize-threads", "-1"],
                                  ["--endpoints", "x:1", "--tokenize-max-pending", "-1"],
                                  ["--endpoints", "x:1", "--replica-slots", "0"],
                                  ["--endpoints", "x:1", "--spill-margin", "-1"],
                                  ["--endpoints", "x:1", "--models-interval", "0"]])
def test_bad_arguments_are_refused(argv, monkeypatch):
    monkeypatch.delenv("KVPILOT_ROUTER_SERVICE", raising=False)
    monkeypatch.delenv("KVPILOT_ROUTER_ENDPOINTS", raising=False)
    with pytest.raises(ValueError):
        settings_from_args(build_parser().parse_args(argv))


def test_module_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "kvpilot.router", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "--endpoints" in out.stdout and "--service" in out.stdout
