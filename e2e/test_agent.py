"""The node agent on its own, so that an e2e result never rests on a broken stand-in for Kubernetes.

Its containers here are a few lines of Python's http.server (not our code): /ready and /health answer 200,
SIGTERM exits after a short drain. The agent runs against the real kmock emulator.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from . import procs
from .agent import NODE_NAME, NodeAgent
from .cluster import deployments, pod_ready, pods, terminating
from .emulator import emulator
from .lifecycle import until
from .node import NodeSpec

pytestmark = pytest.mark.timeout(120)
NS = "agent-test"
NODE = NodeSpec(NODE_NAME)

SERVER = textwrap.dedent("""
    import http.server, signal, sys, threading, time
    host, port = sys.argv[sys.argv.index("--host") + 1], int(sys.argv[sys.argv.index("--port") + 1])
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path in ("/ready", "/health") else 404)
            self.end_headers()
        def log_message(self, *a):
            pass
    srv = http.server.ThreadingHTTPServer((host, port), H)
    def term(*_):
        print("draining", flush=True)
        threading.Thread(target=lambda: (time.sleep(0.3), srv.shutdown())).start()
    signal.signal(signal.SIGTERM, term)
    print("listening", host, port, flush=True)
    srv.serve_forever()
""")


def deployment(replicas: int) -> dict:
    probe = {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 1, "timeoutSeconds": 2,
             "failureThreshold": 1}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "web", "namespace": NS},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}, "annotations": {"a": "b"}},
                "spec": {
                    "nodeSelector": NODE.selector(), "tolerations": [NODE.toleration()],
                    "terminationGracePeriodSeconds": 5,
                    "containers": [{
                        "name": "web", "command": [sys.executable, "-c", SERVER],
                        "args": ["--host", "0.0.0.0", "--port", "8000", "--x", "$(GREETING)"],
                        "ports": [{"name": "http", "containerPort": 8000}],
                        "env": [{"name": "GREETING", "value": "hi"}, {"name": "CACHE", "value": "/cache/sub"}],
                        "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
                        "resources": {"limits": {"cpu": "500m"}},
                        "readinessProbe": probe,
                        "livenessProbe": {**probe, "httpGet": {"path": "/health", "port": "http"}},
                        "lifecycle": {"preStop": {"exec": {"command": ["sleep", "0.5"]}}},
                    }],
                    "volumes": [{"name": "cache", "emptyDir": {}}],
                },
            },
        },
    }


async def test_replicas_probes_crash_restart_and_graceful_scale_down(tmp_path: Path) -> None:
    stop = asyncio.Event()
    async with emulator() as kube:
        agent = NodeAgent(kube, NS, tmp_path)
        task = asyncio.create_task(agent.run(stop))
        try:
            await kube.create(deployments(NS), deployment(2))

            async def ready_pods() -> list[dict]:
                return [p for p in await kube.list(pods(NS)) if pod_ready(p) and not terminating(p)]
            two = await until(lambda: _at_least(ready_pods, 2), 30, "two Ready pods")
            ips = {p["status"]["podIP"] for p in two}
            assert len(ips) == 2 and all(ip.startswith("127.0.0.") and ip != "127.0.0.1" for ip in ips)
            for p in two:
                assert p["metadata"]["annotations"] == {"a": "b"}
                assert p["metadata"]["labels"]["app"] == "web"
            dep = await until(lambda: _dep_ready(kube, 2), 10, "Deployment status 2/2")
            assert dep["status"]["replicas"] == 2

            # The kubelet's work on the container: address, $(VAR), volume path, CPU limit as threads.
            c = agent.containers[two[0]["metadata"]["name"]]
            assert c.argv[c.argv.index("--host") + 1] == c.ip and c.argv[-1] == "hi"
            assert c.env["CACHE"] == str(tmp_path / "pods" / c.pod / "volumes" / "cache" / "sub")
            assert c.env["OMP_NUM_THREADS"] == "1"

            # SIGKILL: the pod turns not-ready, then the same pod restarts in place and is Ready again.
            os.kill(c.proc.pid, signal.SIGKILL)
            await until(lambda: _pod_ready(kube, c.pod, False), 10, "killed pod not ready")
            back = await until(lambda: _pod_ready(kube, c.pod, True), 20, "restarted pod ready")
            assert back["status"]["containerStatuses"][0]["restartCount"] == 1
            assert back["status"]["containerStatuses"][0]["lastState"]["terminated"]["exitCode"] == -9
            assert back["status"]["podIP"] == c.ip

            # Scale to 1: one pod goes through preStop, SIGTERM and a clean exit before it is removed.
            await kube.patch(f"{deployments(NS)}/web", {"spec": {"replicas": 1}})
            await until(lambda: len(agent.endpoints()) == 1 and any(x.gone for x in agent.containers.values()),
                        20, "one pod removed")
            gone = next(x for x in agent.containers.values() if x.gone)
            steps = [e.what for e in agent.events_of(gone.pod)]
            assert steps[-6:] == ["delete", "terminating", "prestop", "sigterm", "exited", "removed"], (steps, agent.errors)
            assert gone.exit_code == 0
            assert gone.sigterm_at - gone.deleted_at >= 0.5  # the preStop hook ran first
            await until(lambda: _count(kube, 1), 10, "one Pod object left")
            await until(lambda: _dep_ready(kube, 1), 10, "Deployment status 1/1")
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
    assert all(x.proc.poll() is not None for x in agent.containers.values())
    assert not procs.live()


async def _at_least(fn, n: int) -> list[dict] | None:
    items = await fn()
    return items if len(items) >= n else None


async def _dep_ready(kube, n: int) -> dict | None:
    dep = await kube.get(f"{deployments(NS)}/web")
    st = (dep or {}).get("status") or {}
    return dep if st.get("readyReplicas") == n and st.get("replicas") == n else None


async def _pod_ready(kube, name: str, want: bool) -> dict | None:
    pod = await kube.get(f"{pods(NS)}/{name}")
    return pod if pod is not None and pod_ready(pod) == want else None


async def _count(kube, n: int) -> bool:
    return len(await kube.list(pods(NS))) == n
