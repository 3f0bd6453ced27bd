"""The router scenario: routing across replicas and scale from zero, acted out with real parts.

An InferenceDeployment with `spec.router.enabled` and `autoscaling.minReplicas: 0`: the operator deploys the
router (two `python -m kvpilot.router` pods, which the node agent runs as real processes in their own
network namespaces, or on loopback addresses where none can be made; see netns.py) and puts the daemons behind the headless Service `<name>-daemons`, whose EndpointSlices the
routers watch. Phases, each recorded into a `Report`:

1. deploy: the router pods Ready and found through the user-facing Service's EndpointSlices; the first
   daemon Ready (a new model is loaded once, at one replica);
2. to-zero: nothing to do for `scaleToZeroAfterSeconds` -> 0 replicas, the pod gone, the routers see none;
3. from-zero: requests (the official openai client, the first one streamed) sent to a router while no
   daemon exists: the router holds them, the operator reads held > 0 on its /metrics and scales 0 -> 1, the
   requests complete; the first one's send -> first token is the cold-start latency;
4. mid-stream-kill: SIGKILL of the daemon while it streams: the stream must end with an SSE error event
   (or complete), never silently truncated;
5. back-to-zero: the load stops; after the idle period the daemons go to zero again.

On the emulator the node agent also plays the EndpointSlice controller; on a cluster the endpoints controller
writes the slices from the pods' 198.18.x addresses. The router pods carry the e2e node's nodeSelector and
toleration through spec.router, so a cluster's scheduler places them there too. See `cluster_limit`.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.operator import crd

from . import netns, procs, workload
from .agent import NodeAgent
from .cluster import Kube, deployments, endpointslices, services
from .endpointslices import SERVICE_NAME_LABEL, service_endpoints
from .lifecycle import Config as MainConfig
from .lifecycle import (
    Phases,
    e2e_cr,
    node_model_cache,
    requests_json,
    run_phase,
    start_operator,
    timeline_json,
    until,
)
from .load import Endpoint, LoadGenerator, Record, StreamRecord
from .monitor import Monitor
from .node import GPU, NodeSpec, quantity
from .target import ENV, open_target

HELD = "kvpilot:router_held_requests"
READY_ENDPOINTS = "kvpilot:router_ready_endpoints"
STREAM_ERRORS = "kvpilot:router_stream_errors_total"
ROUTER_RESOURCES = {"cpu": "500m", "memory": "512Mi"}


def cluster_limit() -> str | None:
    """Why this scenario cannot run on the cluster of E2E_KUBECONFIG (None on the emulator, and on a cluster
    where the pods get network namespaces)."""
    if not os.environ.get(ENV):
        return None
    mode, why = netns.choose()
    if mode == "netns":
        return None
    return ("the router scenario needs the daemons' EndpointSlices, and the API server refuses loopback "
            f"addresses in them; this machine cannot give the pods addresses of their own ({why}). Run it as "
            "root with `ip` (iproute2), or on the kmock emulator.")


@dataclass
class Config:
    workdir: Path
    namespace: str = "kvpilot-e2e-router"
    name: str = "smollm2-routed"
    scale_to_zero_after: int = 4  # short, so the idle periods cost little
    burst: int = 3  # requests sent at zero; the first is streamed
    kill: bool = True  # phase 4
    stream_tokens: int = 64  # the stream that is cut: long enough to be mid-way at the kill
    kill_after_chunks: int = 2
    table_every: float | None = None  # print the live table every N seconds (the demo)
    pod_ready_timeout: float = 240.0


@dataclass
class Report(Phases):
    config: Config
    t0: float = 0.0  # kubectl apply
    marks: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    done: list[str] = field(default_factory=list)
    router_deployment: dict[str, Any] | None = None
    daemons_service: dict[str, Any] | None = None
    daemons_slices: list[dict[str, Any]] = field(default_factory=list)  # with the first daemon ready
    router_pods: list[str] = field(default_factory=list)
    first_daemon: str | None = None
    first: StreamRecord | None = None  # the first request sent at zero
    kill_stream: StreamRecord | None = None
    killed_pod: str | None = None
    router_gauges: dict[str, dict[str, float]] = field(default_factory=dict)  # after the kill
    gauges_at_send: dict[str, dict[str, float]] = field(default_factory=dict)  # just before the first request
    gauges_at_zero: dict[str, dict[str, float]] = field(default_factory=dict)  # back at zero
    last_pod: str | None = None  # the pod removed on the way back to zero
    final_cr: dict[str, Any] | None = None
    monitor: Monitor | None = None
    agent: NodeAgent | None = None
    load: LoadGenerator | None = None
    routers: RouterView | None = None
    leftover_pids: list[int] = field(default_factory=list)
    pod_network: str | None = None  # netns or loopback (netns.py)
    wall_s: float = 0.0

    def records(self, phase: str | None = None) -> list[Record]:
        assert self.load is not None
        return [r for r in self.load.records if phase is None or r.phase == phase]

    def dump(self, path: Path) -> None:
        """The run as JSON, for reading after a failure."""
        t0 = self.t0
        streams = [dict(asdict(s), start=round(s.start - t0, 2), end=round(s.end - t0, 2),
                        first_token=None if s.first_token is None else round(s.first_token - t0, 2))
                   for s in (self.load.streams if self.load else [])]
        data = {**timeline_json(t0, self.marks, self.monitor, self.agent), "errors": self.errors,
                "done": self.done, "namespace": self.config.namespace, "router_pods": self.router_pods,
                "killed_pod": self.killed_pod, "pod_network": self.pod_network, "router_gauges": self.router_gauges, "streams": streams,
                "requests": requests_json(t0, self.load.records) if self.load else [], "wall_s": self.wall_s}
        path.write_text(json.dumps(data, indent=1, default=str))


def router_cr(cfg: Config, node: NodeSpec | None = None) -> dict[str, Any]:
    """The e2e's CR (small engine, short windows) with the builtin router in front and scale to zero."""
    cr = e2e_cr(MainConfig(workdir=cfg.workdir, name=cfg.name, max_replicas=1), node)
    spec = cr["spec"]
    spec["autoscaling"].update({"minReplicas": 0, "maxReplicas": 1, "scaleToZeroAfterSeconds": cfg.scale_to_zero_after})
    spec["router"] = {"enabled": True, "mode": "builtin", "replicas": 2, "resources": dict(ROUTER_RESOURCES)}
    if node is not None:  # the routers' own scheduling fields: the daemons' are not copied to them
        spec["router"].update(nodeSelector=node.selector(), tolerations=[node.toleration()])
    errors = crd.validate(cfg.name, crd.default_spec(copy.deepcopy(spec)))
    if errors:
        raise ValueError(f"the router e2e CR is invalid: {errors}")
    return cr


def node_capacity(cfg: Config) -> dict[str, str]:
    """Room for two routers and two daemons at once (one terminating while the next one starts)."""
    spec = router_cr(cfg)["spec"]
    daemon, router = spec["resources"], spec["router"]["resources"]
    cpu = 2 * quantity(daemon["cpu"]) + 2 * quantity(router["cpu"])
    mem = 2 * quantity(daemon["memory"]) + 2 * quantity(router["memory"])
    return {"cpu": f"{cpu:g}", "memory": f"{mem / 2**20:.0f}Mi", GPU: "0"}


def metric_totals(text: str) -> dict[str, float]:
    """A /metrics page -> each sample name's value, summed over its label sets."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + float(s.value)
    return out


class RouterView:
    """The routers as a client in the cluster finds them: the ready addresses in the EndpointSlices of the
    user-facing Service (which selects the router pods), and what each router's /metrics says. The monitor
    calls `held` on every sample, which refreshes both."""

    def __init__(self, kube: Kube, ns: str, service: str, http: aiohttp.ClientSession) -> None:
        self.kube, self.ns, self.service, self.http = kube, ns, service, http
        self._eps: list[Endpoint] = []
        self.gauges: dict[str, dict[str, float]] = {}  # router pod -> metric -> value, as last scraped
        self.errors: list[str] = []

    def endpoints(self) -> list[Endpoint]:
        return list(self._eps)

    async def refresh(self) -> list[Endpoint]:
        self._eps = await service_endpoints(self.kube, self.ns, self.service)
        return self.endpoints()

    async def scrape(self) -> dict[str, dict[str, float]]:
        gauges = {}
        for ep in self._eps:
            try:
                async with self.http.get(f"{ep.url}/metrics", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    gauges[ep.pod] = metric_totals(await r.text())
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
                self.errors.append(f"{ep.pod}: {type(e).__name__}: {e}")
        self.gauges = gauges
        return gauges

    async def held(self) -> float | None:
        """The requests the routers hold now (summed), for the monitor's samples; None with no router."""
        await self.refresh()
        gauges = await self.scrape()
        return sum(g.get(HELD, 0.0) for g in gauges.values()) if gauges else None


class _Scenario:
    """The phases in order; they share the run's clients."""

    def __init__(self, cfg: Config, rep: Report, kube: Kube, operator: Any) -> None:
        self.cfg, self.rep, self.kube, self.operator = cfg, rep, kube, operator
        self.ns, self.name = cfg.namespace, cfg.name
        assert rep.agent and rep.load and rep.monitor and rep.routers
        self.agent, self.load, self.mon, self.routers = rep.agent, rep.load, rep.monitor, rep.routers
        self.clock = time.monotonic

    def mark(self, label: str) -> float:
        self.rep.marks[label] = self.clock()
        return self.rep.marks[label]

    def daemons(self, ready: bool = False) -> list[str]:
        pods_ = self.mon.samples[-1].pods if self.mon.samples else []
        return [p.name for p in pods_ if not ready or (p.ready and not p.terminating)]

    async def replicas(self) -> int | None:
        if self.operator.poll() is not None:
            raise RuntimeError(f"the operator exited with {self.operator.returncode}; see {self.cfg.workdir}")
        dep = await self.kube.deployment(self.ns, self.name)
        return (dep or {}).get("spec", {}).get("replicas")

    # ---- 1: the router in front, found through EndpointSlices; the first daemon loads the model
    async def deploy(self) -> None:
        self.rep.t0 = self.mon.t0 = self.mark("kubectl apply")
        await self.kube.apply_cr(self.ns, router_cr(self.cfg, self.agent.node))
        self.rep.router_deployment = await until(
            lambda: self.kube.get(f"{deployments(self.ns)}/{self.name}-router"), 60, "the operator creates the router")
        self.rep.daemons_service = await until(
            lambda: self.kube.get(f"{services(self.ns)}/{self.name}-daemons"), 30, "the daemons' headless Service")
        routers = await until(lambda: len(self.routers.endpoints()) >= 2 and self.routers.endpoints(),
                              self.cfg.pod_ready_timeout, "two router pods Ready in the Service's EndpointSlices")
        self.rep.router_pods = [e.pod for e in routers]
        self.mark("routers ready")
        first = await until(lambda: self.daemons(ready=True), self.cfg.pod_ready_timeout, "the first daemon Ready")
        self.rep.first_daemon = first[0]
        self.mark("model loaded")

        async def slices() -> Any:
            out = [s for s in await self.kube.list(endpointslices(self.ns))
                   if (s["metadata"].get("labels") or {}).get(SERVICE_NAME_LABEL) == f"{self.name}-daemons"]
            return out if any(e.get("conditions", {}).get("ready") for s in out for e in s.get("endpoints") or []) \
                else None
        self.rep.daemons_slices = await until(slices, 10, "the daemons' EndpointSlice lists the ready pod")

    # ---- 2: idle -> zero replicas, the pod gone, no router sees a daemon
    async def to_zero(self) -> None:
        await until(self._zero, self.cfg.scale_to_zero_after + 60, "the operator scales to 0")
        self.mark("scaled to 0")
        await until(lambda: not self.daemons() and len(self.routers.gauges) == 2
                    and all(g.get(READY_ENDPOINTS, 1) == 0 for g in self.routers.gauges.values()),
                    60, "the daemon pod gone and no router with a ready endpoint")
        self.rep.gauges_at_send = dict(self.routers.gauges)
        self.mark("zero daemons")

    async def _zero(self) -> bool:
        return await self.replicas() == 0

    # ---- 3: requests at zero: held by the router, which wakes the model; they complete
    async def from_zero(self) -> None:
        assert await self.replicas() == 0 and not self.daemons(), "not at zero"
        jobs = workload.heavy_jobs()
        self.mark("first request sent")
        first = asyncio.create_task(self.load.stream(jobs[0], "from-zero"))
        rest = []
        for job in jobs[1:self.cfg.burst]:
            await asyncio.sleep(0.1)
            rest.append(asyncio.create_task(self.load.request(job, "from-zero")))
        self.rep.first = rec = await asyncio.wait_for(first, self.cfg.pod_ready_timeout + 120)
        if rec.first_token is not None:
            self.rep.marks["first token"] = rec.first_token
        await asyncio.wait_for(asyncio.gather(*rest), 120)

    # ---- 4: SIGKILL of the daemon mid-stream: an SSE error event (or a complete stream), never a silent cut
    async def mid_stream_kill(self) -> None:
        # the monitor's latest sample may predate the woken pod's Ready status: the router may stream from it
        # first (seen: Ready written 0.17 s before the first token, no sample after it before this phase ran)
        ready = await until(lambda: self.daemons(ready=True), 10, "the monitor sees the woken daemon Ready")
        assert len(ready) == 1, f"one daemon should serve the stream, not {ready}"
        c = self.agent.containers[ready[0]]
        assert c.proc is not None and c.proc.poll() is None
        going = asyncio.Event()
        job = workload.Job(workload.PROMPTS[1], self.cfg.stream_tokens, "stream-kill")
        task = asyncio.create_task(self.load.stream(
            job, "kill", lambda r: going.set() if r.chunks >= self.cfg.kill_after_chunks else None))
        await asyncio.wait_for(going.wait(), 180)
        self.rep.killed_pod = ready[0]
        self.mark("SIGKILL mid-stream")
        os.kill(c.proc.pid, signal.SIGKILL)
        self.rep.kill_stream = await asyncio.wait_for(task, 120)
        self.mark("stream ended")
        await self.routers.scrape()
        self.rep.router_gauges = dict(self.routers.gauges)

    # ---- 5: no load -> back to zero after the idle period, the last pod drained
    async def back_to_zero(self) -> None:
        await until(lambda: self.load.inflight == 0, 60, "the last requests finish")
        self.mark("load stops")
        bound = self.cfg.pod_ready_timeout + self.cfg.scale_to_zero_after + 60  # a killed pod restarts first
        await until(self._zero, bound, "the operator scales back to 0")
        self.mark("scaled to 0 again")
        gone = await until(lambda: [e for e in self.agent.events if e.what == "removed"
                                    and e.t >= self.rep.marks["load stops"]], 60, "the last daemon pod removed")
        self.rep.last_pod = gone[-1].pod
        self.mark("drained")
        self.rep.gauges_at_zero = dict(await self.routers.scrape())

    async def run(self) -> None:
        await run_phase(self.rep, "deploy", self.deploy)
        await run_phase(self.rep, "to-zero", self.to_zero)
        await run_phase(self.rep, "from-zero", self.from_zero)
        if self.cfg.kill:
            await run_phase(self.rep, "mid-stream-kill", self.mid_stream_kill)
        await run_phase(self.rep, "back-to-zero", self.back_to_zero)
        self.mon.phase = "end"


async def run(cfg: Config) -> Report:
    """The scenario on the emulator or a cluster; teardown always happens. See `cluster_limit`."""
    why = cluster_limit()
    if why is not None:
        raise RuntimeError(why)
    cfg.workdir.mkdir(parents=True, exist_ok=True)
    rep = Report(config=cfg)
    start = time.monotonic()
    try:
        async with open_target(cfg.workdir, cfg.namespace, node_capacity(cfg)) as target, \
                aiohttp.ClientSession() as http:
            cfg.namespace = target.namespace
            await _run_on(cfg, rep, target.kube, target, http)
    finally:
        rep.leftover_pids = procs.kill_all()
        rep.wall_s = time.monotonic() - start
        with contextlib.suppress(Exception):
            rep.dump(cfg.workdir / "report.json")
    return rep


async def _run_on(cfg: Config, rep: Report, kube: Kube, target: Any, http: aiohttp.ClientSession) -> None:
    operator = start_operator(cfg.workdir, target)
    stop_bg = asyncio.Event()
    agent = NodeAgent(kube, cfg.namespace, cfg.workdir, node=target.node, replicasets=not target.real,
                      node_env={"KVPILOT_CACHE_DIR": str(node_model_cache())}, network=target.network)
    rep.pod_network = target.network.mode
    routers = RouterView(kube, cfg.namespace, cfg.name, http)
    load = LoadGenerator(routers.endpoints)
    monitor = Monitor(kube, cfg.namespace, cfg.name, load, table_every=cfg.table_every, held=routers.held)
    rep.agent, rep.load, rep.monitor, rep.routers = agent, load, monitor, routers
    bg = [asyncio.create_task(agent.run(stop_bg)), asyncio.create_task(monitor.run(stop_bg))]
    if cfg.table_every is not None:
        monitor.print_header()
    try:
        await _Scenario(cfg, rep, kube, operator).run()
    finally:
        with contextlib.suppress(Exception):
            rep.final_cr = await kube.cr(cfg.namespace, cfg.name)
        stop_bg.set()
        await asyncio.wait(bg, timeout=30)
        await load.close()
        await asyncio.to_thread(procs.stop, operator, 10)
