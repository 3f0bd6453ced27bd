"""The LoRAAdapter controller on the strict emulator: the real operator, and daemons played by FakeDaemon
(operator_support/daemons.py) answering /v1/models and the load and unload routes on 127.0.0.x."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvpilot.operator.lora_plan import FINALIZER
from operator_support.daemons import FakeDaemon, add_daemon_pod
from operator_support.harness import CR_PATH, LORA_KEY, LORA_PATH, Cluster, cluster, eventually, operator

pytestmark = pytest.mark.timeout(120)
NS = "ml"


def base(name: str = "llm", enable_lora: bool = True, **engine: Any) -> dict[str, Any]:
    return {"apiVersion": "kvpilot.io/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"model": {"uri": "hf://org/m"}, "replicas": 2,
                     "engine": {"enableLora": enable_lora, **engine}}}


def adapter(name: str, uri: str, replicas: Any = "all", base_model: str = "llm", **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "kvpilot.io/v1alpha1", "kind": "LoRAAdapter", "metadata": {"name": name, "namespace": NS},
            "spec": {"baseModel": base_model, "uri": uri, "replicas": replicas, **spec}}


def condition(obj: dict[str, Any] | None, ctype: str) -> dict[str, Any]:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == ctype), {})


async def get_adapter(k: Cluster, name: str) -> dict[str, Any] | None:
    return await k.get(f"{LORA_PATH.format(ns=NS)}/{name}")


async def status_where(k: Cluster, name: str, what: str, check) -> dict[str, Any]:
    async def probe():
        obj = await get_adapter(k, name)
        return obj if obj is not None and check(obj.get("status") or {}, obj) else None
    return await eventually(probe, timeout=20, what=what)


@contextlib.asynccontextmanager
async def daemons(*hosts: str) -> AsyncIterator[list[FakeDaemon]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(FakeDaemon(h)) for h in hosts]


async def start_base(k: Cluster, **kw: Any) -> dict[str, Any]:
    await k.create_cr(NS, base(**kw))
    return await eventually(lambda: k.deployment(NS, kw.get("name", "llm")), what="Deployment")


async def test_loads_on_every_ready_pod_then_on_scale_out_and_after_a_restart(monkeypatch, tmp_path):
    hosts = ("127.0.0.11", "127.0.0.12", "127.0.0.13", "127.0.0.14")
    async with cluster(tmp_path) as k, daemons(*hosts) as (d1, d2, d3, starting):
        with operator(monkeypatch, tmp_path, k.url):
            await start_base(k)
            await add_daemon_pod(k, NS, "llm-a", "llm", d1)
            await add_daemon_pod(k, NS, "llm-b", "llm", d2)
            await add_daemon_pod(k, NS, "llm-s", "llm", starting, ready=False)  # still loading its model
            await k.call("POST", LORA_PATH.format(ns=NS), adapter("sql", "hf://org/sql-lora"))

            obj = await status_where(k, "sql", "loaded on both pods",
                                     lambda s, _o: s.get("loadedPods") == ["llm-a", "llm-b"])
            assert d1.loaded == d2.loaded == {"sql": "hf://org/sql-lora"}
            assert obj["status"]["readyReplicas"] == obj["status"]["desiredReplicas"] == 2
            assert obj["status"]["adapterName"] == "sql" and obj["status"]["observedGeneration"] == 1
            assert condition(obj, "Ready")["status"] == "True" and condition(obj, "LoadFailed")["status"] == "False"
            assert FINALIZER in obj["metadata"]["finalizers"]

            # Scale-out: a third pod becomes Ready and gets the adapter.
            await add_daemon_pod(k, NS, "llm-c", "llm", d3)
            await status_where(k, "sql", "loaded on the new pod", lambda s, _o: s.get("readyReplicas") == 3)
            assert d3.loaded == {"sql": "hf://org/sql-lora"}

            # A container restart: the same pod, Ready again, its daemon empty. Loaded again.
            d1.restart()
            await eventually(lambda: _holds(d1, "sql"), timeout=20, what="loaded again after the restart")
            assert d1.loads() == ["sql", "sql"] and d2.loads() == ["sql"]  # the others were left alone
            assert starting.calls == []  # a pod that is not Ready is not called


async def _holds(daemon: FakeDaemon, name: str) -> bool:
    return name in daemon.loaded


async def test_n_replicas_loads_on_n_pods_and_unloads_beyond(monkeypatch, tmp_path):
    async with cluster(tmp_path) as k, daemons("127.0.0.21", "127.0.0.22", "127.0.0.23") as ds:
        with operator(monkeypatch, tmp_path, k.url):
            await start_base(k)
            for i, d in enumerate(ds):
                await add_daemon_pod(k, NS, f"llm-{i}", "llm", d)
            await k.call("POST", LORA_PATH.format(ns=NS), adapter("chat", "hf://org/chat", replicas=2))
            obj = await status_where(k, "chat", "on two pods", lambda s, _o: s.get("readyReplicas") == 2)
            assert obj["status"]["desiredReplicas"] == 2
            holders = [d for d in ds if "chat" in d.loaded]
            assert len(holders) == 2 and condition(obj, "Ready")["status"] == "True"

            await k.call("PATCH", f"{LORA_PATH.format(ns=NS)}/chat", {"spec": {"replicas": 1}})
            obj = await status_where(k, "chat", "down to one pod",
                                     lambda s, _o: s.get("readyReplicas") == 1 and s.get("observedGeneration") == 2)
            kept = [d for d in ds if "chat" in d.loaded]
            assert len(kept) == 1 and kept[0] in holders  # a pod that held it keeps it: no churn
            assert sum(route == "unload" for d in ds for route, _ in d.calls) == 1

            await k.call("PATCH", f"{LORA_PATH.format(ns=NS)}/chat", {"spec": {"replicas": "all"}})
            await status_where(k, "chat", "on every pod", lambda s, _o: s.get("readyReplicas") == 3)
            assert all("chat" in d.loaded for d in ds)


async def test_delete_unloads_everywhere_then_drops_the_finalizer(monkeypatch, tmp_path):
    async with cluster(tmp_path) as k, daemons("127.0.0.31", "127.0.0.32") as (d1, d2):
        with operator(monkeypatch, tmp_path, k.url):
            await start_base(k)
            await add_daemon_pod(k, NS, "llm-a", "llm", d1)
            await add_daemon_pod(k, NS, "llm-b", "llm", d2)
            await k.call("POST", LORA_PATH.format(ns=NS), adapter("sql", "hf://org/sql-lora"))
            await k.call("POST", LORA_PATH.format(ns=NS), adapter("chat", "hf://org/chat"))
            await status_where(k, "sql", "loaded", lambda s, _o: s.get("readyReplicas") == 2)
            await status_where(k, "chat", "loaded", lambda s, _o: s.get("readyReplicas") == 2)

            await k.call("DELETE", f"{LORA_PATH.format(ns=NS)}/sql")
            await eventually(lambda: _gone(k, "sql"), timeout=20, what="the LoRAAdapter gone")
            assert d1.loaded == d2.loaded == {"chat": "hf://org/chat"}  # the other adapter stays
            assert [b for route, b in d1.calls if route == "unload"] == [{"lora_name": "sql"}]
        # The operator is stopped: its finalizer holds a deletion until it comes back (it must unload).
        await k.call("DELETE", f"{LORA_PATH.format(ns=NS)}/chat")
        held = await get_adapter(k, "chat")
        assert held is not None and held["metadata"].get("deletionTimestamp")


async def _gone(k: Cluster, name: str) -> bool:
    return await get_adapter(k, name) is None


async def test_a_refused_load_is_a_condition_with_the_daemons_message_and_is_retried(monkeypatch, tmp_path):
    async with cluster(tmp_path) as k, daemons("127.0.0.41") as (d1,):
        d1.refuse["bad"] = "LoRA adapter 'bad': rank 64 is above --max-lora-rank 16"
        with operator(monkeypatch, tmp_path, k.url):
            await start_base(k)
            await add_daemon_pod(k, NS, "llm-a", "llm", d1)
            await k.call("POST", LORA_PATH.format(ns=NS), adapter("bad", "hf://org/bad"))
            await k.call("POST", LORA_PATH.format(ns=NS), adapter("good", "hf://org/good"))
            obj = await status_where(k, "bad", "LoadFailed", lambda _s, o: condition(o, "LoadFailed").get("status") == "True")
            failed = condition(obj, "LoadFailed")
            assert failed["reason"] == "DaemonRefused"
            assert failed["message"] == "llm-a: LoRA adapter 'bad': rank 64 is above --max-lora-rank 16"
            assert condition(obj, "Ready")["status"] == "False" and obj["status"]["readyReplicas"] == 0
            # The failing adapter does not hold up the other one.
            await status_where(k, "good", "the other adapter loaded", lambda s, _o: s.get("readyReplicas") == 1)

            # Retried with a backoff (1 s, 2 s, ...): once the daemon takes it, the condition clears.
            del d1.refuse["bad"]
            obj = await status_where(k, "bad", "loaded on retry", lambda s, _o: s.get("readyReplicas") == 1)
            assert condition(obj, "LoadFailed")["status"] == "False" and condition(obj, "Ready")["status"] == "True"
            assert 2 <= d1.loads().count("bad") <= 6


async def test_a_base_without_lora_gets_a_condition_and_no_call(monkeypatch, tmp_path):
    async with cluster(tmp_path) as k, daemons("127.0.0.51") as (d1,):
        with operator(monkeypatch, tmp_path, k.url):
            await start_base(k, enable_lora=False)
            await add_daemon_pod(k, NS, "llm-a", "llm", d1)
            await k.call("POST", LORA_PATH.format(ns=NS), adapter("sql", "hf://org/sql-lora"))
            await k.call("POST", LORA_PATH.format(ns=NS), adapter("orphan", "hf://org/x", base_model="nothere"))
            obj = await status_where(k, "sql", "a condition", lambda _s, o: condition(o, "Ready").get("reason"))
            ready = condition(obj, "Ready")
            assert (ready["status"], ready["reason"]) == ("False", "LoRANotEnabled")
            assert "spec.engine.enableLora" in ready["message"]
            obj = await status_where(k, "orphan", "a condition", lambda _s, o: condition(o, "Ready").get("reason"))
            assert condition(obj, "Ready")["reason"] == "BaseNotFound"
            assert d1.calls == []
            dep = await k.deployment(NS, "llm")
            assert not [a for a in dep["spec"]["template"]["spec"]["containers"][0]["args"] if "lora" in a]


async def test_a_pvc_adapter_mounts_its_claim_and_waits_for_the_rolled_pods(monkeypatch, tmp_path):
    async with cluster(tmp_path) as k, daemons("127.0.0.61", "127.0.0.62") as (old, new):
        with operator(monkeypatch, tmp_path, k.url):
            await start_base(k)
            await add_daemon_pod(k, NS, "llm-old", "llm", old)  # started before the adapter existed
            await k.call("POST", LORA_PATH.format(ns=NS), adapter("sql", "pvc://adapters/team/sql"))

            async def mounted():
                dep = await k.deployment(NS, "llm")
                pod = dep["spec"]["template"]["spec"]
                vols = [v for v in pod["volumes"] if v.get("persistentVolumeClaim", {}).get("claimName") == "adapters"]
                return dep if vols else None
            dep = await eventually(mounted, timeout=20, what="the claim in the pod template")
            pod = dep["spec"]["template"]["spec"]
            assert {"name": "lora-adapters", "persistentVolumeClaim": {"claimName": "adapters", "readOnly": True}} \
                in pod["volumes"]
            mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "lora-adapters")
            assert mount == {"name": "lora-adapters", "mountPath": "/adapters/pvc/adapters", "readOnly": True}
            args = pod["containers"][0]["args"]
            assert args[args.index("--lora-root") + 1] == "/adapters/pvc/adapters"

            await status_where(k, "sql", "waiting for the rollout",
                                     lambda _s, o: condition(o, "Ready").get("reason") == "WaitingForRollout")
            assert old.calls == []  # its daemon may not read the claim: no load that must fail
            await add_daemon_pod(k, NS, "llm-new", "llm", new)  # the rolled pod
            await status_where(k, "sql", "loaded on the new pod", lambda s, _o: s.get("loadedPods") == ["llm-new"])
            assert new.loaded == {"sql": "/adapters/pvc/adapters/team/sql"}

            # The last adapter from the claim goes: so does the volume.
            await k.call("DELETE", f"{LORA_PATH.format(ns=NS)}/sql")
            await eventually(lambda: _gone(k, "sql"), timeout=20, what="the LoRAAdapter gone")

            async def unmounted():
                dep = await k.deployment(NS, "llm")
                return "--lora-root" not in dep["spec"]["template"]["spec"]["containers"][0]["args"]
            await eventually(unmounted, timeout=30, what="the claim out of the pod template")


async def test_the_operator_runs_without_the_loraadapter_crd(monkeypatch, tmp_path):
    """`helm upgrade` does not install a new CRD: the InferenceDeployments are served as before."""
    async with cluster(tmp_path, without=(LORA_KEY,)) as k:
        with operator(monkeypatch, tmp_path, k.url):
            dep = await start_base(k)
            args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
            assert "--enable-lora" in args and "--lora-root" not in args

            async def reconciled():
                obj = await k.cr(NS, "llm")
                return ((obj or {}).get("status") or {}).get("observedGeneration") == 1
            await eventually(reconciled, what="the status")
            await k.delete_cr(NS, "llm")
            assert await k.get(f"{CR_PATH.format(ns=NS)}/llm") is None
