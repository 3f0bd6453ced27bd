"""The LoRA scenario: a LoRAAdapter applied under load, against real `kvpilot serve` daemons.

An InferenceDeployment with `engine.enableLora` (one replica, autoscaling off) serves the base model to a
steady load of two clients. Phases, each recorded into a `Report`:

1. deploy: the first daemon Ready (started with --enable-lora and --allow-runtime-lora-updating); the load
   starts; the adapter is written (a PEFT folder, rank 8 on q_proj and v_proj: lora_adapter.py);
2. apply-adapter: `kubectl apply` of a LoRAAdapter with `uri: file://<folder>`. The folder is new to the
   daemons' --lora-root, so the operator re-renders the pod template and the pod rolls (one at a time,
   under load); once the new pod is Ready the operator loads the adapter through its
   /v1/load_lora_adapter, and the LoRAAdapter turns Ready with the pod in status.loadedPods;
3. adapter-requests: `model: <adapter>` completions (official openai client) sent to every ready pod
   succeed, answered as the adapter;
4. scale-out: spec.replicas 1 -> 2 (`kubectl scale`): the new pod is loaded once Ready, and adapter
   requests succeed on both pods;
5. delete-adapter: deleting the LoRAAdapter unloads it from every pod before the object goes (the
   operator's finalizer): no pod lists it in /v1/models, and a request for it gets 404 model_not_found.

The base-model load runs through all of it: every one of its requests must complete (a draining pod's 503
is retried on the next pod, as a gateway does). The daemons run on this machine (the node agent), so a
file:// adapter is a folder they can all read, on the emulator and on a cluster alike.
"""

from __future__ import annotations

import asyncio
import copy
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import openai

from kvpilot.operator import crd, lora_crd
from kvpilot.operator.kube import loraadapters

from . import procs, workload
from .agent import NodeAgent
from .cluster import GROUP, REPO, VERSION, Kube, condition, deployments, inferencedeployments
from .lifecycle import Config as MainConfig
from .lifecycle import (
    Phases,
    child_env,
    e2e_cr,
    finish_load,
    node_model_cache,
    requests_json,
    run_on_target,
    run_phase,
    start_operator,
    timeline_json,
    until,
)
from .load import LoadGenerator, Record
from .monitor import Monitor
from .node import GPU, NodeSpec, quantity

HERE = Path(__file__).resolve().parent
ADAPTER = "sql"  # the adapter's name: what clients put in "model"


def daemon_limit() -> str | None:
    """Why the daemons cannot run this scenario (None once `kvpilot serve` has the LoRA routes)."""
    routes, args = REPO / "daemon" / "lora_routes.py", REPO / "daemon" / "args.py"
    if not routes.exists() or "load_lora_adapter" not in routes.read_text() \
            or "allow_runtime_lora_updating" not in args.read_text():
        return ("the daemon has no runtime LoRA loading yet (POST /v1/load_lora_adapter behind "
                "--allow-runtime-lora-updating, issue 38 item 2): nothing for the operator to call")
    return None


@dataclass
class Config:
    workdir: Path
    namespace: str = "kvpilot-e2e-lora"
    name: str = "smollm2-lora"
    clients: int = 2  # the base-model load: light, so two daemons and a rolling one fit on two cores
    adapter_requests: int = 2  # per pod and phase
    adapter_tokens: int = 8
    pod_ready_timeout: float = 300.0
    loaded_timeout: float = 60.0  # Ready pod -> adapter loaded (the operator reads the daemons every 1 s here)
    table_every: float | None = None


@dataclass
class AdapterRequest:
    phase: str
    pod: str
    start: float
    status: int = 0  # HTTP status; 0: no answer
    model: str | None = None  # the answer's "model"
    text: str | None = None
    error: str | None = None


@dataclass
class Report(Phases):
    config: Config
    t0: float = 0.0
    marks: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    done: list[str] = field(default_factory=list)
    adapter_dir: Path | None = None
    first_pod: str | None = None
    deployment_before: dict[str, Any] | None = None
    deployment_after_apply: dict[str, Any] | None = None
    rolled_pod: str | None = None  # the pod the adapter's folder rolled in
    adapter_ready: dict[str, Any] | None = None  # the LoRAAdapter once Ready on the rolled pod
    scaled_pod: str | None = None
    adapter_scaled: dict[str, Any] | None = None  # the LoRAAdapter once loaded on both pods
    adapter_requests: list[AdapterRequest] = field(default_factory=list)
    models_after_delete: dict[str, list[str]] = field(default_factory=dict)  # pod -> /v1/models ids
    monitor: Monitor | None = None
    agent: NodeAgent | None = None
    load: LoadGenerator | None = None
    leftover_pids: list[int] = field(default_factory=list)
    pod_network: str | None = None
    wall_s: float = 0.0

    def records(self, phase: str | None = None) -> list[Record]:
        assert self.load is not None
        return [r for r in self.load.records if phase is None or r.phase == phase]

    def requests_for(self, phase: str) -> list[AdapterRequest]:
        return [r for r in self.adapter_requests if r.phase == phase]

    def dump(self, path: Path) -> None:
        t0 = self.t0
        data = {**timeline_json(t0, self.marks, self.monitor, self.agent), "errors": self.errors, "done": self.done,
                "namespace": self.config.namespace, "pod_network": self.pod_network,
                "adapter_requests": [dict(asdict(r), start=round(r.start - t0, 2)) for r in self.adapter_requests],
                "models_after_delete": self.models_after_delete,
                "requests": requests_json(t0, self.load.records) if self.load else [], "wall_s": self.wall_s}
        path.write_text(json.dumps(data, indent=1, default=str))


def lora_cr(cfg: Config, node: NodeSpec | None = None) -> dict[str, Any]:
    """The e2e's CR with LoRA on: one replica that only `kubectl scale` changes (autoscaling off)."""
    cr = e2e_cr(MainConfig(workdir=cfg.workdir, name=cfg.name), node)
    spec = cr["spec"]
    spec["engine"].update({"enableLora": True, "maxLoras": 2, "maxLoraRank": 8})
    spec["autoscaling"]["enabled"] = False
    spec["replicas"] = 1
    errors = crd.validate(cfg.name, crd.default_spec(copy.deepcopy(spec)))
    if errors:
        raise ValueError(f"the LoRA e2e CR is invalid: {errors}")
    return cr


def adapter_cr(cfg: Config, folder: Path) -> dict[str, Any]:
    spec = {"baseModel": cfg.name, "uri": f"file://{folder}"}
    errors = lora_crd.validate(ADAPTER, lora_crd.default_spec(spec))
    if errors:
        raise ValueError(f"the e2e LoRAAdapter is invalid: {errors}")
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "LoRAAdapter", "metadata": {"name": ADAPTER}, "spec": spec}


def node_capacity(cfg: Config) -> dict[str, str]:
    """Two replicas and a rollout's surge pod at once."""
    res = lora_cr(cfg)["spec"]["resources"]
    return {"cpu": f"{quantity(res['cpu']) * 3:g}", "memory": f"{quantity(res['memory']) * 3 / 2**20:.0f}Mi",
            GPU: "0"}


async def write_adapter(folder: Path, log: Path) -> None:
    proc = procs.spawn([sys.executable, str(HERE / "lora_adapter.py"), str(folder)], child_env(), log)
    try:
        await until(lambda: proc.poll() is not None, 300, "the adapter written", interval=0.25)
    finally:
        procs.stop(proc, 1)
    if proc.returncode != 0 or not (folder / "adapter_config.json").exists():
        raise RuntimeError(f"writing the adapter failed ({proc.returncode}): {log.read_text()[-2000:]}")


class _Scenario:
    def __init__(self, cfg: Config, rep: Report, kube: Kube, operator: Any, stop_load: asyncio.Event,
                 tasks: list[asyncio.Task]) -> None:
        self.cfg, self.rep, self.kube, self.operator = cfg, rep, kube, operator
        self.stop_load, self.tasks = stop_load, tasks
        self.ns, self.name = cfg.namespace, cfg.name
        assert rep.agent and rep.load and rep.monitor
        self.agent, self.load, self.mon = rep.agent, rep.load, rep.monitor
        self.clock = time.monotonic
        self.path = f"{loraadapters(self.ns)}/{ADAPTER}"

    def mark(self, label: str) -> float:
        self.rep.marks[label] = self.clock()
        return self.rep.marks[label]

    def ready_pods(self) -> list[str]:
        return [e.pod for e in self.mon.endpoints()]

    def alive(self) -> None:
        if self.operator.poll() is not None:
            raise RuntimeError(f"the operator exited with {self.operator.returncode}; see {self.cfg.workdir}")

    async def adapter(self) -> dict[str, Any] | None:
        self.alive()
        return await self.kube.get(self.path)

    async def loaded_on(self, pods_: list[str]) -> dict[str, Any] | None:
        """The LoRAAdapter once Ready with exactly these pods holding it."""
        obj = await self.adapter()
        st = (obj or {}).get("status") or {}
        ready = (condition(obj, "Ready") or {}).get("status") == "True"
        return obj if ready and sorted(st.get("loadedPods") or []) == sorted(pods_) else None

    # ---- 1: the base with LoRA, one pod Ready; the base-model load starts
    async def deploy(self) -> None:
        folder = self.cfg.workdir / "adapters" / ADAPTER
        writing = asyncio.create_task(write_adapter(folder, self.cfg.workdir / "lora_adapter.log"))
        self.rep.t0 = self.mon.t0 = self.mark("kubectl apply")
        await self.kube.apply_cr(self.ns, lora_cr(self.cfg, self.agent.node))
        pods_ = await until(self.ready_pods, self.cfg.pod_ready_timeout, "the first pod becomes Ready")
        self.rep.first_pod = pods_[0]
        self.rep.deployment_before = await self.kube.get(f"{deployments(self.ns)}/{self.name}")
        self.mark("pod 1 ready")
        t = self.mark("load starts")
        self.tasks.append(asyncio.create_task(self.load.clients(
            self.cfg.clients, workload.trickle_jobs(), "base", self.stop_load, deadline=t + 900)))
        await writing
        self.rep.adapter_dir = folder
        await until(lambda: sum(r.ok for r in self.load.records) >= self.cfg.clients, 120, "the base load answers")

    # ---- 2: kubectl apply of the LoRAAdapter under load: the pod rolls for the folder, then loads it
    async def apply_adapter(self) -> None:
        assert self.rep.adapter_dir is not None
        self.mark("adapter applied")
        body = adapter_cr(self.cfg, self.rep.adapter_dir)
        await self.kube.create(loraadapters(self.ns), {**body, "metadata": {**body["metadata"], "namespace": self.ns}})
        root = str(self.rep.adapter_dir)

        async def template() -> Any:
            dep = await self.kube.get(f"{deployments(self.ns)}/{self.name}")
            args = (dep or {}).get("spec", {}).get("template", {}).get("spec", {}).get("containers", [{}])[0]
            a = args.get("args", [])
            return dep if any(a[i:i + 2] == ["--lora-root", root] for i in range(len(a))) else None
        self.rep.deployment_after_apply = await until(template, 60, "the operator adds the folder to the pods")
        first = self.rep.first_pod
        news = await until(lambda: [p for p in self.ready_pods() if p != first], self.cfg.pod_ready_timeout,
                           "the rolled pod becomes Ready")
        self.rep.rolled_pod = news[0]
        self.mark("rolled pod ready")
        await until(lambda: self.ready_pods() == [self.rep.rolled_pod], self.cfg.pod_ready_timeout,
                    "the old pod leaves the endpoints")
        self.rep.adapter_ready = await until(lambda: self.loaded_on([self.rep.rolled_pod]), self.cfg.loaded_timeout,
                                             "the LoRAAdapter Ready, loaded on the rolled pod")
        self.mark("adapter loaded")

    async def ask(self, phase: str, pod: str, job: workload.Job) -> AdapterRequest:
        url = next(e.url for e in self.mon.endpoints() if e.pod == pod)
        rec = AdapterRequest(phase=phase, pod=pod, start=self.clock())
        self.rep.adapter_requests.append(rec)
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="e2e", max_retries=0,
                                      timeout=openai.Timeout(120.0, connect=3.0)) as client:
            try:
                resp = await client.completions.create(model=ADAPTER, prompt=job.prompt,
                                                       max_tokens=self.cfg.adapter_tokens, temperature=0.0)
            except openai.APIStatusError as e:
                rec.status, rec.error = e.status_code, str(e)[:300]
                return rec
            except openai.APIError as e:
                rec.error = f"{type(e).__name__}: {e}"[:300]
                return rec
        rec.status, rec.model, rec.text = 200, resp.model, resp.choices[0].text
        return rec

    async def ask_every_pod(self, phase: str) -> list[AdapterRequest]:
        jobs = workload.heavy_jobs()
        # One after another: the load is the base clients', these are the checks.
        return [await self.ask(phase, pod, jobs[i % len(jobs)])
                for pod in self.ready_pods() for i in range(self.cfg.adapter_requests)]

    # ---- 3: `model: <adapter>` on every ready pod
    async def adapter_requests(self) -> None:
        recs = await self.ask_every_pod("adapter")
        bad = [r for r in recs if r.status != 200]
        assert recs and not bad, f"adapter requests failed: {bad}"

    # ---- 4: scale out to 2 (spec.replicas, as `kubectl scale` writes it): the new pod gets the adapter once Ready
    async def scale_out(self) -> None:
        self.mark("scale out")
        await self.kube.patch(f"{inferencedeployments(self.ns)}/{self.name}", {"spec": {"replicas": 2}})
        pods_ = await until(lambda: len(self.ready_pods()) >= 2 and self.ready_pods(), self.cfg.pod_ready_timeout,
                            "the new pod becomes Ready")
        self.rep.scaled_pod = next(p for p in pods_ if p != self.rep.rolled_pod)
        self.mark("pod 2 ready")
        self.rep.adapter_scaled = await until(lambda: self.loaded_on(pods_), self.cfg.loaded_timeout,
                                              "the adapter loaded on the new pod")
        self.mark("adapter on pod 2")
        recs = await self.ask_every_pod("scaled")
        bad = [r for r in recs if r.status != 200]
        assert {r.pod for r in recs} == set(pods_) and not bad, f"adapter requests failed: {bad}"

    # ---- 5: delete: unloaded from every pod before the object goes
    async def delete_adapter(self) -> None:
        pods_ = self.ready_pods()
        self.mark("adapter deleted")
        await self.kube.delete(self.path)
        await until(lambda: self._gone(), 60, "the LoRAAdapter gone (the operator unloaded it and let go)")
        self.mark("adapter gone")
        # At once, before the roll that drops the folder replaces the pods: they are the same pods.
        async with aiohttp.ClientSession() as http:
            for pod in pods_:
                url = next((e.url for e in self.mon.endpoints() if e.pod == pod), None)
                if url is None:
                    continue
                async with http.get(f"{url}/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as r:
                    self.rep.models_after_delete[pod] = [m["id"] for m in (await r.json())["data"]]
        for pod in self.rep.models_after_delete:
            await self.ask("deleted", pod, workload.heavy_jobs()[0])

    async def _gone(self) -> bool:
        return await self.adapter() is None

    async def run(self) -> None:
        await run_phase(self.rep, "deploy", self.deploy)
        await run_phase(self.rep, "apply-adapter", self.apply_adapter)
        await run_phase(self.rep, "adapter-requests", self.adapter_requests)
        await run_phase(self.rep, "scale-out", self.scale_out)
        await run_phase(self.rep, "delete-adapter", self.delete_adapter)
        self.mon.phase = "end"


async def run(cfg: Config) -> Report:
    """The scenario on the emulator or a cluster; teardown always happens."""
    return await run_on_target(cfg, Report(config=cfg), node_capacity(cfg), _run_on)


async def _run_on(cfg: Config, rep: Report, kube: Kube, target: Any) -> None:
    operator = start_operator(cfg.workdir, target, extra_args=["--lora-period", "1"])
    stop_bg, stop_load = asyncio.Event(), asyncio.Event()
    agent = NodeAgent(kube, cfg.namespace, cfg.workdir, node=target.node, replicasets=not target.real,
                      node_env={"KVPILOT_CACHE_DIR": str(node_model_cache())}, network=target.network)
    rep.pod_network = target.network.mode
    load = LoadGenerator(lambda: monitor.endpoints())
    monitor = Monitor(kube, cfg.namespace, cfg.name, load, table_every=cfg.table_every)
    rep.agent, rep.load, rep.monitor = agent, load, monitor
    tasks = [asyncio.create_task(agent.run(stop_bg)), asyncio.create_task(monitor.run(stop_bg))]
    try:
        await _Scenario(cfg, rep, kube, operator, stop_load, tasks).run()
    finally:
        stop_load.set()
        await finish_load(tasks[2:], timeout=120)
        stop_bg.set()
        await asyncio.wait(tasks[:2], timeout=30)
        await load.close()
        await asyncio.to_thread(procs.stop, operator, 10)
