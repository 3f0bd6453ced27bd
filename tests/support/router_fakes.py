"""A tiny real aiohttp upstream that speaks the daemon's shapes: for the router's tests and its bench.

It answers /v1/chat/completions and /v1/completions (streamed or not), /v1/models and /metrics, and
can be told to refuse (503 draining, 429), or to die in the middle of a stream. It serves the base model
`m` and the LoRA adapters it is told to list (vLLM's shapes: a /v1/models entry with `parent`, the
`vllm:lora_requests_info` series); any other model name gets the daemon's 404.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvpilot.router.prompt import ByteTokenizer
from support.web_app import start_app


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


@dataclass
class ReplicaBehaviour:
    status: int | None = None  # answer every /v1 POST with this (503, 429) instead of a completion
    retry_after: str | None = None
    chunks: int = 3  # streamed content chunks
    chunk_delay: float = 0.0
    die_after: int | None = None  # close the connection after this many streamed chunks
    role_chunk: bool = False  # start chat streams with a role-only chunk, as the daemon does
    gate: asyncio.Event | None = None  # the second chunk waits for this (proves unbuffered streaming)
    kv: float = 0.0
    waiting: float = 0.0
    running: float = 0.0
    adapters: tuple[str, ...] = ()  # listed in /v1/models with parent "m", and served
    max_lora: int = 0
    lora_running: tuple[str, ...] = ()  # vllm:lora_requests_info's running_lora_adapters
    lora_waiting: tuple[str, ...] = ()


@dataclass
class FakeReplica:
    host: str = "127.0.0.1"
    name: str = "replica"
    behaviour: ReplicaBehaviour = field(default_factory=ReplicaBehaviour)
    port: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)
    cancelled: int = 0  # streams whose client (the router) hung up
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        b = self.behaviour
        model = body.get("model")
        if model is not None and model != "m" and model not in b.adapters:
            return web.json_response({"error": {"message": f"The model `{model}` does not exist.",
                                                "type": "invalid_request_error", "param": "model",
                                                "code": "model_not_found"}}, status=404)
        if b.status is not None:
            headers = {"Retry-After": b.retry_after} if b.retry_after else {}
            code = "draining" if b.status == 503 else "rate_limited"
            return web.json_response({"error": {"message": "refused", "type": "x", "param": None, "code": code}},
                                     status=b.status, headers=headers)
        chat = request.path.endswith("/chat/completions")
        if body.get("stream"):
            return await self._stream(request, chat)
        choice = ({"index": 0, "message": {"role": "assistant", "content": f"hi from {self.name}"},
                   "finish_reason": "stop"} if chat else {"index": 0, "text": f"hi from {self.name}",
                                                          "finish_reason": "stop"})
        return web.json_response({"id": "x-1", "object": "chat.completion" if chat else "text_completion",
                                  "created": int(time.time()), "model": "m", "choices": [choice],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    def _chunk(self, chat: bool, text: str, finish: str | None = None) -> dict[str, Any]:
        choice = ({"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish} if chat
                  else {"index": 0, "text": text, "finish_reason": finish})
        return {"id": "x-1", "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": "m", "choices": [choice]}

    async def _stream(self, request: web.Request, chat: bool) -> web.StreamResponse:
        b = self.behaviour
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        if chat and b.role_chunk:
            role = self._chunk(chat, "")
            role["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            await resp.write(_sse(role))
        for i in range(b.chunks):
            if b.die_after is not None and i >= b.die_after:
                assert request.transport is not None
                request.transport.close()  # the replica dies: no [DONE], a cut connection
                return resp
            if i == 1 and b.gate is not None:
                try:
                    await b.gate.wait()
                except asyncio.CancelledError:  # as the daemon, the handler is cancelled on a hang-up
                    self.cancelled += 1
                    raise
            if b.chunk_delay:
                await asyncio.sleep(b.chunk_delay)
            await resp.write(_sse(self._chunk(chat, f"{self.name}-{i} ")))
        await resp.write(_sse(self._chunk(chat, "", "stop")) + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _metrics(self, request: web.Request) -> web.Response:  # noqa: ARG002 - handler signature
        b = self.behaviour
        text = (f'vllm:kv_cache_usage_perc{{model_name="m"}} {b.kv}\n'
                f'vllm:num_requests_waiting{{model_name="m"}} {b.waiting}\n'
                f'vllm:num_requests_running{{model_name="m"}} {b.running}\n'
                f'vllm:lora_requests_info{{max_lora="{b.max_lora}",running_lora_adapters="{",".join(b.lora_running)}",'
                f'waiting_lora_adapters="{",".join(b.lora_waiting)}"}} {time.time()}\n')
        return web.Response(text=text, content_type="text/plain")

    async def _models(self, request: web.Request) -> web.Response:  # noqa: ARG002 - handler signature
        cards = [{"id": "m", "object": "model", "created": 0, "owned_by": self.name, "root": "m", "parent": None}]
        cards += [{"id": a, "object": "model", "created": 0, "owned_by": self.name, "root": f"/adapters/{a}",
                   "parent": "m"} for a in self.behaviour.adapters]
        return web.json_response({"object": "list", "data": cards})

    async def start(self) -> FakeReplica:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._completion)
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        self._runner, self.port = await start_app(app, self.host, self.port, access_log=None,
                                                  handler_cancellation=True)
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


class SlowTokenizer(ByteTokenizer):
    """UTF-8 bytes, but a text of `slow_chars` or more takes `delay` seconds to encode, in a sleep that
    releases the GIL as a Hugging Face fast tokenizer's Rust encode does: a long prompt's tokenization,
    stretched so that a stall of the event loop is unmistakable."""

    releases_gil = True  # what router/tokenize_pool.py asks before it uses a worker thread

    def __init__(self, delay: float, slow_chars: int) -> None:
        self.delay = delay
        self.slow_chars = slow_chars
        self.slow_threads: list[str] = []  # the thread each slow encode ran on
        self.inline_threads: list[str] = []  # ... and each fast one

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) >= self.slow_chars:
            self.slow_threads.append(threading.current_thread().name)
            time.sleep(self.delay)
        else:
            self.inline_threads.append(threading.current_thread().name)
        return super().encode(text, add_special_tokens)


@dataclass
class RouterServer:
    """The real router app on loopback, port 0."""

    settings: Any  # RouterSettings
    tokenizer: Any = None
    host: str = "127.0.0.1"
    port: int = 0
    app: web.Application | None = None
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> RouterServer:
        from kvpilot.router.server import build_app

        self.app = build_app(self.settings, tokenizer=self.tokenizer)
        self._runner, self.port = await start_app(self.app, self.host, access_log=None, handler_cancellation=True)
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


async def router_metric(rs: RouterServer, name: str, **labels: str) -> float:
    """The sum of the router's ``name`` samples whose labels include ``labels``."""
    import aiohttp
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession() as s, s.get(rs.url + "/metrics") as r:
        text = await r.text()
    return sum(smp.value for fam in text_string_to_metric_families(text) for smp in fam.samples
               if smp.name == name and all(smp.labels.get(k) == v for k, v in labels.items()))


async def until(cond: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    """Poll ``cond`` until it holds; an assertion naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)
