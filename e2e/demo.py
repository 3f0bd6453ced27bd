"""`make demo`: the scenarios live. Apply the CR, load it until it scales out, stop the load and watch it
scale back in, then change the spec and watch the rollout; then the router scenario: scale to zero, a
request held by the router wakes the model, a daemon killed mid-stream, back to zero. Prints a table of
replicas, KV%, waiting and held requests as it goes, a summary after each, and saves plots (PNG) and the
runs' JSON to e2e/results/.

    .venv/bin/python e2e/demo.py [--kill] [--router | --no-router] [--out DIR]

--kill adds scenario 5 (SIGKILL of one daemon mid-load); --router runs only the router scenario (its plot:
replicas, the routers' held-requests gauge, the first request sent and its first token), --no-router only
the autoscaling one. With E2E_KUBECONFIG the autoscaling scenarios run on that cluster (see e2e/README.md);
the router scenario runs on the emulator only. Everything runs on 127.0.0.0/8 and ends by itself; Ctrl-C
stops it early and still ends every process it started.
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
from typing import Any

if __package__ in (None, ""):  # run by path (`python e2e/demo.py`): make the e2e package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # stdlib `operator` is loaded already

from e2e import lifecycle, router_scenario  # noqa: E402
from e2e.load import is_correct  # noqa: E402
from e2e.monitor import Plotter, plot, plot_from_zero, plot_run  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="e2e/demo.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--kill", action="store_true", help="also SIGKILL one daemon mid-load (scenario 5)")
    only = p.add_mutually_exclusive_group()
    only.add_argument("--router", action="store_true", help="only the router scenario (scale from zero)")
    only.add_argument("--no-router", action="store_true", help="only the autoscaling scenarios")
    p.add_argument("--out", type=Path, default=RESULTS, help=f"where the PNG and JSON go (default {RESULTS})")
    p.add_argument("--every", type=float, default=2.0, help="seconds between table rows")
    p.add_argument("--hold", type=float, default=20.0, help="seconds of load at full scale before it stops")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    try:
        rc = 0 if args.router else _autoscaling(args, stamp)
        if not args.no_router:
            rc = max(rc, _router(args, stamp))
    except KeyboardInterrupt:
        print("\ninterrupted; every process the demo started has been stopped")
        return 130
    return rc


def _print_marks(marks: dict[str, float], t0: float, errors: dict[str, str]) -> None:
    print()
    for label, t in sorted(marks.items(), key=lambda kv: kv[1]):
        print(f"  {t - t0:7.1f}s  {label}")
    for phase, err in errors.items():
        print(f"\nphase {phase!r} failed: {err.splitlines()[0]}")


def _autoscaling(args: argparse.Namespace, stamp: str) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="kvpilot-demo-"))
    cfg = lifecycle.Config(workdir=workdir, kill=args.kill, table_every=args.every, hold_heavy=args.hold)
    api = f"the cluster of E2E_KUBECONFIG={os.environ['E2E_KUBECONFIG']}" if os.environ.get("E2E_KUBECONFIG") \
        else "kmock API on 127.0.0.1"
    print(f"kvpilot demo: {api}, the operator, daemons on 127.0.0.2+; logs in {workdir}")
    print(f"autoscaling: maxReplicas {cfg.max_replicas}, stable window {cfg.stable_window}s, "
          f"scale-down delay {cfg.scale_down_delay}s, metrics every {cfg.metrics_interval}s\n")
    rep = asyncio.run(lifecycle.run(cfg))
    _print_marks(rep.marks, rep.t0, rep.errors)
    s = rep.load.summary(rep.expected) if rep.load else {}
    print(f"\nrequests: {s.get('requests', 0)} sent, {s.get('completed', 0)} completed, {s.get('lost', 0)} lost; "
          f"{s.get('attempts', {}).get('429', 0)} answers were 429 (retried)")
    if rep.expected is not None and rep.load is not None:
        wrong = [r for r in rep.load.records if r.ok and not is_correct(r, rep.expected)]
        print(f"greedy outputs equal to the offline LLM: {s['correct']}/{s['completed']}"
              + (f"  ({len(wrong)} differ)" if wrong else ""))
    elif rep.reference_error:
        print(f"offline reference failed: {rep.reference_error[:300]}")
    keep = ("kubectl apply", "load starts", "scaled up", "pod 2 ready", "SIGKILL", "pod restarted",
            "load stops", "scaled down", "spec change", "rollout done")
    _save_plot(plot, rep, args.out / f"demo-{stamp}.png", keep,
               "kvpilot: autoscaling on KV-cache pressure (kmock + operator + real daemons)")
    rep.dump(args.out / f"demo-{stamp}.json")
    print(f"timeline: {args.out / f'demo-{stamp}.json'}  (wall {rep.wall_s:.0f}s)")
    return 1 if rep.errors or s.get("lost") or s.get("incorrect") else 0


def _save_plot(plotter: Plotter, rep: Any, path: Path, keep: tuple[str, ...], title: str) -> None:
    """The run's plot with only the marks worth labelling (all of them crowd the axis)."""
    png = plot_run(plotter, rep.monitor, path, rep.t0, {k: v for k, v in rep.marks.items() if k in keep}, title)
    if png is not None:
        print(f"plot: {png}")


def _router(args: argparse.Namespace, stamp: str) -> int:
    why = router_scenario.cluster_limit()
    if why is not None:
        print(f"\nrouter scenario skipped: {why}")
        return 2 if args.router else 0
    workdir = Path(tempfile.mkdtemp(prefix="kvpilot-demo-router-"))
    cfg = router_scenario.Config(workdir=workdir, table_every=args.every)
    print(f"\nkvpilot demo, router: kmock API on 127.0.0.1, the operator, 2 routers and the daemons on 127.0.0.2+; "
          f"logs in {workdir}")
    print(f"minReplicas 0, scale to zero after {cfg.scale_to_zero_after}s idle; {cfg.burst} requests sent at zero\n")
    rep = asyncio.run(router_scenario.run(cfg))
    _print_marks(rep.marks, rep.t0, rep.errors)
    lost = [r for r in (rep.load.records if rep.load else []) if not r.ok]
    if rep.first is not None and rep.first.first_token is not None:
        print(f"\nfirst request at zero: first token after {rep.first.first_token - rep.first.start:.1f}s "
              f"(send -> router holds -> 0 -> 1 -> model loaded -> token); {len(lost)} requests lost")
    if rep.kill_stream is not None:
        print(f"daemon SIGKILLed mid-stream: the stream ended as {rep.kill_stream.outcome} "
              f"after {rep.kill_stream.chunks} chunks")
    keep = ("kubectl apply", "scaled to 0", "first request sent", "first token", "SIGKILL mid-stream",
            "load stops", "scaled to 0 again")
    _save_plot(plot_from_zero, rep, args.out / f"demo-router-{stamp}.png", keep,
               "kvpilot: scale from zero behind the router (kmock + operator + real router, daemons)")
    rep.dump(args.out / f"demo-router-{stamp}.json")
    print(f"timeline: {args.out / f'demo-router-{stamp}.json'}  (wall {rep.wall_s:.0f}s)")
    return 1 if rep.errors or lost or (rep.kill_stream and rep.kill_stream.outcome not in ("error-event", "completed")) \
        else 0


if __name__ == "__main__":
    sys.exit(main())
