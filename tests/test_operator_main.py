"""`python -m kvpilot.operator`: its options, and the settings they become (kept in kopf's memo)."""

from __future__ import annotations

import pytest

from kvpilot.operator.__main__ import build_parser, default_priority
from kvpilot.operator.config import OperatorConfig


def test_main_parses_options():
    args = build_parser().parse_args(["-n", "a", "-n", "b", "--peering", "p", "--metrics-port", "0"])
    assert (args.namespace, args.peering, args.metrics_port, args.all_namespaces) == (["a", "b"], "p", 0, False)
    assert default_priority("op-1") != default_priority("op-2")
    assert 1 <= default_priority("x") <= 10_000
    with pytest.raises(SystemExit):
        build_parser().parse_args(["-A", "-n", "a"])


def test_config_from_env_for_a_bare_kopf_run():
    env = {"KVPILOT_OPERATOR_METRICS_PORT": "0", "KVPILOT_OPERATOR_METRICS_HOST": "127.0.0.1",
           "KVPILOT_SCRAPE_TIMEOUT": "0.5", "KVPILOT_OPERATOR_NAMESPACES": "a,b"}
    cfg = OperatorConfig.from_env(env)
    assert (cfg.metrics_port, cfg.metrics_host, cfg.scrape_timeout, cfg.namespaces) == (0, "127.0.0.1", 0.5,
                                                                                        ("a", "b"))
    assert OperatorConfig.from_env({}) == OperatorConfig()
    assert OperatorConfig().namespaces == ()  # every namespace
