"""A node agent: the parts of Kubernetes a machine without a kubelet lacks, acted out on one machine.

- node: registers a Node (Ready, with capacity and a taint) and keeps its heartbeat;
- scheduler: binds the namespace's pending Pods that fit the node, through pods/NAME/binding;
- kubelet: runs each bound pod's container as a real process (`kvpilot serve` with the pod's args) in the
  pod's network (netns.py): a network namespace of its own with a 198.18.x address, as a CNI plugin gives
  it, or, where namespaces cannot be made, its own loopback address 127.0.0.2, .3, ...; probes /ready and /health and writes podIP, the
  conditions and containerStatuses through pods/status; restarts a container that dies (restartCount,
  lastState); on deletion (deletionTimestamp) runs the preStop hook, sends SIGTERM, waits out the grace
  period, then SIGKILL, and only then deletes the Pod with grace 0, as a kubelet does;
- hands a pod that names a ServiceAccount its token, as a kubelet does (podcreds.py): a TokenRequest, the
  files in the pod's folder, and KUBECONFIG pointing at them (the router reads the API that way);
- with `replicasets=True` (the emulator, which has no controller-manager) also the Deployment and
  ReplicaSet controllers (replicaset.py), the LeaderWorkerSet controller (leaderworkerset.py) and the
  EndpointSlice controller (endpointslices.py).

On a cluster it needs only what a kubelet may do, plus the scheduler's pods/binding (see README.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from . import netns, podcreds, procs
from . import node as nodes
from .cluster import NODES, Kube, condition, deployments, leaderworkersets, now_iso, pods, terminating
from .endpointslices import EndpointSliceController
from .leaderworkerset import LeaderWorkerSets
from .replicaset import ReplicaSets

log = logging.getLogger("e2e.agent")

NODE_NAME = "loopback-node"
RESTART_BACKOFF = 1.0  # seconds before a crashed container starts again (a kubelet starts at 10 s)
PROBE_PERIOD = 1.0  # the pod asks for 5-10 s; probing faster keeps the runs short
EXIT_CHECK_PERIOD = 0.25  # how soon a dead process is noticed (a kubelet's PLEG relists every second)
HEARTBEAT_PERIOD = 10.0  # a kubelet reports every 10 s; the node lifecycle controller waits ~40 s


@dataclass(frozen=True)
class Probe:
    path: str
    timeout: float
    failures: int


def _probe(ctr: dict[str, Any], key: str, default_path: str) -> Probe:
    p = ctr.get(key) or {}
    return Probe(path=(p.get("httpGet") or {}).get("path", default_path), timeout=float(p.get("timeoutSeconds", 1)),
                 failures=int(p.get("failureThreshold", 3)))


@dataclass
class Event:
    """Something the agent did or saw, for the test's timeline."""

    t: float
    pod: str
    what: str
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class Container:
    pod: str
    uid: str
    name: str
    image: str
    ip: str
    port: int
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    grace: float
    pre_stop: list[str] | None
    readiness: Probe
    liveness: Probe
    net: netns.Attachment | None = None
    proc: subprocess.Popen | None = None
    restarts: int = 0
    ready: bool = False
    was_ready: bool = False
    started_at: float = 0.0
    ready_at: float | None = None
    crashed_at: float | None = None
    restart_at: float | None = None
    last_exit: int | None = None
    ready_failures: int = 0
    health_failures: int = 0
    probe_task: asyncio.Task | None = None
    terminating: bool = False
    term_task: asyncio.Task | None = None
    sigterm_at: float | None = None
    deleted_at: float | None = None
    exit_code: int | None = None
    gone: bool = False

    @property
    def base_url(self) -> str:
        return f"http://{self.ip}:{self.port}"


def _cpu_threads(container: dict[str, Any]) -> int:
    """Threads for torch from the container's CPU limit, as a cgroup quota would allow."""
    raw = str(((container.get("resources") or {}).get("limits") or {}).get("cpu", "1"))
    cpus = float(raw[:-1]) / 1000 if raw.endswith("m") else float(raw)
    return max(1, min(math.ceil(cpus), os.cpu_count() or 1))


def _field(pod: dict[str, Any], path: str, ip: str) -> str:
    """The downward API's env fieldRef: the pod's own fields, as the kubelet resolves them at start."""
    meta = pod.get("metadata") or {}
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    simple = {"metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"),
              "metadata.uid": meta.get("uid"), "spec.nodeName": (pod.get("spec") or {}).get("nodeName"),
              "status.podIP": ip, "status.hostIP": "127.0.0.1"}
    if path not in simple:
        raise RuntimeError(f"pod {meta.get('name')}: fieldRef {path} is not served by the node agent")
    return str(simple[path] or "")


def _expand(arg: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion in args."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


class NodeAgent:
    def __init__(self, kube: Kube, namespace: str, workdir: Path, clock: Any = time.monotonic,
                 node_env: dict[str, str] | None = None, period: float = 0.5,
                 node: nodes.NodeSpec | None = None, replicasets: bool = True,
                 network: netns.PodNetwork | None = None) -> None:
        self.kube = kube
        self.ns = namespace
        self.workdir = workdir
        self.clock = clock
        self.period = period
        self.node_env = node_env or {}
        self.node = node or nodes.NodeSpec(NODE_NAME)
        self.replicasets = ReplicaSets(kube, namespace, self._record) if replicasets else None
        self.leaderworkersets = LeaderWorkerSets(kube, namespace, self._record) if replicasets else None
        self.endpointslices = EndpointSliceController(kube, namespace) if replicasets else None
        self.containers: dict[str, Container] = {}
        self.retired: list[Container] = []  # containers of pods gone whose names came back
        self.events: list[Event] = []
        self._http: aiohttp.ClientSession | None = None
        self.network: netns.PodNetwork = network or netns.LoopbackNetwork()
        self._bin = Path(sys.executable).parent
        self._unschedulable: dict[str, str] = {}  # pod -> why, as last written
        self.errors: list[str] = []

    # ------------------------------------------------------------------ main loop

    async def run(self, stop: asyncio.Event) -> None:
        self._http = aiohttp.ClientSession()
        beat = 0.0
        try:
            await nodes.register(self.kube, self.node)
            self._record(self.node.name, "node-registered")
            while not stop.is_set():
                try:
                    if self.clock() - beat >= HEARTBEAT_PERIOD:
                        beat = self.clock()
                        await nodes.heartbeat(self.kube, self.node)
                    await self.sync()
                except Exception as e:  # noqa: BLE001 - one bad pass must not stop the node
                    self.errors.append(f"{type(e).__name__}: {e}")
                    log.exception("agent sync failed")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.period)
        finally:
            await self.shutdown()
            await self._http.close()

    async def sync(self) -> None:
        pod_list = await self.kube.list(pods(self.ns))
        deps: list[dict[str, Any]] = []
        if self.replicasets is not None:
            deps = await self.kube.list(deployments(self.ns))
            for dep in deps:
                pod_list = await self.replicasets.sync(dep, pod_list)
        groups: list[dict[str, Any]] = []
        if self.leaderworkersets is not None:
            groups = await self.kube.list(leaderworkersets(self.ns))
            for lws in groups:
                pod_list = await self.leaderworkersets.sync(lws, pod_list)
        pod_list = await self._schedule(pod_list)
        mine = [p for p in pod_list if (p.get("spec") or {}).get("nodeName") == self.node.name]
        by_name = {p["metadata"]["name"]: p for p in mine}
        await asyncio.gather(*(self._sync_pod(p) for p in mine))
        for name, c in list(self.containers.items()):
            if name not in by_name and not c.terminating:  # deleted behind our back: no grace
                self._record(name, "vanished")
                c.terminating = True
                c.term_task = asyncio.create_task(self._terminate(c, grace=0.0, finalize=False))
        if self.replicasets is not None:
            for dep in deps:
                await self.replicasets.write_status(dep, pod_list)
        if self.leaderworkersets is not None:
            for lws in groups:
                await self.leaderworkersets.write_status(lws, pod_list)
        if self.endpointslices is not None:  # from the statuses this pass wrote: endpoints follow at once
            await self.endpointslices.sync(await self.kube.list(pods(self.ns)))

    # ------------------------------------------------------------------ scheduler

    async def _schedule(self, pod_list: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Bind the pending pods that fit, oldest first; note why the others do not."""
        bound = [p for p in pod_list if (p.get("spec") or {}).get("nodeName") == self.node.name
                 and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]
        pending = [p for p in pod_list if not (p.get("spec") or {}).get("nodeName") and not terminating(p)
                   and (p.get("spec") or {}).get("schedulerName", "default-scheduler") == "default-scheduler"]
        changed = False
        for pod in sorted(pending, key=lambda p: p["metadata"].get("creationTimestamp") or ""):
            name = pod["metadata"]["name"]
            why = nodes.misfit(pod, self.node, bound)
            if why is None:
                if await nodes.bind(self.kube, pod, self.node.name):
                    self._record(name, "bound", {"node": self.node.name})
                    bound.append({**pod, "spec": {**pod["spec"], "nodeName": self.node.name}})
                changed = True
            elif self._unschedulable.get(name) != why:
                self._unschedulable[name] = why
                self._record(name, "unschedulable", {"why": why})
                self.errors.append(f"pod {name} does not fit node {self.node.name}: {why}")
                await self.kube.patch(f"{pods(self.ns)}/{name}/status", {"status": {"conditions": [
                    {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": why}]}})
        return await self.kube.list(pods(self.ns)) if changed else pod_list

    # ------------------------------------------------------------------ kubelet

    async def _sync_pod(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        c = self.containers.get(name)
        if c is not None and c.gone and c.uid != pod["metadata"].get("uid", c.uid) and not terminating(pod):
            # A new pod under a name that an old one had (a StatefulSet's, an LWS group's): the kubelet knows
            # pods by uid, so it is a new sandbox and container; the old one stays in the record.
            self.retired.append(self.containers.pop(name))
            c = None
        if c is None:
            if terminating(pod):  # never started here: nothing to stop
                await self._final_delete(name, pod["metadata"].get("uid"))
                return
            creds = await podcreds.mount(self.kube, pod, self.workdir / "pods" / name)
            c = self._make_container(pod, creds)
            self.containers[name] = c
            if creds and c.net is not None:  # the pod calls the API at its kubeconfig's address
                try:
                    await self.network.bridge_api(c.net, self.kube.url)
                except Exception as e:  # noqa: BLE001 - the container still starts; its API calls then fail
                    self.errors.append(f"API bridge of {name}: {type(e).__name__}: {e}")
            self._start(c)
            c.probe_task = asyncio.create_task(self._kubelet(c))
            await self._write_status(c, pod)
            return
        if c.gone or c.uid != pod["metadata"].get("uid", c.uid):
            if terminating(pod):  # the final delete failed before: again
                await self._final_delete(name, pod["metadata"].get("uid"))
            return
        if terminating(pod):
            if not c.terminating:
                c.terminating = True
                c.deleted_at = self.clock()
                grace = pod["metadata"].get("deletionGracePeriodSeconds")
                self._record(name, "terminating", {"grace": grace})
                c.term_task = asyncio.create_task(
                    self._terminate(c, grace=c.grace if grace is None else float(grace), finalize=True))
            return
        await self._write_status(c, pod)

    def _make_container(self, pod: dict[str, Any], creds: dict[str, str] | None = None) -> Container:
        name = pod["metadata"]["name"]
        spec = pod["spec"]
        ctr = spec["containers"][0]
        port = next((p["containerPort"] for p in ctr.get("ports", []) if p.get("name") == "http"), 8000)
        net = self.network.attach(name, port)  # the pod sandbox: kept across restarts, gone with the pod
        ip = net.ip
        poddir = self.workdir / "pods" / name
        mounts = {}
        for m in ctr.get("volumeMounts", []):
            vol_dir = poddir / "volumes" / m["name"]
            vol_dir.mkdir(parents=True, exist_ok=True)
            mounts[m["mountPath"]] = str(vol_dir)
        env: dict[str, str] = {}
        for e in ctr.get("env", []):
            ref = (e.get("valueFrom") or {}).get("fieldRef")
            if "value" not in e and ref is None:
                raise RuntimeError(f"pod {name}: env {e['name']} needs a Secret; the node agent has none")
            value = str(e["value"]) if ref is None else _field(pod, ref["fieldPath"], ip)
            for mount in sorted(mounts, key=len, reverse=True):  # a path in a volume -> the volume's folder
                if value == mount or value.startswith(mount + "/"):
                    value = mounts[mount] + value[len(mount):]
                    break
            env[e["name"]] = _expand(value, env)
        threads = str(_cpu_threads(ctr))
        full_env = {
            "PATH": f"{self._bin}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            "LANG": os.environ.get("LANG", "C.UTF-8"),
            # The container's CPU limit: more torch threads than CPUs collapses throughput.
            "OMP_NUM_THREADS": threads, "KVPILOT_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
            "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
            **(creds or {}), **env, **self.node_env,
        }
        command = list(ctr.get("command") or ["kvpilot"])
        if "/" not in command[0] and (self._bin / command[0]).exists():
            command[0] = str(self._bin / command[0])  # the image's entrypoint is our venv's script
        args = [_expand(a, full_env) for a in ctr.get("args", [])]
        # A pod's 0.0.0.0 is its own network; its address there says so in the logs the tests read.
        args = [ip if (i > 0 and args[i - 1] == "--host") else a for i, a in enumerate(args)]
        pre_stop = (((ctr.get("lifecycle") or {}).get("preStop") or {}).get("exec") or {}).get("command")
        return Container(pod=name, uid=pod["metadata"].get("uid", ""), name=ctr.get("name", "main"),
                         image=ctr.get("image", ""), ip=ip, net=net, port=port, argv=command + args, env=full_env,
                         log_path=poddir / "daemon.log", grace=float(spec.get("terminationGracePeriodSeconds", 30)),
                         pre_stop=list(pre_stop) if pre_stop else None,
                         readiness=_probe(ctr, "readinessProbe", "/ready"),
                         liveness=_probe(ctr, "livenessProbe", "/health"))

    def _start(self, c: Container) -> None:
        with open(c.log_path, "a") as f:
            f.write(f"--- start #{c.restarts} at {now_iso()}: {' '.join(c.argv)}\n")
        c.proc = procs.spawn(self._wrap(c, c.argv), c.env, c.log_path)
        c.started_at = self.clock()
        c.ready = False
        c.was_ready = False
        c.ready_failures = 0
        c.health_failures = 0
        c.crashed_at = None
        c.restart_at = None
        self._record(c.pod, "started", {"ip": c.ip, "pid": c.proc.pid, "restarts": c.restarts})

    async def _get(self, url: str, timeout: float) -> int:
        assert self._http is not None
        try:
            async with self._http.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                await r.read()
                return r.status
        except (aiohttp.ClientError, TimeoutError, OSError):
            return 0

    async def _kubelet(self, c: Container) -> None:
        """One container's life: notice its exit at once, restart it, run its probes."""
        next_probe = 0.0
        while not c.terminating and not c.gone:
            assert c.proc is not None
            code = c.proc.poll()
            if code is not None:
                if c.crashed_at is None:  # the container died: not ready now, restart after a backoff
                    c.crashed_at = self.clock()
                    c.last_exit = code
                    c.ready = False
                    c.restarts += 1
                    c.restart_at = c.crashed_at + RESTART_BACKOFF
                    procs.forget(c.proc)
                    self._record(c.pod, "crashed", {"exit_code": code, "restarts": c.restarts})
                elif self.clock() >= (c.restart_at or 0):
                    self._start(c)
            elif self.clock() >= next_probe:
                next_probe = self.clock() + PROBE_PERIOD
                await self._probe(c)
            await asyncio.sleep(EXIT_CHECK_PERIOD)

    async def _probe(self, c: Container) -> None:
        """Readiness (a failed probe counts after failureThreshold in a row) and, once up, liveness."""
        ok = await self._get(f"{c.base_url}{c.readiness.path}", c.readiness.timeout) == 200
        if c.terminating or c.crashed_at is not None:
            return
        c.ready_failures = 0 if ok else c.ready_failures + 1
        ready = ok if not c.ready else c.ready_failures < c.readiness.failures
        if ready != c.ready:
            c.ready = ready
            if ready:
                c.ready_at = self.clock()
                c.was_ready = True
            self._record(c.pod, "ready" if ready else "not-ready")
        if c.was_ready:  # liveness only once the model is up (the startup probe holds it off until then)
            healthy = await self._get(f"{c.base_url}{c.liveness.path}", c.liveness.timeout) == 200
            c.health_failures = 0 if healthy else c.health_failures + 1
            if c.health_failures >= c.liveness.failures and c.proc is not None:
                self._record(c.pod, "liveness-failed")
                procs.signal_group(c.proc, signal.SIGKILL)

    async def _write_status(self, c: Container, pod: dict[str, Any]) -> None:
        running = c.proc is not None and c.proc.poll() is None and c.crashed_at is None
        state: dict[str, Any]
        if running:
            state = {"running": {"startedAt": now_iso()}}
        else:
            state = {"waiting": {"reason": "CrashLoopBackOff" if c.restarts else "ContainerCreating"}}
        ready = "True" if c.ready and running else "False"
        cstatus: dict[str, Any] = {"name": c.name, "image": c.image, "imageID": "", "ready": ready == "True",
                                   "restartCount": c.restarts, "started": running, "state": state}
        if c.last_exit is not None:
            cstatus["lastState"] = {"terminated": {"exitCode": c.last_exit,
                                                   "reason": "Error" if c.last_exit else "Completed"}}
        status = {
            "phase": "Running", "podIP": c.ip, "podIPs": [{"ip": c.ip}], "hostIP": "127.0.0.1",
            "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Initialized", "status": "True"},
                           {"type": "ContainersReady", "status": ready}, {"type": "Ready", "status": ready}],
            "containerStatuses": [cstatus],
        }
        old = pod.get("status") or {}
        same = (old.get("podIP") == status["podIP"] and condition(pod, "Ready") is not None
                and condition(pod, "Ready").get("status") == ready
                and (old.get("containerStatuses") or [{}])[0].get("restartCount") == c.restarts
                and (old.get("containerStatuses") or [{}])[0].get("started") == running)
        if not same:
            if not running or condition(pod, "Ready") is None:
                status["startTime"] = old.get("startTime") or now_iso()
            await self.kube.patch(f"{pods(self.ns)}/{c.pod}/status", {"status": status})

    async def _terminate(self, c: Container, grace: float, finalize: bool) -> None:
        """Graceful deletion: preStop, SIGTERM, wait out the grace period, SIGKILL; then release the Pod."""
        start = self.clock()
        try:
            if c.proc is not None and c.proc.poll() is None and grace > 0 and c.pre_stop:
                hook = procs.spawn(self._wrap(c, c.pre_stop), {"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                                   c.log_path.with_name("prestop.log"))
                self._record(c.pod, "prestop", {"command": c.pre_stop})
                while hook.poll() is None and self.clock() - start < grace:
                    await asyncio.sleep(0.1)
                procs.signal_group(hook, signal.SIGKILL)
                procs.forget(hook)
            if c.proc is not None and c.proc.poll() is None:
                c.sigterm_at = self.clock()
                self._record(c.pod, "sigterm")
                procs.signal_group(c.proc, signal.SIGTERM)
                while c.proc.poll() is None and self.clock() - start < grace:
                    await asyncio.sleep(0.1)
                if c.proc.poll() is None:
                    self._record(c.pod, "sigkill", {"after_s": round(self.clock() - start, 1)})
                    procs.signal_group(c.proc, signal.SIGKILL)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        await asyncio.to_thread(c.proc.wait, 10)
            if c.proc is not None:
                c.exit_code = c.proc.returncode
                procs.forget(c.proc)
            self._record(c.pod, "exited", {"exit_code": c.exit_code, "after_s": round(self.clock() - start, 1)})
        finally:
            try:
                if finalize:
                    await self._final_status(c)
                    await self._final_delete(c.pod, c.uid)
            finally:
                c.gone = True  # after the final delete: "gone" means the Pod is released too
                self._release(c)

    def _wrap(self, c: Container, argv: list[str]) -> list[str]:
        return c.net.wrap(argv) if c.net is not None else list(argv)

    def _release(self, c: Container) -> None:
        """The pod's network goes with it (its namespace, link and route)."""
        if c.net is not None:
            net, c.net = c.net, None
            try:
                self.network.detach(net)
            except Exception as e:  # noqa: BLE001 - the run's close sweeps what is left
                self.errors.append(f"network of {c.pod}: {type(e).__name__}: {e}")

    async def _final_status(self, c: Container) -> None:
        """The container's end, written before the Pod goes (what `kubectl get -w` shows last)."""
        term = {"exitCode": c.exit_code if c.exit_code is not None else 137,
                "reason": "Completed" if c.exit_code == 0 else "Error"}
        status = {"phase": "Succeeded" if c.exit_code == 0 else "Failed",
                  "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Initialized", "status": "True"},
                                 {"type": "ContainersReady", "status": "False"}, {"type": "Ready", "status": "False"}],
                  "containerStatuses": [{"name": c.name, "image": c.image, "imageID": "", "ready": False,
                                         "restartCount": c.restarts, "started": False,
                                         "state": {"terminated": term}}]}
        with contextlib.suppress(Exception):
            await self.kube.patch(f"{pods(self.ns)}/{c.pod}/status", {"status": status})

    async def _final_delete(self, name: str, uid: str | None) -> None:
        """DELETE with grace 0 and the pod's uid: the API server removes the object now."""
        try:
            if await self.kube.delete(f"{pods(self.ns)}/{name}", grace_period=0, uid=uid or None):
                self._record(name, "removed")
        except Exception as e:  # noqa: BLE001 - retried on the next pass while the pod is still there
            self.errors.append(f"final delete of {name}: {type(e).__name__}: {e}")

    async def shutdown(self) -> None:
        """Node shutdown at the end of a run: every container goes, at once (no grace: the run is over),
        then its Pods and the Node, so that nothing stays Terminating on a node that is gone."""
        await self._kill_all()
        with contextlib.suppress(Exception):
            for p in await self.kube.list(pods(self.ns)):
                if (p.get("spec") or {}).get("nodeName") == self.node.name:
                    await self.kube.delete(f"{pods(self.ns)}/{p['metadata']['name']}", grace_period=0)
        with contextlib.suppress(Exception):
            await self.kube.delete(f"{NODES}/{self.node.name}")
            self._record(self.node.name, "node-deleted")

    async def _kill_all(self) -> None:
        for c in self.containers.values():
            for t in (c.term_task, c.probe_task):
                if t is not None and not t.done():
                    t.cancel()
            if c.proc is not None and c.proc.poll() is None:
                procs.signal_group(c.proc, signal.SIGKILL)
        for c in self.containers.values():
            if c.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    await asyncio.to_thread(c.proc.wait, 10)
                procs.forget(c.proc)
        for c in self.containers.values():
            self._release(c)

    # ------------------------------------------------------------------ views for the test

    def _record(self, pod: str, what: str, detail: dict[str, Any] | None = None) -> None:
        self.events.append(Event(self.clock(), pod, what, detail or {}))
        log.info("%s %s %s", pod, what, detail or "")

    def endpoints(self) -> list[Container]:
        return [c for c in self.containers.values() if c.ready and not c.terminating and not c.gone]

    def events_of(self, pod: str, what: str | None = None) -> list[Event]:
        return [e for e in self.events if e.pod == pod and (what is None or e.what == what)]
