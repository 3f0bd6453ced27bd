"""The operator's own settings, kept in kopf's memo (memo.config) for every handler to read.

`python -m kvpilot.operator` builds them from its options and hands them to kopf.run(memo=...). Under a bare
`kopf run -m kvpilot.operator.handlers` there are no options, so startup reads them once from the environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class OperatorConfig:
    metrics_port: int = 8080  # the operator's own /metrics; 0 disables it
    metrics_host: str = "0.0.0.0"
    scrape_timeout: float = 2.0  # seconds for one pod's /metrics
    namespaces: tuple[str, ...] = ()  # empty: every namespace
    loop_period: float = 0.5  # how often the autoscaling loop looks for InferenceDeployments that are due
    lora_period: float = 2.0  # how often the LoRAAdapter loop reads the daemons' /v1/models (a restart's delay)
    lora_load_timeout: float = 600.0  # seconds for one load_lora_adapter call, which may download the adapter

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorConfig:
        env = os.environ if env is None else env
        namespaces = tuple(n for n in env.get("KVPILOT_OPERATOR_NAMESPACES", "").split(",") if n)
        return cls(
            metrics_port=int(env.get("KVPILOT_OPERATOR_METRICS_PORT", cls.metrics_port)),
            metrics_host=env.get("KVPILOT_OPERATOR_METRICS_HOST", cls.metrics_host),
            scrape_timeout=float(env.get("KVPILOT_SCRAPE_TIMEOUT", cls.scrape_timeout)),
            namespaces=namespaces,
            lora_period=float(env.get("KVPILOT_OPERATOR_LORA_PERIOD", cls.lora_period)),
            lora_load_timeout=float(env.get("KVPILOT_OPERATOR_LORA_LOAD_TIMEOUT", cls.lora_load_timeout)),
        )
