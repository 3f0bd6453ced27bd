"""`make demo`: the scenarios live. Apply the CR, load it until it scales out, stop the load and watch it
scale back in, then change the spec and watch the rollout. Prints a table of replicas, KV% and waiting as it goes, a summary at the end, and saves a
plot (PNG) and the run's JSON to e2e/results/.

    .venv/bin/python e2e/demo.py [--kill] [--out DIR]

--kill adds scenario 5 (SIGKILL of one daemon mid-load). With E2E_KUBECONFIG it runs on that cluster
(see e2e/README.md). Everything runs on 127.0.0.0/8 and ends by
itself; Ctrl-C stops it early and still ends every process it started.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run by path (`python e2e/demo.py`): make the e2e package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # stdlib `operator` is loaded already

from e2e import lifecycle  # noqa: E402
from e2e.load import is_correct  # noqa: E402
from e2e.monitor import plot  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="e2e/demo.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--kill", action="store_true", help="also SIGKILL one daemon mid-load (scenario 5)")
    p.add_argument("--out", type=Path, default=RESULTS, help=f"where the PNG and JSON go (default {RESULTS})")
    p.add_argument("--every", type=float, default=2.0, help="seconds between table rows")
    p.add_argument("--hold", type=float, default=20.0, help="seconds of load at full scale before it stops")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    workdir = Path(tempfile.mkdtemp(prefix="kvpilot-demo-"))
    cfg = lifecycle.Config(workdir=workdir, kill=args.kill, table_every=args.every, hold_heavy=args.hold)
    api = f"the cluster of E2E_KUBECONFIG={os.environ['E2E_KUBECONFIG']}" if os.environ.get("E2E_KUBECONFIG") \
        else "kmock API on 127.0.0.1"
    print(f"kvpilot demo: {api}, the operator, daemons on 127.0.0.2+; logs in {workdir}")
    print(f"autoscaling: maxReplicas {cfg.max_replicas}, stable window {cfg.stable_window}s, "
          f"scale-down delay {cfg.scale_down_delay}s, metrics every {cfg.metrics_interval}s\n")
    try:
        rep = asyncio.run(lifecycle.run(cfg))
    except KeyboardInterrupt:
        print("\ninterrupted; every process the demo started has been stopped")
        return 130

    print()
    for label, t in rep.marks.items():
        print(f"  {t - rep.t0:7.1f}s  {label}")
    if rep.errors:
        for phase, err in rep.errors.items():
            print(f"\nphase {phase!r} failed: {err.splitlines()[0]}")
    s = rep.load.summary(rep.expected) if rep.load else {}
    print(f"\nrequests: {s.get('requests', 0)} sent, {s.get('completed', 0)} completed, {s.get('lost', 0)} lost; "
          f"{s.get('attempts', {}).get('429', 0)} answers were 429 (retried)")
    if rep.expected is not None and rep.load is not None:
        wrong = [r for r in rep.load.records if r.ok and not is_correct(r, rep.expected)]
        print(f"greedy outputs equal to the offline LLM: {s['correct']}/{s['completed']}"
              + (f"  ({len(wrong)} differ)" if wrong else ""))
    elif rep.reference_error:
        print(f"offline reference failed: {rep.reference_error[:300]}")

    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if rep.monitor is not None and rep.monitor.samples:
        keep = ("kubectl apply", "load starts", "scaled up", "pod 2 ready", "SIGKILL", "pod restarted",
                "load stops", "scaled down", "spec change", "rollout done")
        png = plot(rep.monitor.samples, args.out / f"demo-{stamp}.png", rep.t0,
                   {k: v for k, v in rep.marks.items() if k in keep},
                   "kvpilot: autoscaling on KV-cache pressure (kmock + operator + real daemons)")
        print(f"plot: {png}")
    rep.dump(args.out / f"demo-{stamp}.json")
    print(f"timeline: {args.out / f'demo-{stamp}.json'}  (wall {rep.wall_s:.0f}s)")
    return 1 if rep.errors or s.get("lost") or s.get("incorrect") else 0


if __name__ == "__main__":
    sys.exit(main())
