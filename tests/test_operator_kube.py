"""KubeClient against a small API server on 127.0.0.1 that keeps resourceVersions, answers Status objects
and checks the token, as a real one does."""

from __future__ import annotations

import json

import aiohttp.web
import kopf
import pytest

from kvpilot.operator import kube
from support.web_app import serving, start_app

pytestmark = pytest.mark.timeout(30)
DEP = "/apis/apps/v1/namespaces/ml/deployments"


def status(code: int, reason: str, message: str) -> aiohttp.web.Response:
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason, "message": message,
            "code": code}
    return aiohttp.web.json_response(body, status=code)


class ApiServer:
    def __init__(self, token: str = "good") -> None:
        self.token = token
        self.objects: dict[str, dict] = {}
        self.patches: list[tuple[str, dict, dict]] = []  # (content type, query, body)
        self.url = ""

    def put(self, name: str, labels: dict, replicas: int) -> None:
        self.objects[name] = {"metadata": {"name": name, "labels": labels, "resourceVersion": "1"},
                              "spec": {"replicas": replicas}}

    def bump(self, name: str, replicas: int) -> None:
        """Another writer."""
        meta = self.objects[name]["metadata"]
        meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)
        self.objects[name]["spec"]["replicas"] = replicas

    async def handle(self, request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return status(401, "Unauthorized", "bad token")
        name = request.match_info.get("name")
        if request.query.get("watch") == "true":
            resp = aiohttp.web.StreamResponse()
            await resp.prepare(request)
            for obj in self.objects.values():
                await resp.write(json.dumps({"type": "ADDED", "object": obj}).encode() + b"\n")
            return resp
        if name is None and request.method == "GET":
            wanted = dict(p.split("=") for p in request.query.get("labelSelector", "").split(",") if p)
            items = [o for o in self.objects.values()
                     if all(o["metadata"]["labels"].get(k) == v for k, v in wanted.items())]
            return aiohttp.web.json_response({"kind": "List", "items": items})
        if name not in self.objects:
            return status(404, "NotFound", f'deployments.apps "{name}" not found')
        obj = self.objects[name]
        if request.method == "PATCH":
            body = await request.json()
            self.patches.append((request.content_type, dict(request.query), body))
            rv = (body.get("metadata") or {}).get("resourceVersion")
            if rv is not None and rv != obj["metadata"]["resourceVersion"]:
                return status(409, "Conflict", "the object has been modified")
            self.bump(name, body.get("spec", {}).get("replicas", obj["spec"]["replicas"]))
        return aiohttp.web.json_response(obj)

    async def __aenter__(self) -> ApiServer:
        app = aiohttp.web.Application()
        app.router.add_route("*", DEP, self.handle)
        app.router.add_route("*", DEP + "/{name}", self.handle)
        self._runner, port = await start_app(app)
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._runner.cleanup()


async def test_typed_errors_and_not_found():
    async with ApiServer() as api, kube.KubeClient(api.url, token="good") as k:
        assert await k.get(f"{DEP}/missing") is None
        assert await k.delete(f"{DEP}/missing") is False
        with pytest.raises(kube.KubeApiError) as e:
            await k.patch(f"{DEP}/missing", {"spec": {}})
        assert (e.value.status, e.value.reason, e.value.not_found) == (404, "NotFound", True)
        assert "missing" in e.value.message and e.value.method == "PATCH"


async def test_label_selector_and_patch_kinds():
    async with ApiServer() as api, kube.KubeClient(api.url, token="good", field_manager="me") as k:
        api.put("a", {"app": "x", "tier": "1"}, 1)
        api.put("b", {"app": "y"}, 1)
        sel = kube.label_selector({"tier": "1", "app": "x"})
        assert sel == "app=x,tier=1"
        assert [o["metadata"]["name"] for o in await k.list(DEP, label_selector=sel)] == ["a"]
        for kind, ctype in kube.CONTENT_TYPES.items():
            await k.patch(f"{DEP}/a", {"spec": {"replicas": 2}}, kind)  # type: ignore[arg-type]
            assert api.patches[-1][0] == ctype
        assert api.patches[-1][1] == {"fieldManager": "me"}
        await k.patch(f"{DEP}/a", {"spec": {}}, "apply", manager="other", force=True)
        assert api.patches[-1][1] == {"fieldManager": "other", "force": "true"}


async def test_retry_on_conflict_reads_again_after_another_writer():
    async with ApiServer() as api, kube.KubeClient(api.url, token="good") as k:
        api.put("d", {}, 1)
        reads = []

        async def scale_up():
            live = await k.get(f"{DEP}/d")
            reads.append(live["metadata"]["resourceVersion"])
            if len(reads) == 1:
                api.bump("d", 5)  # someone writes between our read and our patch
            body = {"metadata": {"resourceVersion": live["metadata"]["resourceVersion"]},
                    "spec": {"replicas": live["spec"]["replicas"] + 1}}
            return await k.patch(f"{DEP}/d", body)

        result = await kube.retry_on_conflict(scale_up, delay=0.0)
        assert reads == ["1", "2"]
        assert result["spec"]["replicas"] == 6  # built on the other writer's 5, not on the stale 1


async def test_retry_on_conflict_gives_up_and_passes_other_errors():
    async with ApiServer() as api, kube.KubeClient(api.url, token="good") as k:
        api.put("d", {}, 1)
        calls = 0

        async def always_stale():
            nonlocal calls
            calls += 1
            return await k.patch(f"{DEP}/d", {"metadata": {"resourceVersion": "0"}})

        with pytest.raises(kube.KubeApiError) as e:
            await kube.retry_on_conflict(always_stale, attempts=3, delay=0.0)
        assert e.value.conflict and calls == 3

        async def missing():
            nonlocal calls
            calls += 1
            return await k.patch(f"{DEP}/nope", {})
        calls = 0
        with pytest.raises(kube.KubeApiError):
            await kube.retry_on_conflict(missing, delay=0.0)
        assert calls == 1


async def test_logs_in_again_once_on_401():
    async with ApiServer(token="new") as api:
        tokens = iter(["old", "new", "newer"])
        logins = []

        def login() -> kopf.ConnectionInfo:
            logins.append(1)
            return kopf.ConnectionInfo(server=api.url, token=next(tokens))

        api.put("d", {}, 1)
        async with kube.KubeClient(login) as k:
            assert (await k.get(f"{DEP}/d"))["metadata"]["name"] == "d"
            assert len(logins) == 2
            api.token = "never"
            with pytest.raises(kube.KubeApiError) as e:
                await k.get(f"{DEP}/d")
            assert e.value.status == 401 and len(logins) == 3  # one more login, then the error


async def test_watch_yields_events():
    async with ApiServer() as api, kube.KubeClient(api.url, token="good") as k:
        api.put("a", {}, 1)
        api.put("b", {}, 2)
        events = [e async for e in k.watch(DEP, timeout_seconds=1)]
        assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "a"), ("ADDED", "b")]


def test_paths():
    assert kube.collection("v1", "pods", "ml") == "/api/v1/namespaces/ml/pods"
    assert kube.collection("apps/v1", "deployments") == "/apis/apps/v1/deployments"
    assert kube.inferencedeployment("ml", "x") == "/apis/kvpilot.io/v1alpha1/namespaces/ml/inferencedeployments/x"
    assert kube.inferencedeployments() == "/apis/kvpilot.io/v1alpha1/inferencedeployments"


async def test_delete_sends_delete_options():
    seen = []

    async def handle(request: aiohttp.web.Request) -> aiohttp.web.Response:
        seen.append(await request.json() if request.can_read_body else None)
        return aiohttp.web.json_response({"kind": "Status", "status": "Success"})

    app = aiohttp.web.Application()
    app.router.add_delete("/api/v1/namespaces/ml/pods/{name}", handle)
    async with serving(app) as port, kube.KubeClient(f"http://127.0.0.1:{port}") as k:
        assert await k.delete("/api/v1/namespaces/ml/pods/p") is True
        assert await k.delete("/api/v1/namespaces/ml/pods/p", grace_period=0, uid="u-1",
                              propagation="Foreground") is True
    assert seen == [None, {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0,
                           "preconditions": {"uid": "u-1"}, "propagationPolicy": "Foreground"}]
