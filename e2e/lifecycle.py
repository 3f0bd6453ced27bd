"""One end-to-end run: emulator, operator, node agent, load, in the order of the user story.

`run(config)` acts out the scenarios and records everything (timeline samples, Events, the agent's pod
events, every request) into a `Report`; the tests assert on the report, the demo prints and plots it.
A phase that times out is recorded and ends the run (later phases need it); teardown always happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvpilot.operator import crd

from . import procs, workload
from .agent import NodeAgent
from .cluster import Kube, condition, example_cr, inferencedeployments
from .load import LoadGenerator, Record
from .monitor import Monitor
from .node import GPU, NodeSpec, quantity
from .target import Target, open_target

log = logging.getLogger("e2e")
HERE = Path(__file__).resolve().parent


@dataclass
class Config:
    workdir: Path
    namespace: str = "kvpilot-e2e"
    name: str = "smollm2"
    kill: bool = True  # scenario 5: SIGKILL one daemon mid-load
    rollout: bool = True  # scenario 6: a spec change rolls the pod over, under load
    rollout_max_queued: int = 6  # the spec change: engine.maxQueuedRequests 8 -> 6
    heavy_clients: int = 10  # on one pod: 4 running + 6 waiting, KV 75%
    trickle_clients: int = 2  # one kept-alive client per pod: light enough for one pod, and the pod
    # that is removed always has a request in flight
    max_replicas: int = 2  # two cores: at most two daemons decode at once
    stable_window: int = 8
    panic_window: int = 4
    scale_down_delay: int = 10
    metrics_interval: int = 1
    grace_period: int = 40  # --shutdown-timeout = 40 - 5 (preStop) - 15 (margin) = 20 s
    hold_heavy: float = 0.0  # extra seconds of load at full scale before it stops (the demo shows it)
    new_pod_requests: int = 2  # answers a new (or restarted) pod must give to count as "taking traffic"
    table_every: float | None = None  # print the live table every N seconds (the demo)
    pod_ready_timeout: float = 300.0
    scale_up_timeout: float = 120.0


class Phases:
    """Phase bookkeeping of a run's report (its `errors`, `done`, `config.workdir` and `monitor`), shared by
    the runs."""

    errors: dict[str, str]
    done: list[str]
    config: Any
    monitor: Monitor | None

    def ok(self, phase: str) -> bool:
        return phase in self.done

    def need(self, *phases: str) -> None:
        """Fail with the recorded reason when a phase this check depends on did not complete."""
        for p in phases:
            if p not in self.done:
                why = self.errors.get(p, "it did not run: an earlier phase failed " + repr(self.errors))
                raise AssertionError(f"phase {p!r} did not complete: {why}\nlogs: {self.config.workdir}")


@dataclass
class Report(Phases):
    config: Config
    t0: float = 0.0  # kubectl apply
    marks: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    done: list[str] = field(default_factory=list)
    cr_after_ready: dict[str, Any] | None = None
    deployment_after_apply: dict[str, Any] | None = None
    final_cr: dict[str, Any] | None = None
    first_pod: str | None = None
    new_pod: str | None = None
    killed_pod: str | None = None
    killed_pid: int | None = None
    replicas_at_kill: int | None = None
    removed_pod: str | None = None
    rollout_old_pod: str | None = None
    rollout_new_pod: str | None = None
    deployment_after_rollout: dict[str, Any] | None = None
    cr_after_rollout: dict[str, Any] | None = None
    real_cluster: bool = False
    node: str | None = None
    pod_network: str | None = None  # netns or loopback (netns.py)
    expected: dict[str, Any] | None = None
    reference_error: str | None = None
    monitor: Monitor | None = None
    agent: NodeAgent | None = None
    load: LoadGenerator | None = None
    leftover_pids: list[int] = field(default_factory=list)
    wall_s: float = 0.0

    def records(self, phase: str | None = None) -> list[Record]:
        assert self.load is not None
        return [r for r in self.load.records if phase is None or r.phase == phase]

    def daemon_log_records(self, pod: str) -> list[dict[str, Any]]:
        return pod_log_records(self.config.workdir, pod)

    def dump(self, path: Path) -> None:
        """The run as JSON, for reading after a failure."""
        m, a, ld = self.monitor, self.agent, self.load
        data = {
            **timeline_json(self.t0, self.marks, m, a), "errors": self.errors, "done": self.done,
            "pods": {"first": self.first_pod, "new": self.new_pod, "killed": self.killed_pod,
                     "removed": self.removed_pod, "rollout_old": self.rollout_old_pod,
                     "rollout_new": self.rollout_new_pod},
            "real_cluster": self.real_cluster, "node": self.node, "pod_network": self.pod_network, "namespace": self.config.namespace,
            "load": ld.summary(self.expected) if ld else None,
            "requests": requests_json(self.t0, ld.records) if ld else [],
            "wall_s": self.wall_s,
        }
        path.write_text(json.dumps(data, indent=1, default=str))


def pod_log_records(workdir: Path, pod: str) -> list[dict[str, Any]]:
    """The JSON lines of a pod's log (the daemon's and the router's structured logging)."""
    path = workdir / "pods" / pod / "daemon.log"
    out = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def timeline_json(t0: float, marks: dict[str, float], m: Monitor | None, a: NodeAgent | None) -> dict[str, Any]:
    """A run's timeline for report.json, times relative to t0: marks, samples, Events, the agent's events."""
    return {
        "t0": t0, "marks": {k: round(v - t0, 2) for k, v in marks.items()},
        "agent_events": [dict(asdict(e), t=round(e.t - t0, 2)) for e in a.events] if a else [],
        "agent_errors": a.errors if a else [],
        "events": [dict(asdict(e), t=round(e.t - t0, 2)) for e in m.events.values()] if m else [],
        "samples": [dict(asdict(s), t=round(s.t - t0, 2)) for s in m.samples] if m else [],
    }


def requests_json(t0: float, records: list[Record]) -> list[dict[str, Any]]:
    return [{"id": r.id, "job": r.job.key, "phase": r.phase, "start": round(r.start - t0, 2),
             "end": round(r.end - t0, 2), "lost": r.lost, "finish": r.finish_reason,
             "attempts": [(x.pod, x.outcome, round(x.start - t0, 2), round(x.end - t0, 2)) for x in r.attempts]}
            for r in records]


def e2e_cr(cfg: Config, node: NodeSpec | None = None) -> dict[str, Any]:
    """The example CR with what fits two shared CPU cores: small batches and KV cache, short windows; its
    pods carry the nodeSelector and toleration of the agent's node."""
    cr = example_cr()
    cr["metadata"]["name"] = cfg.name
    spec = cr["spec"]
    spec["resources"] = {"gpus": 0, "cpu": "1", "memory": "2Gi"}
    spec["engine"].update({
        "blockSize": workload.BLOCK_SIZE, "maxNumSeqs": workload.MAX_NUM_SEQS, "maxNumBatchedTokens": 512,
        "maxModelLen": workload.MAX_MODEL_LEN, "dtype": workload.DTYPE, "maxQueuedRequests": 8,
        "extraArgs": ["--num-kv-blocks", str(workload.NUM_KV_BLOCKS)],
    })
    spec["autoscaling"].update({
        "minReplicas": 1, "maxReplicas": cfg.max_replicas, "stableWindowSeconds": cfg.stable_window,
        "panicWindowSeconds": cfg.panic_window, "scaleDownDelaySeconds": cfg.scale_down_delay,
        "metricsIntervalSeconds": cfg.metrics_interval,
    })
    spec["terminationGracePeriodSeconds"] = cfg.grace_period
    spec["startupTimeoutSeconds"] = 300
    spec.pop("tolerations", None)
    spec.pop("nodeSelector", None)
    if node is not None:
        spec["nodeSelector"] = node.selector()
        spec["tolerations"] = [node.toleration()]
    # What the API server would refuse (schema, CEL rules) must not get this far.
    errors = crd.validate(cfg.name, crd.default_spec(copy.deepcopy(spec)))
    if errors:
        raise ValueError(f"the e2e CR is invalid: {errors}")
    return cr


async def until(check: Callable[[], Awaitable[Any] | Any], timeout: float, what: str, interval: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = check()
        if asyncio.iscoroutine(last):
            last = await last
        if last:
            return last
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f}s (last: {last!r})")
        await asyncio.sleep(interval)


def node_model_cache() -> Path:
    """The node's cache of converted models, shared by its pods like a hostPath volume would be. Without it
    every new pod converts the GGUF again into its own emptyDir (a minute of CPU here). Same lookup as the
    daemon's loader, done here so the test process does not import torch."""
    if os.environ.get("KVPILOT_CACHE_DIR"):
        return Path(os.environ["KVPILOT_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvpilot"


async def finish_load(tasks: list[asyncio.Task], timeout: float) -> None:
    """Let the load generators' in-flight requests finish, for at most ``timeout`` s; a stuck one is cancelled."""
    running = [t for t in tasks if not t.done()]
    if running:
        _, pending = await asyncio.wait(running, timeout=timeout)
        for t in pending:
            t.cancel()


def child_env() -> dict[str, str]:
    """The environment of the run's own children (operator, reference): none of this shell's KUBE* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBE")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", KVPILOT_NUM_THREADS="1")
    return env


async def _reference(cfg: Config) -> tuple[dict[str, Any] | None, str | None]:
    out = cfg.workdir / "reference.json"
    proc = procs.spawn([sys.executable, str(HERE / "reference.py"), str(out)], child_env(), cfg.workdir / "reference.log")
    try:
        await until(lambda: proc.poll() is not None, 900, "offline reference", interval=0.5)
    finally:
        procs.stop(proc, 1)
    if proc.returncode != 0 or not out.exists():
        return None, f"exit {proc.returncode}: {(cfg.workdir / 'reference.log').read_text()[-2000:]}"
    return json.loads(out.read_text()), None


def node_capacity(cfg: Config) -> dict[str, str]:
    """The loopback node declares room for the most pods the run has at once (maxReplicas + the rollout's
    surge) at the CR's requests; it is a declaration for the scheduler, not the machine's size."""
    res = e2e_cr(cfg)["spec"]["resources"]
    n = cfg.max_replicas + 1
    return {"cpu": f"{quantity(res['cpu']) * n:g}", "memory": f"{quantity(res['memory']) * n / 2**20:.0f}Mi",
            GPU: str(int(res.get("gpus", 0)) * n)}


def start_operator(workdir: Path, target: Target, extra_args: list[str] | None = None) -> Any:
    env = child_env()
    env.update(KUBECONFIG=str(target.kubeconfig), HOSTNAME="kvpilot-operator-e2e")
    # On a shared cluster it watches only the run's namespace.
    scope = ["-n", target.namespace] if target.real else ["-A"]
    argv = [sys.executable, "-m", "kvpilot.operator", *scope, "--standalone", "--metrics-port", "0",
            "--scrape-timeout", "1", *(extra_args or [])]
    return procs.spawn(argv, env, workdir / "operator.log")


async def run(cfg: Config) -> Report:
    cfg.workdir.mkdir(parents=True, exist_ok=True)
    rep = Report(config=cfg)
    start = time.monotonic()
    ref_task = asyncio.create_task(_reference(cfg))  # runs while the first pod loads its model
    stop_bg = asyncio.Event()
    heavy_stop, trickle_stop = asyncio.Event(), asyncio.Event()
    tasks: list[asyncio.Task] = []
    operator = None
    try:
        async with open_target(cfg.workdir, cfg.namespace, node_capacity(cfg)) as target:
            kube = target.kube
            cfg.namespace = target.namespace  # a cluster run has a namespace of its own
            rep.real_cluster, rep.node, rep.pod_network = target.real, target.node.name, target.network.mode
            operator = start_operator(cfg.workdir, target)
            # On a cluster the controller-manager runs the ReplicaSets; on the emulator the agent does.
            agent = NodeAgent(kube, cfg.namespace, cfg.workdir, node=target.node, replicasets=not target.real,
                              node_env={"KVPILOT_CACHE_DIR": str(node_model_cache())}, network=target.network)
            load = LoadGenerator(lambda: monitor.endpoints())
            monitor = Monitor(kube, cfg.namespace, cfg.name, load, table_every=cfg.table_every)
            rep.agent, rep.load, rep.monitor = agent, load, monitor
            tasks += [asyncio.create_task(agent.run(stop_bg)), asyncio.create_task(monitor.run(stop_bg))]
            if cfg.table_every is not None:
                monitor.print_header()
            try:
                await _scenarios(cfg, rep, kube, operator, heavy_stop, trickle_stop, tasks)
            finally:
                heavy_stop.set()
                trickle_stop.set()
                await finish_load(tasks[2:], timeout=60)
                with contextlib.suppress(Exception):
                    rep.final_cr = await kube.cr(cfg.namespace, cfg.name)
                stop_bg.set()
                await asyncio.wait(tasks[:2], timeout=30)
                await load.close()
                if operator is not None:
                    await asyncio.to_thread(procs.stop, operator, 10)
    finally:
        if not ref_task.done():
            if rep.load is not None and rep.load.records:  # answers to check: wait for the reference
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(ref_task), 600)
            if not ref_task.done():
                ref_task.cancel()
                with contextlib.suppress(BaseException):
                    await ref_task
        try:
            rep.expected, rep.reference_error = ref_task.result() if ref_task.done() else (None, "not finished")
        except Exception as e:  # noqa: BLE001
            rep.reference_error = f"{type(e).__name__}: {e}"
        rep.leftover_pids = procs.kill_all()
        rep.wall_s = time.monotonic() - start
        with contextlib.suppress(Exception):
            rep.dump(cfg.workdir / "report.json")
    return rep


async def run_on_target(cfg: Any, rep: Any, capacity: dict[str, str],
                        body: Callable[[Any, Any, Kube, Target], Awaitable[None]]) -> Any:
    """A scenario's ``body(cfg, rep, kube, target)`` on its target (the emulator, or a cluster), with the
    teardown every scenario needs whatever happens: the processes it started killed, its wall time and its
    report written. Returns ``rep``."""
    cfg.workdir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    try:
        async with open_target(cfg.workdir, cfg.namespace, capacity) as target:
            cfg.namespace = target.namespace
            await body(cfg, rep, target.kube, target)
    finally:
        rep.leftover_pids = procs.kill_all()
        rep.wall_s = time.monotonic() - start
        with contextlib.suppress(Exception):
            rep.dump(cfg.workdir / "report.json")
    return rep


async def run_phase(rep: Phases, name: str, body: Callable[[], Awaitable[None]]) -> bool:
    """Run one phase into the report: its error, or its name in `done`. Nothing runs after a failed one."""
    if rep.errors:  # an earlier phase failed: this one cannot run
        return False
    if rep.monitor is not None:
        rep.monitor.phase = name
    try:
        await body()
    except Exception as e:  # noqa: BLE001 - recorded for the tests, which fail with it
        rep.errors[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"
        log.error("phase %s failed: %s", name, e)
        return False
    rep.done.append(name)
    return True


class _Scenarios:
    """The e2e's scenarios in order, each a phase of the report; they share the run's clients and load."""

    def __init__(self, cfg: Config, rep: Report, kube: Kube, operator: Any, heavy_stop: asyncio.Event,
                 trickle_stop: asyncio.Event, tasks: list[asyncio.Task]) -> None:
        self.cfg, self.rep, self.kube, self.operator = cfg, rep, kube, operator
        self.heavy_stop, self.trickle_stop, self.tasks = heavy_stop, trickle_stop, tasks
        self.ns, self.name = cfg.namespace, cfg.name
        assert rep.agent is not None and rep.load is not None and rep.monitor is not None
        self.agent, self.load, self.mon = rep.agent, rep.load, rep.monitor
        self.clock = time.monotonic
        self.heavy_jobs, self.trickle_jobs = workload.heavy_jobs(), workload.trickle_jobs()

    def mark(self, label: str) -> float:
        self.rep.marks[label] = self.clock()
        return self.rep.marks[label]

    def ready_pods(self) -> list[str]:
        return [p.name for p in (self.mon.samples[-1].pods if self.mon.samples else []) if p.ready and not p.terminating]

    def ok_on(self, pod: str, since: float) -> int:
        return sum(1 for r in self.load.records for a in r.attempts if a.pod == pod and a.outcome == "ok"
                   and a.start >= since)

    async def deployment_replicas(self) -> int | None:
        dep = await self.kube.deployment(self.ns, self.name)
        return (dep or {}).get("spec", {}).get("replicas")

    def operator_alive(self) -> None:
        if self.operator.poll() is not None:
            raise RuntimeError(f"the operator exited with {self.operator.returncode}; see {self.cfg.workdir / 'operator.log'}")

    # ---- scenario 1: apply the CR -> one pod ready -> status Ready with url and metrics
    async def apply(self) -> None:
        self.rep.t0 = self.mon.t0 = self.mark("kubectl apply")
        await self.kube.apply_cr(self.ns, e2e_cr(self.cfg, self.agent.node))

        async def deployment() -> Any:
            self.operator_alive()
            return await self.kube.deployment(self.ns, self.name)
        self.rep.deployment_after_apply = await until(deployment, 60, "the operator creates the Deployment")
        who = "kube-controller-manager (is it running?)" if self.rep.real_cluster else "the agent's ReplicaSet role"
        await until(lambda: self.mon.samples and self.mon.samples[-1].pods, 60, f"{who} creates a Pod")
        pods_ = await until(self.ready_pods, self.cfg.pod_ready_timeout, "the first pod becomes Ready")
        self.rep.first_pod = pods_[0]
        self.mark("pod 1 ready")

        async def status_ready() -> Any:
            cr = await self.kube.cr(self.ns, self.name)
            st = (cr or {}).get("status") or {}
            ok = ((condition(cr, "Ready") or {}).get("status") == "True" and st.get("url")
                  and (st.get("metrics") or {}).get("sampledPods", 0) >= 1 and st.get("readyReplicas") == 1)
            return cr if ok else None
        self.rep.cr_after_ready = await until(status_ready, 30, "CR status Ready with url and metrics")
        await self.load.request(self.heavy_jobs[0], "smoke")

    # ---- scenario 2: sustained load -> KV and waiting rise -> >= 2 replicas -> the new pod takes traffic
    async def scale_up(self) -> None:
        t = self.mark("load starts")
        self.tasks.append(asyncio.create_task(
            self.load.clients(self.cfg.heavy_clients, self.heavy_jobs, "heavy", self.heavy_stop, deadline=t + 900)))

        async def scaled() -> bool:
            self.operator_alive()
            return (await self.deployment_replicas() or 0) >= 2
        await until(scaled, self.cfg.scale_up_timeout, "the operator scales to >= 2 replicas")
        self.mark("scaled up")
        pods_ = await until(lambda: len(self.ready_pods()) >= 2 and self.ready_pods(), self.cfg.pod_ready_timeout,
                            "a second pod becomes Ready")
        self.rep.new_pod = next(p for p in pods_ if p != self.rep.first_pod)
        t_ready = self.mark("pod 2 ready")
        await until(lambda: self.ok_on(self.rep.new_pod, t_ready) >= self.cfg.new_pod_requests, 180,
                    f"the new pod answers {self.cfg.new_pod_requests} requests")
        self.mark("pod 2 serving")
        await asyncio.sleep(self.cfg.hold_heavy)

    # ---- scenario 5: SIGKILL one daemon mid-load -> not ready, no scale-down, the agent restarts it
    async def sigkill(self) -> None:
        victim = self.rep.first_pod
        assert victim is not None
        c = self.agent.containers[victim]
        assert c.proc is not None and c.proc.poll() is None, "the daemon to kill is not running"
        self.rep.killed_pod, self.rep.killed_pid = victim, c.proc.pid
        self.rep.replicas_at_kill = await self.deployment_replicas()
        self.mark("SIGKILL")
        os.kill(c.proc.pid, signal.SIGKILL)
        await until(lambda: victim not in self.ready_pods(), 20, "the killed pod turns not-ready")
        self.mark("pod not ready")
        await until(lambda: victim in self.ready_pods() and c.restarts >= 1, self.cfg.pod_ready_timeout,
                    "the agent restarts the pod and it is Ready again")
        t_back = self.mark("pod restarted")
        await until(lambda: self.ok_on(victim, t_back) >= 2, 180, "the restarted pod answers again")
        self.mark("restarted pod serving")

    # ---- scenario 3: load stops -> back to minReplicas after the delay; the removed pod drains
    async def scale_down(self) -> None:
        t = self.clock()
        self.tasks.append(asyncio.create_task(
            self.load.clients(self.cfg.trickle_clients, self.trickle_jobs, "trickle", self.trickle_stop, deadline=t + 900,
                         sticky=True)))
        self.heavy_stop.set()
        self.mark("load stops")
        bound = self.cfg.stable_window + self.cfg.scale_down_delay + 120

        async def scaled_down() -> bool:
            self.operator_alive()
            return await self.deployment_replicas() == 1
        await until(scaled_down, bound, "the operator scales back to 1 replica")
        self.mark("scaled down")
        deleted = await until(lambda: [e for e in self.agent.events if e.what == "terminating" and e.t >= t], 30,
                              "the ReplicaSet controller deletes a pod")
        self.rep.removed_pod = deleted[-1].pod
        c = self.agent.containers[self.rep.removed_pod]
        await until(lambda: c.gone, self.cfg.grace_period + 30, "the removed pod's daemon exits")
        self.mark("pod removed")

        async def settled() -> bool:
            st = ((await self.kube.cr(self.ns, self.name)) or {}).get("status") or {}
            return st.get("replicas") == 1 and st.get("readyReplicas") == 1 and len(self.ready_pods()) == 1
        await until(settled, 30, "the CR status shows 1/1 replicas")
        if not self.cfg.rollout:  # otherwise the light load goes on through the rollout
            self.trickle_stop.set()
            await until(lambda: self.load.inflight == 0, 120, "the last requests finish")

    # ---- scenario 6: a spec change -> a rolling update, one new pod before the old one goes, under load
    async def rollout(self) -> None:
        olds = self.ready_pods()
        assert len(olds) == 1, f"the rollout starts from one ready pod, not {olds}"
        self.rep.rollout_old_pod = old = olds[0]
        cr = await self.kube.cr(self.ns, self.name)
        change: dict[str, Any] = {"spec": {"engine": {"maxQueuedRequests": self.cfg.rollout_max_queued}}}
        if self.kube.emulated:  # a real API server counts spec changes in metadata.generation
            change["metadata"] = {"generation": int(cr["metadata"].get("generation", 1)) + 1}
        self.mark("spec change")
        await self.kube.patch(f"{inferencedeployments(self.ns)}/{self.name}", change)
        flag = ["--max-queued-requests", str(self.cfg.rollout_max_queued)]

        async def new_template() -> Any:
            self.operator_alive()
            dep = await self.kube.deployment(self.ns, self.name)
            args = (dep or {}).get("spec", {}).get("template", {}).get("spec", {}).get("containers", [{}])[0]
            a = args.get("args", [])
            return dep if any(a[i:i + 2] == flag for i in range(len(a))) else None
        self.rep.deployment_after_rollout = await until(new_template, 60, "the operator writes the new pod template")
        news = await until(lambda: [p for p in self.ready_pods() if p != old], self.cfg.pod_ready_timeout,
                           "the rollout's new pod becomes Ready")
        self.rep.rollout_new_pod = news[0]
        t_ready = self.mark("rollout pod ready")
        c = await until(lambda: self.agent.containers.get(old) if self.agent.containers.get(old)
                        and self.agent.containers[old].gone else None, self.cfg.grace_period + 60,
                        "the rollout removes the old pod")
        assert c.deleted_at is not None
        self.mark("rollout done")
        await until(lambda: self.ok_on(self.rep.rollout_new_pod, t_ready) >= self.cfg.new_pod_requests, 180,
                    "the rollout's new pod answers")

        async def settled() -> Any:
            cr = await self.kube.cr(self.ns, self.name)
            st = (cr or {}).get("status") or {}
            ok = (st.get("replicas") == 1 and st.get("readyReplicas") == 1 and len(self.ready_pods()) == 1
                  and st.get("observedGeneration") == cr["metadata"].get("generation"))
            return cr if ok else None
        self.rep.cr_after_rollout = await until(settled, 60, "the CR status shows the new generation, 1/1 replicas")
        self.trickle_stop.set()
        await until(lambda: self.load.inflight == 0, 120, "the last requests finish")

    async def run(self) -> None:
        await run_phase(self.rep, "apply", self.apply)
        await run_phase(self.rep, "scale-up", self.scale_up)
        if self.cfg.kill:
            await run_phase(self.rep, "sigkill", self.sigkill)
        await run_phase(self.rep, "scale-down", self.scale_down)
        if self.cfg.rollout:
            await run_phase(self.rep, "rollout", self.rollout)
        self.mon.phase = "end"


async def _scenarios(cfg: Config, rep: Report, kube: Kube, operator: Any, heavy_stop: asyncio.Event,
                     trickle_stop: asyncio.Event, tasks: list[asyncio.Task]) -> None:
    await _Scenarios(cfg, rep, kube, operator, heavy_stop, trickle_stop, tasks).run()
