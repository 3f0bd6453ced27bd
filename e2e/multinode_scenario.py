"""The multi-node scenario: one replica spanning two nodes (a LeaderWorkerSet group), acted out with real parts.

An InferenceDeployment of a tiny random Llama (8 query heads, 4 KV heads, float32, CPU: tiny_llama.py) with
`parallelism: {tensor: 1, pipeline: 2}` and `resources.gpusPerNode: 1`: the ranks do not fit one node, so
the operator renders a LeaderWorkerSet of size 2 instead of a Deployment. On the emulator the node agent
plays the LWS controller (leaderworkerset.py): the leader and the worker pod, which it runs as two
`kvpilot serve` processes in their own networks; they find each other through LWS_LEADER_ADDRESS and form a
real gloo group over TCP (the leader's rendezvous on <leader IP>:29500). Phases, each recorded into a
`Report`:

1. deploy: the model written and its offline answers computed (one process, one rank: the reference); the CR
   applied; the LWS, its two pods Ready, the leader alone in the Service's EndpointSlices, the CR Ready;
2. parity: greedy completions through the Service (its ready endpoints, as a client in the cluster finds
   them), to compare with the reference;
3. kill-worker: the worker pod's container dies (SIGKILL of its process group, what a kubelet sees as a
   container exit). RecreateGroupOnPodRestart: the whole group goes and comes back (new pods, new
   processes). Requests sent while the Service has no ready endpoint (before any byte of an answer) must
   not be lost: the e2e client (load.py) waits for an endpoint and retries a 503 or a refused connection
   before the first byte, as a gateway with retries does; no daemon holds them (a router would, see
   router_scenario.py). They complete on the new group with the reference's answers, as does one sent at
   the kill (the old leader, its peer gone, answers it 503) and a stream (never retried: it waits for an
   endpoint, then starts on the new group);
4. tensor-one-node (optional): a second CR with `parallelism: {tensor: 2}` and `gpusPerNode: 2`: the ranks
   fit one node, so a plain Deployment whose one pod runs both ranks; its answers equal the reference's.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvpilot.operator import crd

from . import procs, tiny_llama, workload
from .agent import NodeAgent
from .cluster import (
    Kube,
    condition,
    deployments,
    leaderworkersets,
    pods,
    services,
)
from .endpointslices import service_endpoints
from .leaderworkerset import NAME_LABEL, WORKER_INDEX_LABEL
from .lifecycle import Config as MainConfig
from .lifecycle import (
    Phases,
    child_env,
    e2e_cr,
    node_model_cache,
    requests_json,
    run_on_target,
    run_phase,
    start_operator,
    timeline_json,
    until,
)
from .load import Endpoint, LoadGenerator, Record, StreamRecord
from .monitor import Monitor
from .node import GPU, NodeSpec, quantity
from .target import ENV

HERE = Path(__file__).resolve().parent


@dataclass
class Config:
    workdir: Path
    namespace: str = "kvpilot-e2e-multinode"
    name: str = "llama-pp2"  # names the LeaderWorkerSet: a DNS-1035 label
    tp_name: str = "llama-tp2"
    tensor_one_node: bool = True  # phase 4
    parity_requests: int = 4  # of workload.PROMPTS, through the Service
    while_down: int = 3  # requests sent while the group is down
    pod_ready_timeout: float = 180.0
    recover_timeout: float = 120.0  # the group comes back in ~12 s here


@dataclass
class Report(Phases):
    config: Config
    t0: float = 0.0
    marks: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    done: list[str] = field(default_factory=list)
    expected: dict[str, Any] | None = None  # job key -> the offline answer
    lws: dict[str, Any] | None = None  # as the operator applied it, once the group is Ready
    lws_status: dict[str, Any] | None = None  # the controller's status with the group Ready
    scale: dict[str, Any] | None = None  # GET leaderworkersets/NAME/scale with the group Ready
    deployment: dict[str, Any] | None = None  # a Deployment of the multi-node CR (there must be none)
    service: dict[str, Any] | None = None
    group_pods: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> the pod, Ready
    service_endpoints: list[str] = field(default_factory=list)  # pod names, with the group Ready
    cr_ready: dict[str, Any] | None = None
    killed_pod: str | None = None
    killed_pids: dict[str, int] = field(default_factory=dict)  # pod -> daemon pid, before the kill
    killed_uids: dict[str, str] = field(default_factory=dict)  # pod -> uid, before the kill
    recreated: list[tuple[str, int, str]] = field(default_factory=list)  # the LWS controller's group restarts
    new_pids: dict[str, int] = field(default_factory=dict)
    new_uids: dict[str, str] = field(default_factory=dict)
    old_alive: list[int] = field(default_factory=list)  # old daemon pids still running after the recreate
    lws_status_after: dict[str, Any] | None = None
    cr_after: dict[str, Any] | None = None  # the CR once Ready again after the recreate
    scale_after: dict[str, Any] | None = None
    tp_deployment: dict[str, Any] | None = None
    tp_lws: dict[str, Any] | None = None
    tp_pod: str | None = None
    monitor: Monitor | None = None
    agent: NodeAgent | None = None
    load: LoadGenerator | None = None
    tp_load: LoadGenerator | None = None
    leftover_pids: list[int] = field(default_factory=list)
    pod_network: str | None = None
    wall_s: float = 0.0

    def records(self, phase: str | None = None) -> list[Record]:
        assert self.load is not None
        extra = self.tp_load.records if self.tp_load else []
        return [r for r in [*self.load.records, *extra] if phase is None or r.phase == phase]

    def streams(self, phase: str) -> list[StreamRecord]:
        assert self.load is not None
        return [x for x in self.load.streams if x.phase == phase]

    def dump(self, path: Path) -> None:
        data = {**timeline_json(self.t0, self.marks, self.monitor, self.agent), "errors": self.errors,
                "done": self.done, "namespace": self.config.namespace, "pod_network": self.pod_network,
                "killed_pod": self.killed_pod, "killed_pids": self.killed_pids, "new_pids": self.new_pids,
                "recreated": self.recreated, "lws_status": self.lws_status, "lws_status_after": self.lws_status_after,
                "requests": requests_json(self.t0, self.records()) if self.load else [],
                "streams": [dict(asdict(x), start=round(x.start - self.t0, 2), end=round(x.end - self.t0, 2),
                                 first_token=round(x.first_token - self.t0, 2) if x.first_token else None)
                            for x in (self.load.streams if self.load else [])], "wall_s": self.wall_s}
        path.write_text(json.dumps(data, indent=1, default=str))


def jobs() -> list[workload.Job]:
    return [workload.Job(p, tiny_llama.MAX_TOKENS, f"mn-{i}") for i, p in enumerate(workload.PROMPTS)]


def multinode_cr(cfg: Config, model: Path, node: NodeSpec | None = None, tensor: int = 1,
                 pipeline: int = 2, gpus_per_node: int = 1, name: str | None = None) -> dict[str, Any]:
    """The e2e's CR for the tiny Llama on CPU with `tensor` x `pipeline` ranks, `gpus_per_node` of them a node
    (the GPUs are only a count on CPU: resources.gpus 0 requests none); one replica, no autoscaling."""
    name = name or cfg.name
    cr = e2e_cr(MainConfig(workdir=cfg.workdir, name=name), node)
    spec = cr["spec"]
    spec["model"] = {"uri": f"file://{model}"}
    spec["parallelism"] = {"tensor": tensor, "pipeline": pipeline}
    spec["resources"] = {"gpus": 0, "gpusPerNode": gpus_per_node, "cpu": "1", "memory": "1Gi"}
    spec["engine"].update({
        "blockSize": tiny_llama.BLOCK_SIZE, "maxModelLen": tiny_llama.MAX_MODEL_LEN, "dtype": tiny_llama.DTYPE,
        "extraArgs": ["--num-kv-blocks", str(tiny_llama.NUM_KV_BLOCKS), "--device", "cpu"],
    })
    spec["autoscaling"]["enabled"] = False
    spec["replicas"] = 1
    spec["terminationGracePeriodSeconds"] = 20  # the least the CRD takes: a recreated group goes quickly
    errors = crd.validate(name, crd.default_spec(copy.deepcopy(spec)))
    if errors:
        raise ValueError(f"the multi-node e2e CR is invalid: {errors}")
    return cr


def node_capacity(cfg: Config) -> dict[str, str]:
    """The group's two pods, the one-node replica's pod, and one more (a pod not yet gone)."""
    res = multinode_cr(cfg, Path("/model"))["spec"]["resources"]
    return {"cpu": f"{quantity(res['cpu']) * 4:g}", "memory": f"{quantity(res['memory']) * 4 / 2**20:.0f}Mi",
            GPU: "0"}


class ServiceView:
    """One Service's endpoints, refreshed in the background (what the load generator picks from)."""

    def __init__(self, kube: Kube, ns: str, service: str) -> None:
        self.kube, self.ns, self.service = kube, ns, service
        self.eps: list[Endpoint] = []
        self.errors: list[str] = []

    def endpoints(self) -> list[Endpoint]:
        return list(self.eps)

    async def run(self, stop: asyncio.Event, period: float = 0.25) -> None:
        while not stop.is_set():
            try:
                self.eps = await service_endpoints(self.kube, self.ns, self.service)
            except Exception as e:  # noqa: BLE001 - a missed refresh keeps the last view
                self.errors.append(f"{type(e).__name__}: {e}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), period)


async def write_model(cfg: Config) -> tuple[Path, dict[str, Any]]:
    folder, out = cfg.workdir / "model", cfg.workdir / "reference.json"
    log = cfg.workdir / "tiny_llama.log"
    proc = procs.spawn([sys.executable, str(HERE / "tiny_llama.py"), str(folder), str(out)], child_env(), log)
    try:
        await until(lambda: proc.poll() is not None, 300, "the tiny Llama written and its reference", interval=0.25)
    finally:
        procs.stop(proc, 1)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"tiny_llama.py failed ({proc.returncode}): {log.read_text()[-2000:]}")
    return folder, json.loads(out.read_text())


class _Scenario:
    def __init__(self, cfg: Config, rep: Report, kube: Kube, operator: Any, view: ServiceView,
                 tp_view: ServiceView) -> None:
        self.cfg, self.rep, self.kube, self.operator = cfg, rep, kube, operator
        self.view, self.tp_view = view, tp_view
        self.ns, self.name = cfg.namespace, cfg.name
        assert rep.agent and rep.load and rep.monitor and rep.tp_load
        self.agent, self.load, self.tp_load = rep.agent, rep.load, rep.tp_load
        self.clock = time.monotonic
        self.lws_path = f"{leaderworkersets(self.ns)}/{self.name}"
        self.model: Path | None = None

    def mark(self, label: str) -> float:
        self.rep.marks[label] = self.clock()
        return self.rep.marks[label]

    def alive(self) -> None:
        if self.operator.poll() is not None:
            raise RuntimeError(f"the operator exited with {self.operator.returncode}; see {self.cfg.workdir}")

    async def group(self) -> dict[str, dict[str, Any]]:
        """The LWS's pods (not terminating), by name."""
        return {p["metadata"]["name"]: p for p in await self.kube.list(pods(self.ns))
                if (p["metadata"].get("labels") or {}).get(NAME_LABEL) == self.name
                and not p["metadata"].get("deletionTimestamp")}

    async def group_ready(self) -> dict[str, dict[str, Any]] | None:
        """Both pods Ready and the leader alone in the Service's endpoints; None until then."""
        self.alive()
        group = await self.group()
        ready = [p for p in group.values() if (condition(p, "Ready") or {}).get("status") == "True"]
        leaders = [n for n, p in group.items() if p["metadata"]["labels"].get(WORKER_INDEX_LABEL) == "0"]
        eps = [e.pod for e in self.view.endpoints()]
        return group if len(group) == len(ready) == 2 and eps == leaders else None

    # ---- 1: the model and its reference; the CR applied; the group Ready behind the Service
    async def deploy(self) -> None:
        self.model, self.rep.expected = await write_model(self.cfg)
        self.rep.t0 = self.mark("kubectl apply")
        await self.kube.apply_cr(self.ns, multinode_cr(self.cfg, self.model, self.agent.node))
        if self.cfg.tensor_one_node:  # loads while the group does
            await self.kube.apply_cr(self.ns, multinode_cr(self.cfg, self.model, self.agent.node, tensor=2,
                                                           pipeline=1, gpus_per_node=2, name=self.cfg.tp_name))
        await until(lambda: self.kube.get(self.lws_path), 60, "the operator creates the LeaderWorkerSet")
        group = await until(self.group_ready, self.cfg.pod_ready_timeout,
                            "the group's two pods Ready, the leader in the Service's endpoints")
        self.mark("group ready")
        self.rep.group_pods = group
        self.rep.service_endpoints = [e.pod for e in self.view.endpoints()]
        self.rep.lws = await self.kube.get(self.lws_path)
        self.rep.deployment = await self.kube.get(f"{deployments(self.ns)}/{self.name}")
        self.rep.service = await self.kube.get(f"{services(self.ns)}/{self.name}")

        async def settled() -> Any:
            lws = await self.kube.get(self.lws_path)
            cr = await self.kube.cr(self.ns, self.name)
            st = (lws or {}).get("status") or {}
            ok = (st.get("readyReplicas") == 1 and (condition(cr, "Ready") or {}).get("status") == "True")
            return (lws, cr) if ok else None
        lws, self.rep.cr_ready = await until(settled, 30, "the LWS status and the CR Ready")
        self.rep.lws_status = lws["status"]
        self.rep.scale = await self.kube.get(f"{self.lws_path}/scale")

    # ---- 2: greedy answers through the Service
    async def parity(self) -> None:
        js = jobs()[: self.cfg.parity_requests]
        await asyncio.gather(*(self.load.request(j, "parity") for j in js))

    # ---- 3: the worker's container dies: the group is recreated; requests sent meanwhile complete
    async def kill_worker(self) -> None:
        group = await self.group()
        worker = next(n for n, p in group.items() if p["metadata"]["labels"].get(WORKER_INDEX_LABEL) == "1")
        self.rep.killed_pod = worker
        for n, p in group.items():
            c = self.agent.containers[n]
            assert c.proc is not None and c.proc.poll() is None, f"{n} is not running"
            self.rep.killed_pids[n], self.rep.killed_uids[n] = c.proc.pid, p["metadata"]["uid"]
        self.mark("worker killed")
        procs.signal_group(self.agent.containers[worker].proc, signal.SIGKILL)  # type: ignore[arg-type]
        # At once, while the leader is still behind the Service: its pipeline peer is gone.
        down = [asyncio.create_task(self.load.request(jobs()[-1], "at-kill"))]
        await until(lambda: not self.view.endpoints(), 30, "the Service has no ready endpoint")
        self.mark("group down")
        rest = jobs()[self.cfg.parity_requests: self.cfg.parity_requests + self.cfg.while_down]
        down += [asyncio.create_task(self.load.request(j, "while-down")) for j in rest[1:]]
        # A stream is never retried by the client: sent before the group is back, it must not start early.
        down.append(asyncio.create_task(self.load.stream(rest[0], "while-down")))

        async def new_group() -> Any:
            group = await self.group_ready()
            if group and all(p["metadata"]["uid"] != self.rep.killed_uids.get(n) for n, p in group.items()):
                return group
            return None
        group = await until(new_group, self.cfg.recover_timeout, "a new group Ready (new pods for both)")
        self.mark("group back")
        self.rep.new_uids = {n: p["metadata"]["uid"] for n, p in group.items()}
        self.rep.new_pids = {n: self.agent.containers[n].proc.pid for n in group}  # type: ignore[union-attr]
        await asyncio.wait_for(asyncio.gather(*down), 120)
        self.mark("while-down answered")
        self.rep.old_alive = [pid for pid in self.rep.killed_pids.values() if _running(pid)]
        assert self.agent.leaderworkersets is not None
        self.rep.recreated = list(self.agent.leaderworkersets.recreated)

        async def status_back() -> Any:
            lws = await self.kube.get(self.lws_path)
            return lws if ((lws or {}).get("status") or {}).get("readyReplicas") == 1 else None
        self.rep.lws_status_after = (await until(status_back, 30, "the LWS status Ready again"))["status"]
        self.rep.scale_after = await self.kube.get(f"{self.lws_path}/scale")

        async def cr_back() -> Any:
            cr = await self.kube.cr(self.ns, self.name)
            st = (cr or {}).get("status") or {}
            return cr if st.get("readyReplicas") == 1 and (condition(cr, "Ready") or {}).get("status") == "True" \
                else None
        self.rep.cr_after = await until(cr_back, 30, "the CR Ready again, from the LWS status")
        await self.load.request(jobs()[0], "after")

    # ---- 4: tensor 2 on one node: a Deployment, one pod with both ranks
    async def tensor_one_node(self) -> None:
        dep_path = f"{deployments(self.ns)}/{self.cfg.tp_name}"
        self.rep.tp_deployment = await until(lambda: self.kube.get(dep_path), 60, "the one-node Deployment")
        self.rep.tp_lws = await self.kube.get(f"{leaderworkersets(self.ns)}/{self.cfg.tp_name}")
        eps = await until(self.tp_view.endpoints, self.cfg.pod_ready_timeout, "the tensor-2 pod Ready")
        self.rep.tp_pod = eps[0].pod
        js = jobs()[: self.cfg.parity_requests]
        await asyncio.gather(*(self.tp_load.request(j, "tensor-one-node") for j in js))

    async def run(self) -> None:
        await run_phase(self.rep, "deploy", self.deploy)
        await run_phase(self.rep, "parity", self.parity)
        await run_phase(self.rep, "kill-worker", self.kill_worker)
        if self.cfg.tensor_one_node:
            await run_phase(self.rep, "tensor-one-node", self.tensor_one_node)
        if self.rep.monitor is not None:
            self.rep.monitor.phase = "end"


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def cluster_limit() -> str | None:
    """Why this scenario cannot run on the cluster of E2E_KUBECONFIG (None on the emulator)."""
    if not os.environ.get(ENV):
        return None
    return ("on a cluster the LeaderWorkerSet controller gives the pods LWS_LEADER_ADDRESS as the leader's DNS "
            "name through the LWS's headless Service (<lws>-<g>.<lws>.<namespace>), which the node agent's pods "
            "on this machine cannot resolve (there is no cluster DNS here); run it on the kmock emulator")


async def run(cfg: Config) -> Report:
    """The scenario on the emulator; teardown always happens. See `cluster_limit`."""
    why = cluster_limit()
    if why is not None:
        raise RuntimeError(why)
    return await run_on_target(cfg, Report(config=cfg), node_capacity(cfg), _run_on)


async def _run_on(cfg: Config, rep: Report, kube: Kube, target: Any) -> None:
    operator = start_operator(cfg.workdir, target)
    stop_bg = asyncio.Event()
    agent = NodeAgent(kube, cfg.namespace, cfg.workdir, node=target.node, replicasets=not target.real,
                      node_env={"KVPILOT_CACHE_DIR": str(node_model_cache())}, network=target.network)
    rep.pod_network = target.network.mode
    view, tp_view = ServiceView(kube, cfg.namespace, cfg.name), ServiceView(kube, cfg.namespace, cfg.tp_name)
    load = LoadGenerator(view.endpoints, model=cfg.name)
    tp_load = LoadGenerator(tp_view.endpoints, model=cfg.tp_name)
    monitor = Monitor(kube, cfg.namespace, cfg.name, load)
    rep.agent, rep.load, rep.tp_load, rep.monitor = agent, load, tp_load, monitor
    bg = [asyncio.create_task(agent.run(stop_bg)), asyncio.create_task(monitor.run(stop_bg)),
          asyncio.create_task(view.run(stop_bg)), asyncio.create_task(tp_view.run(stop_bg))]
    try:
        await _Scenario(cfg, rep, kube, operator, view, tp_view).run()
    finally:
        stop_bg.set()
        await asyncio.wait(bg, timeout=30)
        await load.close()
        await tp_load.close()
        await asyncio.to_thread(procs.stop, operator, 10)
