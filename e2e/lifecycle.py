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
from .cluster import Kube, condition, emulator, example_cr, write_kubeconfig
from .load import LoadGenerator, Record
from .monitor import Monitor

log = logging.getLogger("e2e")
HERE = Path(__file__).resolve().parent


@dataclass
class Config:
    workdir: Path
    namespace: str = "kvpilot-e2e"
    name: str = "smollm2"
    kill: bool = True  # scenario 5: SIGKILL one daemon mid-load
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


@dataclass
class Report:
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
    expected: dict[str, Any] | None = None
    reference_error: str | None = None
    monitor: Monitor | None = None
    agent: NodeAgent | None = None
    load: LoadGenerator | None = None
    leftover_pids: list[int] = field(default_factory=list)
    wall_s: float = 0.0

    def ok(self, phase: str) -> bool:
        return phase in self.done

    def need(self, *phases: str) -> None:
        """Fail with the recorded reason when a phase this check depends on did not complete."""
        for p in phases:
            if p not in self.done:
                why = self.errors.get(p, "it did not run: an earlier phase failed " + repr(self.errors))
                raise AssertionError(f"phase {p!r} did not complete: {why}\nlogs: {self.config.workdir}")

    def records(self, phase: str | None = None) -> list[Record]:
        assert self.load is not None
        return [r for r in self.load.records if phase is None or r.phase == phase]

    def daemon_log_records(self, pod: str) -> list[dict[str, Any]]:
        path = self.config.workdir / "pods" / pod / "daemon.log"
        out = []
        for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line))
        return out

    def dump(self, path: Path) -> None:
        """The run as JSON, for reading after a failure."""
        m, a, ld = self.monitor, self.agent, self.load
        data = {
            "t0": self.t0, "marks": {k: round(v - self.t0, 2) for k, v in self.marks.items()},
            "errors": self.errors, "done": self.done,
            "pods": {"first": self.first_pod, "new": self.new_pod, "killed": self.killed_pod,
                     "removed": self.removed_pod},
            "load": ld.summary(self.expected) if ld else None,
            "agent_events": [dict(asdict(e), t=round(e.t - self.t0, 2)) for e in a.events] if a else [],
            "agent_errors": a.errors if a else [],
            "events": [dict(asdict(e), t=round(e.t - self.t0, 2)) for e in m.events.values()] if m else [],
            "samples": [dict(asdict(s), t=round(s.t - self.t0, 2)) for s in m.samples] if m else [],
            "requests": [{"id": r.id, "job": r.job.key, "phase": r.phase, "start": round(r.start - self.t0, 2),
                          "end": round(r.end - self.t0, 2), "lost": r.lost, "finish": r.finish_reason,
                          "attempts": [(x.pod, x.outcome, round(x.start - self.t0, 2), round(x.end - self.t0, 2))
                                       for x in r.attempts]} for r in ld.records] if ld else [],
            "wall_s": self.wall_s,
        }
        path.write_text(json.dumps(data, indent=1, default=str))


def e2e_cr(cfg: Config) -> dict[str, Any]:
    """The example CR with what fits two shared CPU cores: small batches and KV cache, short windows."""
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


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBE")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", KVPILOT_NUM_THREADS="1")
    return env


async def _reference(cfg: Config) -> tuple[dict[str, Any] | None, str | None]:
    out = cfg.workdir / "reference.json"
    proc = procs.spawn([sys.executable, str(HERE / "reference.py"), str(out)], _env(), cfg.workdir / "reference.log")
    try:
        await until(lambda: proc.poll() is not None, 900, "offline reference", interval=0.5)
    finally:
        procs.stop(proc, 1)
    if proc.returncode != 0 or not out.exists():
        return None, f"exit {proc.returncode}: {(cfg.workdir / 'reference.log').read_text()[-2000:]}"
    return json.loads(out.read_text()), None


def _start_operator(cfg: Config, kube: Kube) -> Any:
    kubeconfig = write_kubeconfig(cfg.workdir / "kubeconfig", kube.url)
    env = _env()
    env.update(KUBECONFIG=str(kubeconfig), HOSTNAME="kvpilot-operator-e2e")
    argv = [sys.executable, "-m", "kvpilot.operator", "-A", "--standalone", "--metrics-port", "0",
            "--scrape-timeout", "1"]
    return procs.spawn(argv, env, cfg.workdir / "operator.log")


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
        async with emulator() as kube:
            await kube.apply_crd()
            operator = _start_operator(cfg, kube)
            agent = NodeAgent(kube, cfg.namespace, cfg.workdir, node_env={"KVPILOT_CACHE_DIR": str(node_model_cache())})
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
                load_tasks = [t for t in tasks[2:] if not t.done()]
                if load_tasks:  # in-flight requests finish (bounded); a stuck one is cancelled
                    _, pending = await asyncio.wait(load_tasks, timeout=60)
                    for t in pending:
                        t.cancel()
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


async def _phase(rep: Report, name: str, body: Callable[[], Awaitable[None]]) -> bool:
    if rep.errors:  # an earlier phase failed: this one cannot run
        return False
    rep.monitor.phase = name  # type: ignore[union-attr]
    try:
        await body()
    except Exception as e:  # noqa: BLE001 - recorded for the tests, which fail with it
        rep.errors[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"
        log.error("phase %s failed: %s", name, e)
        return False
    rep.done.append(name)
    return True


async def _scenarios(cfg: Config, rep: Report, kube: Kube, operator: Any, heavy_stop: asyncio.Event,
                     trickle_stop: asyncio.Event, tasks: list[asyncio.Task]) -> None:
    ns, name = cfg.namespace, cfg.name
    agent, load, mon = rep.agent, rep.load, rep.monitor
    assert agent is not None and load is not None and mon is not None
    clock = time.monotonic
    heavy_jobs, trickle_jobs = workload.heavy_jobs(), workload.trickle_jobs()

    def mark(label: str) -> float:
        rep.marks[label] = clock()
        return rep.marks[label]

    def ready_pods() -> list[str]:
        return [p.name for p in (mon.samples[-1].pods if mon.samples else []) if p.ready and not p.terminating]

    def ok_on(pod: str, since: float) -> int:
        return sum(1 for r in load.records for a in r.attempts if a.pod == pod and a.outcome == "ok"
                   and a.start >= since)

    async def deployment_replicas() -> int | None:
        dep = await kube.deployment(ns, name)
        return (dep or {}).get("spec", {}).get("replicas")

    def operator_alive() -> None:
        if operator.poll() is not None:
            raise RuntimeError(f"the operator exited with {operator.returncode}; see {cfg.workdir / 'operator.log'}")

    # ---- scenario 1: apply the CR -> one pod ready -> status Ready with url and metrics
    async def apply() -> None:
        rep.t0 = mon.t0 = mark("kubectl apply")
        await kube.apply_cr(ns, e2e_cr(cfg))

        async def deployment() -> Any:
            operator_alive()
            return await kube.deployment(ns, name)
        rep.deployment_after_apply = await until(deployment, 60, "the operator creates the Deployment")
        pods_ = await until(ready_pods, cfg.pod_ready_timeout, "the first pod becomes Ready")
        rep.first_pod = pods_[0]
        mark("pod 1 ready")

        async def status_ready() -> Any:
            cr = await kube.cr(ns, name)
            st = (cr or {}).get("status") or {}
            ok = ((condition(cr, "Ready") or {}).get("status") == "True" and st.get("url")
                  and (st.get("metrics") or {}).get("sampledPods", 0) >= 1 and st.get("readyReplicas") == 1)
            return cr if ok else None
        rep.cr_after_ready = await until(status_ready, 30, "CR status Ready with url and metrics")
        await load.request(heavy_jobs[0], "smoke")

    # ---- scenario 2: sustained load -> KV and waiting rise -> >= 2 replicas -> the new pod takes traffic
    async def scale_up() -> None:
        t = mark("load starts")
        tasks.append(asyncio.create_task(
            load.clients(cfg.heavy_clients, heavy_jobs, "heavy", heavy_stop, deadline=t + 900)))

        async def scaled() -> bool:
            operator_alive()
            return (await deployment_replicas() or 0) >= 2
        await until(scaled, cfg.scale_up_timeout, "the operator scales to >= 2 replicas")
        mark("scaled up")
        pods_ = await until(lambda: len(ready_pods()) >= 2 and ready_pods(), cfg.pod_ready_timeout,
                            "a second pod becomes Ready")
        rep.new_pod = next(p for p in pods_ if p != rep.first_pod)
        t_ready = mark("pod 2 ready")
        await until(lambda: ok_on(rep.new_pod, t_ready) >= cfg.new_pod_requests, 180,
                    f"the new pod answers {cfg.new_pod_requests} requests")
        mark("pod 2 serving")
        await asyncio.sleep(cfg.hold_heavy)

    # ---- scenario 5: SIGKILL one daemon mid-load -> not ready, no scale-down, the agent restarts it
    async def sigkill() -> None:
        victim = rep.first_pod
        assert victim is not None
        c = agent.containers[victim]
        assert c.proc is not None and c.proc.poll() is None, "the daemon to kill is not running"
        rep.killed_pod, rep.killed_pid = victim, c.proc.pid
        rep.replicas_at_kill = await deployment_replicas()
        mark("SIGKILL")
        os.kill(c.proc.pid, signal.SIGKILL)
        await until(lambda: victim not in ready_pods(), 20, "the killed pod turns not-ready")
        mark("pod not ready")
        await until(lambda: victim in ready_pods() and c.restarts >= 1, cfg.pod_ready_timeout,
                    "the agent restarts the pod and it is Ready again")
        t_back = mark("pod restarted")
        await until(lambda: ok_on(victim, t_back) >= 2, 180, "the restarted pod answers again")
        mark("restarted pod serving")

    # ---- scenario 3: load stops -> back to minReplicas after the delay; the removed pod drains
    async def scale_down() -> None:
        t = clock()
        tasks.append(asyncio.create_task(
            load.clients(cfg.trickle_clients, trickle_jobs, "trickle", trickle_stop, deadline=t + 900,
                         sticky=True)))
        heavy_stop.set()
        mark("load stops")
        bound = cfg.stable_window + cfg.scale_down_delay + 120

        async def scaled_down() -> bool:
            operator_alive()
            return await deployment_replicas() == 1
        await until(scaled_down, bound, "the operator scales back to 1 replica")
        mark("scaled down")
        deleted = await until(lambda: [e for e in agent.events if e.what == "delete" and e.t >= t], 30,
                              "the ReplicaSet role deletes a pod")
        rep.removed_pod = deleted[-1].pod
        c = agent.containers[rep.removed_pod]
        await until(lambda: c.gone, cfg.grace_period + 30, "the removed pod's daemon exits")
        mark("pod removed")

        async def settled() -> bool:
            st = ((await kube.cr(ns, name)) or {}).get("status") or {}
            return st.get("replicas") == 1 and st.get("readyReplicas") == 1 and len(ready_pods()) == 1
        await until(settled, 30, "the CR status shows 1/1 replicas")
        trickle_stop.set()
        await until(lambda: load.inflight == 0, 120, "the last requests finish")

    await _phase(rep, "apply", apply)
    await _phase(rep, "scale-up", scale_up)
    if cfg.kill:
        await _phase(rep, "sigkill", sigkill)
    await _phase(rep, "scale-down", scale_down)
    mon.phase = "end"
