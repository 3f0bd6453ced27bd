"""Forwarding one client request: hold while no replica is ready, pick, send, retry, stream back unbuffered.

Retries happen only before the client has seen a byte: a connect error, a 503 (draining, engine dead)
or a connection lost before the whole non-streamed body arrived is retried once on another replica;
a 429 moves on to the next replica until every one has said 429. A stream cut by its replica ends
with an SSE error event and [DONE], never a silent truncation.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError
from multidict import CIMultiDict

from .endpoints import Endpoint
from .picker import Decision
from .state import RouteKey, RouterState

log = logging.getLogger("kvpilot.router")

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                        "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length",
                        # aiohttp decodes bodies both ways, so the encoding no longer describes what is sent.
                        "content-encoding"})
UPSTREAM_ERRORS = (aiohttp.ClientError, TimeoutError, ConnectionError)


@dataclass(frozen=True)
class ProxyConfig:
    hold_max: int = 256  # requests held at once while no replica is ready
    hold_timeout: float = 30.0  # seconds a request is held before a 503
    connect_timeout: float = 3.0
    retry_after: int = 1  # seconds, when the replicas gave none
    max_failure_retries: int = 1
    cooldown: float = 2.0  # seconds a replica that failed or said 503 is skipped by new requests


@dataclass
class _Attempts:
    tried: set[str] = field(default_factory=set)
    failures: int = 0
    throttled: list[int] = field(default_factory=list)  # Retry-After seconds of each 429
    last_error: web.Response | None = None
    started: bool = False  # the client has the response head: no retry from here on


def error_response(status: int, message: str, code: str, retry_after: int | None = None,
                   err_type: str = "service_unavailable_error") -> web.Response:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else {}
    body = {"error": {"message": message, "type": err_type, "param": None, "code": code}}
    return web.json_response(body, status=status, headers=headers)


def _forward_headers(headers: Any) -> CIMultiDict[str]:
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in HOP_BY_HOP)


def _retry_after(headers: Any, default: int) -> int:
    try:
        return max(0, int(float(headers.get("Retry-After", default))))
    except ValueError:
        return default


class Proxy:
    def __init__(self, state: RouterState, session: aiohttp.ClientSession, config: ProxyConfig) -> None:
        self.state = state
        self.session = session
        self.config = config
        self.held = 0
        self.timeout = aiohttp.ClientTimeout(total=None, connect=config.connect_timeout,
                                             sock_connect=config.connect_timeout)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            raw = await request.read()
        except (RequestPayloadError, HttpProcessingError) as exc:  # e.g. a body labelled gzip that is not
            resp = error_response(400, f"could not read the request body: {exc}", "invalid_body",
                                  err_type="invalid_request_error")
            resp.force_close()  # the rest of the body cannot be read, so the connection cannot be reused
            return self._count(resp)
        body = _json_object(raw) if request.method == "POST" else None
        started = time.perf_counter()
        key = await self.state.route_key(request.path, body, request.headers)
        decided = time.perf_counter() - started  # wall time, a wait for a tokenizer thread included
        if not await self._hold():
            return self._count(error_response(503, "no replica is ready; retry later", "no_ready_replica",
                                              self.config.retry_after))
        att = _Attempts()
        while True:
            started = time.perf_counter()
            chosen = self.state.choose(key, att.tried)
            if not att.tried:  # the first pick is the router's overhead; retries are the replicas' doing
                self.state.metrics.decision_time(key.tokenized, decided + time.perf_counter() - started)
            if chosen is None:
                return self._count(self._exhausted(att))
            ep, decision = chosen
            att.tried.add(ep.name)
            resp = await self._attempt(request, raw, key, ep, decision, att)
            if resp is not None:
                return self._count(resp)

    def _count(self, resp: web.StreamResponse) -> web.StreamResponse:
        self.state.metrics.responses.labels(str(resp.status)).inc()
        return resp

    async def _hold(self) -> bool:
        """With no ready replica, wait (bounded in count and time) for one to appear."""
        if len(self.state.endpoints):
            return True
        m = self.state.metrics
        if self.held >= self.config.hold_max:
            m.held_timeouts.labels("full").inc()
            return False
        self.held += 1
        m.held.set(self.held)
        try:
            ok = await self.state.endpoints.wait_nonempty(self.config.hold_timeout)
        finally:
            self.held -= 1
            m.held.set(self.held)
        if not ok:
            m.held_timeouts.labels("timeout").inc()
        return ok

    def _exhausted(self, att: _Attempts) -> web.Response:
        if att.throttled:  # every replica that answered said 429
            return error_response(429, "all replicas are at capacity; retry later", "rate_limited",
                                  min(att.throttled), err_type="rate_limit_error")
        if att.last_error is not None:
            return att.last_error
        return error_response(503, "no replica could take the request; retry later", "no_ready_replica",
                              self.config.retry_after)

    async def _attempt(self, request: web.Request, raw: bytes, key: RouteKey, ep: Endpoint, d: Decision,
                       att: _Attempts) -> web.StreamResponse | None:
        """One try on one replica: the response to send, or None to try the next replica."""
        st = self.state
        st.dispatched(ep, d, key)
        try:
            async with self.session.request(request.method, ep.url + request.path_qs, data=raw or None,
                                            headers=_forward_headers(request.headers),
                                            timeout=self.timeout) as up:
                if up.status in (429, 503):
                    return await self._refused(up, ep, att)
                st.accepted(key, ep, d)
                if "text/event-stream" in up.headers.get("Content-Type", ""):
                    # Until the first token the client has seen nothing, so a replica that dies while the
                    # request is only queued there (the daemon sends headers and a role chunk at once)
                    # is retried like a refused connection.
                    head = await _until_first_token(up)
                    if head is None:
                        return self._failed(ep, att, "connect_error", "the stream ended before its first token")
                    att.started = True
                    return await self._stream(request, up, ep, d, head)
                body = await up.read()  # a whole JSON answer: small, and retryable until it is complete
                return self._plain(up, body, ep, d)
        except UPSTREAM_ERRORS as exc:
            if att.started:  # the client went away mid-stream
                raise
            return self._failed(ep, att, "connect_error", f"{type(exc).__name__}: {exc}")
        finally:
            st.finished(ep, d, key)

    async def _refused(self, up: aiohttp.ClientResponse, ep: Endpoint, att: _Attempts) -> web.Response | None:
        body = await up.read()
        if up.status == 429:
            att.throttled.append(_retry_after(up.headers, self.config.retry_after))
            self.state.metrics.retries.labels("429").inc()
            return None
        headers = _forward_headers(up.headers)
        headers.setdefault("Retry-After", str(self.config.retry_after))
        resp = web.Response(status=up.status, body=body, headers=headers)
        return self._failed(ep, att, "503", body[:200].decode(errors="replace"), resp)

    def _failed(self, ep: Endpoint, att: _Attempts, cause: str, detail: str,
                resp: web.Response | None = None) -> web.Response | None:
        log.warning("replica failed", extra={"fields": {"endpoint": ep.name, "cause": cause, "detail": detail}})
        self.state.failed(ep.name, self.config.cooldown)
        att.last_error = resp or error_response(503, f"replica {ep.name} failed: {detail}", "upstream_unavailable",
                                                self.config.retry_after)
        att.failures += 1
        if att.failures > self.config.max_failure_retries:
            return att.last_error
        self.state.metrics.retries.labels(cause).inc()
        return None

    def _plain(self, up: aiohttp.ClientResponse, body: bytes, ep: Endpoint, d: Decision) -> web.Response:
        headers = _forward_headers(up.headers)
        headers["X-Kvpilot-Endpoint"], headers["X-Kvpilot-Route"] = ep.name, d.reason
        return web.Response(status=up.status, body=body, headers=headers)

    async def _stream(self, request: web.Request, up: aiohttp.ClientResponse, ep: Endpoint,
                      d: Decision, head: bytes) -> web.StreamResponse:
        headers = _forward_headers(up.headers)
        headers["X-Kvpilot-Endpoint"], headers["X-Kvpilot-Route"] = ep.name, d.reason
        resp = web.StreamResponse(status=up.status, headers=headers)
        await resp.prepare(request)
        await resp.write(head)
        tail = head[-32:]
        error: str | None = None
        while True:
            try:
                chunk = await up.content.readany()
            except UPSTREAM_ERRORS as exc:
                error = f"{type(exc).__name__}: {exc}"
                break
            if not chunk:
                break
            await resp.write(chunk)  # as it comes: no buffering between the replica and the client
            tail = (tail + chunk)[-32:]
        if error is None and up.status == 200 and b"[DONE]" not in tail:
            error = "the stream ended before [DONE]"
        if error is not None:
            await self._stream_error(resp, ep, error)
        await resp.write_eof()
        return resp

    async def _stream_error(self, resp: web.StreamResponse, ep: Endpoint, detail: str) -> None:
        self.state.metrics.stream_errors.inc()
        log.warning("stream cut by its replica", extra={"fields": {"endpoint": ep.name, "detail": detail}})
        err = {"error": {"message": f"the replica serving this stream failed: {detail}",
                         "type": "service_unavailable_error", "param": None, "code": "replica_failed"}}
        # a blank line first ends any event the replica left half-written
        await resp.write(b"\n\ndata: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n")


async def _until_first_token(up: aiohttp.ClientResponse) -> bytes | None:
    """What the replica streams up to and including its first event that carries output (or an error, or
    [DONE]); None when the stream ends before one. Raises the upstream's errors."""
    buf = b""
    while True:
        chunk = await up.content.readany()
        if not chunk:
            return buf if b"[DONE]" in buf else None
        buf += chunk
        events = buf.replace(b"\r\n", b"\n").split(b"\n\n")[:-1]  # the last part may be incomplete
        if any(_carries_output(e) for e in events):
            return buf


def _carries_output(event: bytes) -> bool:
    """False only for a role-only chat chunk: everything else (text, tool calls, an error, a finish, usage,
    [DONE], or something unparsable) is something the client must see as it is."""
    data = event.strip().removeprefix(b"data:").strip()
    if not data:
        return False
    obj = _json_object(data)
    if obj is None or "error" in obj or obj.get("usage"):
        return True
    for choice in obj.get("choices") or []:
        delta = choice.get("delta") or {}
        if choice.get("finish_reason") or choice.get("text") or any(v for k, v in delta.items() if k != "role"):
            return True
    return not obj.get("choices")


def _json_object(raw: bytes) -> dict[str, Any] | None:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return body if isinstance(body, dict) else None

