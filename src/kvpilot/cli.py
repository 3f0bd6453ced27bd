"""The `kvpilot` console script (and `python -m kvpilot`): one entry above the daemon, the router and the
operator, which never import each other. It only dispatches, importing the chosen command's module when it
runs: `serve` and `generate` to the daemon (kvpilot.daemon.cli), `router` and `operator` to theirs, with
every argument after the command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvpilot.version import __version__

# command -> its help line; each component parses its own arguments
COMMANDS = {
    "serve": "run the OpenAI-compatible daemon",
    "generate": "generate text once with the offline engine and print it",
    "router": "run the prefix- and load-aware router (arguments go to it)",
    "operator": "run the Kubernetes operator (arguments go to it)",
}


def build_parser() -> argparse.ArgumentParser:
    """`kvpilot`'s own parser: --help, --version and the command names (their flags are the components')."""
    p = argparse.ArgumentParser(prog="kvpilot", description="Kubernetes-native LLM serving.")
    p.add_argument("--version", action="version", version=f"kvpilot {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_line in COMMANDS.items():
        sub.add_parser(name, help=help_line, add_help=False).add_argument("args", nargs=argparse.REMAINDER)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv else None
    if command in ("serve", "generate"):  # the daemon's parser takes the command too
        from kvpilot.daemon.cli import main as daemon_main

        return daemon_main(argv)
    if command == "router":  # everything after it belongs to the router's own parser
        from kvpilot.router.cli import main as router_main

        return router_main(argv[1:]) or 0
    if command == "operator":  # likewise the operator's
        from kvpilot.operator.__main__ import main as operator_main

        return operator_main(argv[1:]) or 0
    parser = build_parser()
    parser.parse_args(argv)  # --help, --version, or an unknown command (exits)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
