"""The LoRAAdapter controller: one loop over kopf's index of LoRAAdapters, one base InferenceDeployment at a
time: observe (I/O) -> decide (lora_plan.py, pure) -> act (I/O).

- observe: the base (kopf's index of InferenceDeployments), its Deployment's pod template, its ready pods, and
  what each pod's daemon lists in /v1/models;
- decide: per adapter, the pods to load it on or unload it from, and its finalizer;
- act: the finalizer first (nothing is loaded before it is on), then the loads and unloads as background
  tasks, so that a slow download or a pod that does not answer never holds up the other adapters; a failed
  call is retried with a growing backoff. Last the status, written only when it changed.

A loop that polls the daemons rather than handlers on API events: a container that restarted is the same pod
with the same IP, Ready again, and nothing in the API says that its daemon came back empty.

When the base's pod template lacks the folders or claims its adapters need (lora_sources.py), the loop runs
the base's reconcile, which renders them, under the lock that reconcile and the autoscaler share.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from kvpilot.operator import kube, lora_daemons, lora_plan, metrics, resources
from kvpilot.operator.lora_plan import FINALIZER, Adapter, Attempt, BaseView, Plan, PodView
from kvpilot.operator.lora_sources import pod_lora
from kvpilot.operator.lora_status import changed, status_patch
from kvpilot.operator.reconcile import Degraded, NotReady, reconcile
from kvpilot.operator.scrape import pod_base_url, pod_is_ready
from kvpilot.operator.status import now_iso
from kvpilot.operator.tick import Cr

Key = tuple[str, str]
OpKey = tuple[Key, str, str]  # (adapter, pod, "load" | "unload")
ERRORS = (TimeoutError, kube.KubeApiError, aiohttp.ClientError)
RESYNC_INTERVAL = 10.0  # seconds before the loop reconciles a base again for the same roots


def index_entry(body: Mapping[str, Any]) -> dict[str, Any]:
    """What the index keeps of a LoRAAdapter: a copy (kopf reuses the body), with its status and deletion."""
    return {k: copy.deepcopy(dict(body.get(k) or {})) for k in ("metadata", "spec", "status")}


def snapshot(index: Mapping[Key, Iterable[dict[str, Any]]]) -> list[dict[str, Any]]:
    return [body for key in list(index) for body in index.get(key, ())]


def lora_bases(index: Mapping[Key, Iterable[dict[str, Any]]]) -> list[Key]:
    return [key for key in list(index) for body in index.get(key, ())
            if ((body.get("spec") or {}).get("engine") or {}).get("enableLora")]


def base_cr(index: Mapping[Key, Iterable[dict[str, Any]]], key: Key) -> Cr | None:
    return next((Cr.from_body(b) for b in index.get(key, ())), None)


@dataclass
class LoRALoop:
    client: kube.KubeClient
    http: aiohttp.ClientSession
    adapters: Mapping[Key, Iterable[dict[str, Any]]]  # kopf's index of LoRAAdapters (index_entry)
    bases: Mapping[Key, Iterable[dict[str, Any]]]  # kopf's index of InferenceDeployments
    locks: dict[Key, asyncio.Lock]  # shared with reconcile and the autoscaler
    logger: logging.Logger
    period: float = 2.0
    timeout: float = 2.0  # /v1/models and unloads
    load_timeout: float = 600.0  # a load may download the adapter first
    paused: Callable[[], Awaitable[bool]] | None = None  # kopf's peering: another operator is active
    attempts: dict[OpKey, Attempt] = field(default_factory=dict)
    tasks: dict[OpKey, asyncio.Task[None]] = field(default_factory=dict)
    resynced: dict[Key, tuple[tuple[str, ...], float]] = field(default_factory=dict)  # roots asked for, when
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # a call finished: look again now

    async def run(self) -> None:
        try:
            while True:
                self.wake.clear()
                try:
                    await self.round(time.time())
                except ERRORS as e:
                    self.logger.warning("LoRA round failed, retrying: %s", e)
                except Exception:  # a bug must not stop the loop for good
                    self.logger.exception("LoRA round crashed")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), self.period)
        finally:
            for task in list(self.tasks.values()):
                task.cancel()

    async def round(self, now: float) -> None:
        if self.paused is not None and await self.paused():
            return
        adapters = [Adapter.from_body(b) for b in snapshot(self.adapters)]
        # Every base with LoRA, also one with no adapter left: its pod template may still have their folders.
        groups: dict[Key, list[Adapter]] = {key: [] for key in lora_bases(self.bases)}
        for a in adapters:
            groups.setdefault(a.base_key, []).append(a)
        await asyncio.gather(*(self.sync_base(key, group, now) for key, group in groups.items()))
        known = {a.key for a in adapters}
        self.attempts = {k: v for k, v in self.attempts.items() if k[0] in known}

    async def sync_base(self, key: Key, group: list[Adapter], now: float) -> None:
        try:
            base = await self.observe(key, pods=bool(group))
            await self.resync_if_needed(key, base, group, now)
        except ERRORS as e:
            self.logger.warning("LoRA: observing InferenceDeployment %s/%s failed: %s", *key, e)
            return
        owner = lora_plan.owners(group)
        pods = {p.name for p in base.pods}
        for a in group:
            self.attempts = {k: v for k, v in self.attempts.items() if k[0] != a.key or k[1] in pods}
            plan = lora_plan.decide(a, base, owner.get(a.adapter_name), self.attempts_of(a.key), self.busy(a.key), now)
            try:
                await self.act(a, plan, base)
            except ERRORS as e:
                self.logger.warning("LoRA: adapter %s/%s: %s", *a.key, e)
            except Exception:  # a bug must not stop the other adapters
                self.logger.exception("LoRA: adapter %s/%s crashed", *a.key)

    def attempts_of(self, key: Key) -> dict[tuple[str, str], Attempt]:
        return {(pod, op): a for (k, pod, op), a in self.attempts.items() if k == key}

    def busy(self, key: Key) -> frozenset[tuple[str, str]]:
        return frozenset((pod, op) for (k, pod, op) in self.tasks if k == key)

    # --- observe -----------------------------------------------------------------------------------------

    async def observe(self, key: Key, pods: bool = True) -> BaseView:
        """The base, its pod template and (with `pods`) its ready pods and what their daemons hold."""
        cr = base_cr(self.bases, key)
        if cr is None:
            return BaseView(exists=False)
        ns, name = key
        view = BaseView(exists=True, enable_lora=bool(cr.spec["engine"].get("enableLora")),
                        served_name=resources.served_model_name(cr.meta, cr.spec),
                        api_key=bool(cr.spec.get("apiKeySecret")))
        if not view.enable_lora or view.api_key:
            return view
        deployment = await self.client.get(f"{kube.deployments(ns)}/{name}")
        template = (((deployment or {}).get("spec") or {}).get("template") or {}).get("spec")
        template_roots = pod_lora(template).roots if deployment is not None else None
        if not pods:
            return replace(view, template_roots=template_roots)
        listed = await self.client.list(kube.pods(ns), label_selector=resources.selector_string(name))
        ready = [p for p in listed if resources.matches_selector(p.get("metadata", {}).get("labels"), name)
                 and pod_is_ready(p) and p.get("status", {}).get("phase") not in ("Succeeded", "Failed")]
        candidates, others = [], 0
        for p in ready:
            lora, url = pod_lora(p.get("spec")), pod_base_url(p, resources.DAEMON_PORT)
            if lora.enabled and url:
                candidates.append((p["metadata"]["name"], url, lora))
            else:
                others += 1
        pods = await asyncio.gather(*(self.pod_view(*c) for c in candidates))
        return BaseView(exists=True, enable_lora=True, served_name=view.served_name,
                        template_roots=template_roots,
                        pods=tuple(sorted(pods, key=lambda p: p.name)), other_pods=others)

    async def pod_view(self, name: str, url: str, lora: Any) -> PodView:
        try:
            held = await lora_daemons.served_adapters(self.http, url, self.timeout)
        except lora_daemons.DaemonError as e:
            return PodView(name=name, url=url, lora=lora, error=str(e))
        return PodView(name=name, url=url, lora=lora, held=held)

    async def resync_if_needed(self, key: Key, base: BaseView, group: list[Adapter], now: float) -> None:
        """Re-render the base when its pod template lacks (or still has) an adapter's claim or folder."""
        wanted = lora_plan.wanted_sources(group).roots
        if base.template_roots is None or wanted == base.template_roots:
            return
        last = self.resynced.get(key)
        if last is not None and last[0] == wanted and now - last[1] < RESYNC_INTERVAL:
            return  # asked for these roots a moment ago: give the reconcile (and the watch) time
        self.resynced[key] = (wanted, now)
        async with self.locks.setdefault(key, asyncio.Lock()):
            body = await self.client.get(kube.inferencedeployment(*key))
            if body is None:
                return
            self.logger.info("LoRA: the adapters of %s/%s need other folders: reconciling its pods", *key)
            try:
                await reconcile(self.client, Cr.from_body(body), self.logger, status=dict(body.get("status") or {}))
            except (NotReady, Degraded) as e:
                self.logger.warning("LoRA: reconcile of %s/%s: %s", *key, e)

    # --- act ---------------------------------------------------------------------------------------------

    async def act(self, a: Adapter, plan: Plan, base: BaseView) -> None:
        if plan.add_finalizer and not await self.set_finalizer(a, add=True):
            return  # gone, or being deleted: nothing may be loaded without the finalizer
        urls = {p.name: p.url for p in base.pods}
        for pod in plan.load:
            self.start(a, pod, urls[pod], "load")
        for pod in plan.unload:
            self.start(a, pod, urls[pod], "unload")
        if plan.remove_finalizer:
            await self.set_finalizer(a, add=False)
            self.logger.info("LoRA: adapter %s/%s unloaded everywhere; finalizer removed", *a.key)
            return
        if not a.deleting and changed(a, status_patch(a, plan, now_iso())):
            await self.write_status(a, plan)

    def start(self, a: Adapter, pod: str, url: str, op: str) -> None:
        key = (a.key, pod, op)
        task = asyncio.create_task(self.call(a, pod, url, op), name=f"LoRA {op} {a.name} on {pod}")
        self.tasks[key] = task
        task.add_done_callback(lambda _t: self.tasks.pop(key, None))

    async def call(self, a: Adapter, pod: str, url: str, op: str) -> None:
        key = (a.key, pod, op)
        try:
            if op == "load":
                await lora_daemons.load(self.http, url, a.adapter_name, a.location.lora_path, self.load_timeout)
            else:
                await lora_daemons.unload(self.http, url, a.adapter_name, self.timeout)
        except lora_daemons.DaemonError as e:
            self.attempts[key] = lora_plan.failed(self.attempts.get(key), time.time(), str(e), e.reason)
            self.logger.warning("LoRA: %s of adapter %s on pod %s failed: %s", op, a.adapter_name, pod, e)
            metrics.LORA_OPERATIONS.labels(*a.key, op, "error").inc()
        else:
            self.attempts.pop(key, None)
            self.logger.info("LoRA: %sed adapter %s on pod %s", op, a.adapter_name, pod)
            metrics.LORA_OPERATIONS.labels(*a.key, op, "ok").inc()
        self.wake.set()

    async def set_finalizer(self, a: Adapter, add: bool) -> bool:
        """Add or remove ours, from a fresh read (its resourceVersion is the precondition). False when the
        object is gone, or when adding to one that is being deleted."""
        path = kube.loraadapter(*a.key)

        async def attempt() -> bool:
            live = await self.client.get(path)
            if live is None:
                return False
            meta = live.get("metadata") or {}
            finalizers = list(meta.get("finalizers") or [])
            if (FINALIZER in finalizers) == add:
                return True
            if add and meta.get("deletionTimestamp"):
                return False
            finalizers = [*finalizers, FINALIZER] if add else [f for f in finalizers if f != FINALIZER]
            body = {"metadata": {"finalizers": finalizers or None, "resourceVersion": meta.get("resourceVersion")}}
            await self.client.patch(path, body)
            return True

        return await kube.retry_on_conflict(attempt)

    async def write_status(self, a: Adapter, plan: Plan) -> None:
        path = kube.loraadapter(*a.key)

        async def attempt() -> None:
            live = await self.client.get(path)
            if live is None:
                return
            fresh = replace(a, status=dict(live.get("status") or {}))  # the plan's generation, today's status
            patch = status_patch(fresh, plan, now_iso())
            if changed(fresh, patch):
                rv = (live.get("metadata") or {}).get("resourceVersion")
                await self.client.patch(f"{path}/status", {"metadata": {"resourceVersion": rv}, "status": patch})

        await kube.retry_on_conflict(attempt)
