"""Watches the cluster the way `kubectl get -w` would: the CR's status, the Deployment, the daemon Pods and
the Events, sampled on an interval. The samples are the run's timeline (assertions, the live table, the
plot); the ready, non-terminating pods are the Service's endpoints for the load generator. With a router in
front, `held` reads the routers' held-requests gauge into each sample too.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from kvpilot.operator.resources import matches_selector

from .cluster import Kube, condition, events, pod_ready, pods, terminating
from .load import Endpoint, LoadGenerator


@dataclass
class PodView:
    name: str
    ip: str | None
    ready: bool
    terminating: bool
    restarts: int


@dataclass
class Sample:
    t: float
    phase: str
    replicas: int | None  # Deployment spec.replicas: what the operator asked for
    ready: int  # pods Ready in the API
    cr_replicas: int | None
    cr_ready: int | None
    cr_desired: int | None
    kv: float | None  # the operator's view (status.metrics): mean KV usage over the sampled pods
    waiting: float | None
    running: float | None
    sampled: int | None
    failed: int | None
    reason: str | None
    cr_ready_condition: str | None
    pods: list[PodView]
    ok: int
    rejected_429: int
    inflight: int
    held: float | None = None  # requests the routers hold (their gauge, summed); None without routers


@dataclass
class SeenEvent:
    t: float
    reason: str
    message: str


@dataclass
class Monitor:
    kube: Kube
    ns: str
    name: str
    load: LoadGenerator
    clock: Callable[[], float] = time.monotonic
    interval: float = 0.5
    table_every: float | None = None  # seconds between printed rows; None prints nothing
    held: Callable[[], Awaitable[float | None]] | None = None  # the routers' held requests, when there are routers
    out: TextIO = sys.stdout
    samples: list[Sample] = field(default_factory=list)
    events: dict[str, SeenEvent] = field(default_factory=dict)
    phase: str = "start"
    t0: float = 0.0  # the table's time zero
    _endpoints: list[Endpoint] = field(default_factory=list)
    _last_row: float = -1e9
    errors: list[str] = field(default_factory=list)

    def endpoints(self) -> list[Endpoint]:
        return list(self._endpoints)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.sample()
            except Exception as e:  # noqa: BLE001 - a missed sample is not a failed run
                self.errors.append(f"{type(e).__name__}: {e}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval)

    async def sample(self) -> Sample:
        cr = await self.kube.cr(self.ns, self.name)
        dep = await self.kube.deployment(self.ns, self.name)
        # The daemons only: the router's pods carry the CR's label too.
        pod_list = [p for p in await self.kube.list(pods(self.ns))
                    if matches_selector(p["metadata"].get("labels"), self.name)]
        for ev in await self.kube.list(events(self.ns)):
            key = ev["metadata"]["name"]
            if key not in self.events:
                self.events[key] = SeenEvent(self.clock(), ev.get("reason", ""), ev.get("message", ""))
        views = []
        eps = []
        for p in sorted(pod_list, key=lambda p: p["metadata"]["name"]):
            st = p.get("status") or {}
            cs = (st.get("containerStatuses") or [{}])[0]
            v = PodView(p["metadata"]["name"], st.get("podIP"), pod_ready(p), terminating(p),
                        int(cs.get("restartCount", 0) or 0))
            views.append(v)
            if v.ready and not v.terminating and v.ip:
                ctr = (p.get("spec", {}).get("containers") or [{}])[0]
                port = next((x["containerPort"] for x in ctr.get("ports", []) if x.get("name") == "http"), 8000)
                eps.append(Endpoint(v.name, f"http://{v.ip}:{port}"))
        self._endpoints = eps
        status = (cr or {}).get("status") or {}
        m = status.get("metrics") or {}
        summary = self.load.summary()
        s = Sample(
            t=self.clock(), phase=self.phase,
            replicas=(dep or {}).get("spec", {}).get("replicas"),
            ready=sum(v.ready and not v.terminating for v in views),
            cr_replicas=status.get("replicas"), cr_ready=status.get("readyReplicas"),
            cr_desired=status.get("desiredReplicas"),
            kv=m.get("kvCacheUsage"), waiting=m.get("waitingRequests"), running=m.get("runningRequests"),
            sampled=m.get("sampledPods"), failed=m.get("failedPods"),
            reason=(status.get("autoscaler") or {}).get("reason"),
            cr_ready_condition=(condition(cr, "Ready") or {}).get("status"),
            pods=views, ok=summary["completed"], rejected_429=summary["attempts"].get("429", 0),
            inflight=self.load.inflight, held=await self.held() if self.held is not None else None,
        )
        self.samples.append(s)
        if self.table_every is not None and s.t - self._last_row >= self.table_every:
            self._last_row = s.t
            self.print_row(s, self.t0)
        return s

    # ------------------------------------------------------------------ live table

    HEADER = (f"{'t(s)':>6}  {'phase':<12} {'want':>4} {'ready':>5} {'KV%':>5} {'wait':>5} {'run':>4}  "
              f"{'ok':>4} {'429':>4} {'inflt':>5} {'held':>4}  {'autoscaler':<17} pods")

    def print_header(self) -> None:
        print(self.HEADER, file=self.out)
        print("-" * len(self.HEADER), file=self.out, flush=True)

    def print_row(self, s: Sample, t0: float = 0.0) -> None:
        def fmt(v: float | None, spec: str) -> str:
            return "-" if v is None else format(v, spec)

        pods_s = " ".join(f"{p.name[-5:]}{'+' if p.ready and not p.terminating else '~' if p.terminating else '.'}"
                          + (f"r{p.restarts}" if p.restarts else "") for p in s.pods)
        print(f"{s.t - t0:6.1f}  {s.phase:<12} {fmt(s.replicas, 'd'):>4} {s.ready:>5} "
              f"{fmt(None if s.kv is None else s.kv * 100, '.0f'):>5} {fmt(s.waiting, '.1f'):>5} "
              f"{fmt(s.running, '.0f'):>4}  {s.ok:>4} {s.rejected_429:>4} {s.inflight:>5} {fmt(s.held, '.0f'):>4}  "
              f"{(s.reason or '-'):<17} {pods_s}", file=self.out, flush=True)

    # ------------------------------------------------------------------ queries

    def first(self, pred: Callable[[Sample], bool], after: float = -1e18) -> Sample | None:
        return next((s for s in self.samples if s.t >= after and pred(s)), None)

    def between(self, t0: float, t1: float) -> list[Sample]:
        return [s for s in self.samples if t0 <= s.t <= t1]

    def events_with(self, reason: str) -> list[SeenEvent]:
        return sorted((e for e in self.events.values() if e.reason == reason), key=lambda e: e.t)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _replicas_axis(ax: Any, t: list[float], samples: list[Sample], title: str) -> None:
    """Replicas asked for (the Deployment's spec) and ready daemon pods, as steps."""
    ax.step(t, [s.replicas or 0 for s in samples], where="post", label="replicas (Deployment spec)", lw=2)
    ax.step(t, [s.ready for s in samples], where="post", label="ready pods", lw=1.5, ls="--")
    ax.set_ylabel("pods")
    ax.set_ylim(bottom=0, top=max([s.replicas or 0 for s in samples] + [s.ready for s in samples] + [1]) + 0.7)
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.legend(loc="lower right")
    ax.set_title(title)


def _series(t: list[float], samples: list[Sample], value: Callable[[Sample], float | None]) -> list[tuple[float, float]]:
    return [(x, v) for x, s in zip(t, samples, strict=True) if (v := value(s)) is not None]


def _marks(fig: Any, axes: list[Any], marks: dict[str, float], t0: float, path: Path) -> Path:
    """Vertical marks with their labels on the top axis, then the PNG."""
    top = axes[0].get_ylim()[1]
    for i, (label, x) in enumerate(sorted(marks.items(), key=lambda kv: kv[1])):
        for ax in axes:
            ax.axvline(x - t0, color="grey", lw=0.8, ls=":")
        # Alternate heights so that marks close in time stay readable.
        axes[0].annotate(label, (x - t0, top * (0.98 if i % 2 == 0 else 0.55)), rotation=90, va="top", ha="right",
                         fontsize=8, color="dimgrey")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def plot(samples: list[Sample], path: Path, t0: float, marks: dict[str, float], title: str) -> Path:
    """Replicas (asked for / ready) and KV usage + waiting over time, as a PNG."""
    plt = _pyplot()
    t = [s.t - t0 for s in samples]
    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(10, 6.5), height_ratios=[1, 1.2])
    _replicas_axis(ax1, t, samples, title)
    kv = _series(t, samples, lambda s: None if s.kv is None else s.kv * 100)
    waiting = _series(t, samples, lambda s: s.waiting)
    if kv:
        ax2.plot(*zip(*kv, strict=True), color="tab:red", label="KV cache usage % (mean over pods)")
    ax2.set_ylabel("KV cache %")
    ax2.set_ylim(0, 100)
    ax3 = ax2.twinx()
    if waiting:
        ax3.plot(*zip(*waiting, strict=True), color="tab:purple", alpha=0.7, label="waiting requests (total)")
    ax3.set_ylabel("waiting")
    ax3.set_ylim(bottom=0)
    lines = ax2.get_legend_handles_labels()[0] + ax3.get_legend_handles_labels()[0]
    labels = ax2.get_legend_handles_labels()[1] + ax3.get_legend_handles_labels()[1]
    ax2.legend(lines, labels, loc="upper right")
    ax2.set_xlabel("seconds since kubectl apply")
    try:
        return _marks(fig, [ax1, ax2], marks, t0, path)
    finally:
        plt.close(fig)


def plot_from_zero(samples: list[Sample], path: Path, t0: float, marks: dict[str, float], title: str) -> Path:
    """Scale from zero: replicas (asked for / ready) over the routers' held-requests gauge and the client's
    requests in flight, as a PNG."""
    plt = _pyplot()
    t = [s.t - t0 for s in samples]
    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(10, 6.5), height_ratios=[1, 1])
    _replicas_axis(ax1, t, samples, title)
    held = _series(t, samples, lambda s: s.held)
    if held:
        ax2.step(*zip(*held, strict=True), where="post", color="tab:orange", lw=2,
                 label="held by the routers (kvpilot:router_held_requests)")
    ax2.step(t, [s.inflight for s in samples], where="post", color="tab:blue", alpha=0.6, ls="--",
             label="client requests in flight")
    ax2.set_ylabel("requests")
    ax2.set_ylim(bottom=0, top=max([s.inflight for s in samples] + [v for _, v in held] + [1]) + 0.7)
    ax2.yaxis.get_major_locator().set_params(integer=True)
    ax2.legend(loc="upper left")  # the held step comes later, at the right
    ax2.set_xlabel("seconds since kubectl apply")
    try:
        return _marks(fig, [ax1, ax2], marks, t0, path)
    finally:
        plt.close(fig)


Plotter = Callable[[list[Sample], Path, float, dict[str, float], str], Path]


def plot_run(plotter: Plotter, monitor: Monitor | None, path: Path, t0: float, marks: dict[str, float],
             title: str) -> Path | None:
    """The run's plot when the monitor sampled anything; a failure is printed, never raised: the plot is a
    convenience for reading a run, not one of its checks."""
    if monitor is None or not monitor.samples:
        return None
    try:
        return plotter(monitor.samples, path, t0, marks, title)
    except Exception as e:  # noqa: BLE001
        print(f"plot failed: {e}")
        return None
