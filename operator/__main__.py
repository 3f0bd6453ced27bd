"""`python -m kvpilot.operator` / `kvpilot operator`: run the kopf operator."""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import socket
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpilot operator", description="Run the kvpilot Kubernetes operator.")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace (default)")
    scope.add_argument("-n", "--namespace", action="append", default=[], help="watch this namespace (repeatable)")
    peering = p.add_mutually_exclusive_group()
    peering.add_argument("--standalone", action="store_true", help="no peering: for one replica or tests")
    peering.add_argument("--peering", default=None, help="kopf peering object name (a second replica stays passive)")
    p.add_argument("--priority", type=int, default=None,
                   help="peering priority; defaults to a number derived from the pod name, so replicas differ")
    p.add_argument("--metrics-port", type=int, default=int(os.environ.get("KVPILOT_OPERATOR_METRICS_PORT", 8080)),
                   help="port of the operator's own /metrics; 0 disables it")
    p.add_argument("--metrics-host", default=os.environ.get("KVPILOT_OPERATOR_METRICS_HOST", "0.0.0.0"))
    p.add_argument("--liveness", default=None, help="kopf liveness endpoint, e.g. http://0.0.0.0:8081/healthz")
    p.add_argument("--scrape-timeout", type=float, default=float(os.environ.get("KVPILOT_SCRAPE_TIMEOUT", 2.0)),
                   help="seconds to wait for one pod's /metrics")
    p.add_argument("--lora-period", type=float, default=float(os.environ.get("KVPILOT_OPERATOR_LORA_PERIOD", 2.0)),
                   help="seconds between two reads of the daemons' adapters (how soon a restarted pod is reloaded)")
    p.add_argument("--lora-load-timeout", type=float,
                   default=float(os.environ.get("KVPILOT_OPERATOR_LORA_LOAD_TIMEOUT", 600.0)),
                   help="seconds one adapter load may take, download included")
    p.add_argument("--log-level", default=os.environ.get("KVPILOT_LOG_LEVEL", "INFO"),
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def default_priority(hostname: str) -> int:
    """Distinct replicas need distinct priorities: with equal ones kopf lets both work."""
    return int(hashlib.sha256(hostname.encode()).hexdigest(), 16) % 10_000 + 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import kopf

    from kvpilot.operator.config import OperatorConfig

    # Handed to the handlers in kopf's memo (startup reads memo.config), never through os.environ.
    config = OperatorConfig(metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                            scrape_timeout=args.scrape_timeout, namespaces=tuple(args.namespace),
                            lora_period=args.lora_period, lora_load_timeout=args.lora_load_timeout)

    kopf.configure(debug=args.log_level == "DEBUG", verbose=args.log_level == "DEBUG")
    logging.getLogger().setLevel(args.log_level)
    from kvpilot.operator import handlers  # noqa: F401  (registers the handlers)

    kopf.run(
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        standalone=args.standalone or None,
        peering_name=args.peering,
        priority=args.priority if args.priority is not None else default_priority(socket.gethostname()),
        liveness_endpoint=args.liveness,
        memo=kopf.Memo(config=config),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
