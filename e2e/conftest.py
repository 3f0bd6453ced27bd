"""One end-to-end run per session, shared by the scenario tests (each asserts on its part of the report).

The run starts the kmock emulator (or, with E2E_KUBECONFIG, uses that cluster), the operator, the node agent with real daemons and the load; it takes a
few minutes on two CPU cores. Its logs, report.json and a plot stay in the pytest temp folder named in any
failure message.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from .lifecycle import Config, Report, run
from .target import ClusterError

# the daemons the local node agent starts inherit this: their KV caches stay lazily mapped (see tests/conftest.py)
os.environ.setdefault("KVPILOT_POPULATE_KV", "0")


@pytest.fixture(scope="session")
def e2e_run(tmp_path_factory: pytest.TempPathFactory) -> Report:
    workdir = Path(os.environ.get("KVPILOT_E2E_WORKDIR") or tmp_path_factory.mktemp("e2e"))
    try:
        report = asyncio.run(run(Config(workdir=workdir)))
    except ClusterError as e:  # E2E_KUBECONFIG names a cluster that cannot run it: fail, never skip
        pytest.fail(str(e), pytrace=False)
    from .monitor import plot, plot_run

    plot_run(plot, report.monitor, workdir / "timeline.png", report.t0, report.marks,
             "kvpilot e2e: replicas and KV-cache usage")
    print(f"\ne2e run: {report.wall_s:.0f}s, workdir {workdir}, phases {report.done}, errors {list(report.errors)}")
    return report


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The pod network the runs used (netns.py), once at the end, where -q does not hide it."""
    from . import netns

    if netns.chosen() is not None:
        mode, why = netns.chosen()  # type: ignore[misc]
        terminalreporter.write_line(f"e2e pod network: {mode} ({why})")
