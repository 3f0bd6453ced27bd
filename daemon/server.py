"""The aiohttp application: routes, auth, error bodies, request logs, probes, metrics and SIGTERM drain."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvpilot.common.errors import APIError
from kvpilot.listen import start_app
from kvpilot.version import __version__

from .args import ServeArgs
from .async_engine import AsyncEngine
from .engine.executor.layout import node_layout
from .http_errors import to_api_error
from .lora_registry import Adapter, LoRARegistry
from .lora_routes import LoRARoutes
from .metrics import CONTENT_TYPE, DaemonMetrics
from .request_log import REQUEST_LOG_FIELDS, REQUEST_STARTED_AT
from .served_names import served_names
from .serving import OpenAIServing
from .tokenize_routes import TokenizeRoutes

log = logging.getLogger("kvpilot.daemon")
request_log = logging.getLogger("kvpilot.daemon.requests")

MAX_BODY_BYTES = 32 * 1024 * 1024
_HTTP_ERROR_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large",
                     415: "unsupported_media_type"}

STATE_KEY = web.AppKey("state", object)


@dataclass
class ServerState:
    args: ServeArgs
    engine: AsyncEngine
    metrics: DaemonMetrics
    serving: OpenAIServing
    loras: LoRARegistry
    adapters_loaded: bool = True  # False until the --lora-modules adapters are in: /ready waits for them
    draining: bool = False
    inflight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    started: float = field(default_factory=time.time)


def _error_response(err: APIError, close: bool = False) -> web.Response:
    headers = dict(err.headers)
    if close:
        headers["Connection"] = "close"
    resp = web.json_response(err.body(), status=err.status, headers=headers)
    if headers.get("Connection") == "close":  # the header alone would not stop aiohttp's keep-alive
        resp.force_close()
    return resp


def _state(request: web.Request) -> ServerState:
    return server_state(request.app)


@web.middleware
async def errors_and_logs(request: web.Request, handler) -> web.StreamResponse:
    """Outermost: every failure becomes an OpenAI error body; every /v1 request gets one log line."""
    request[REQUEST_STARTED_AT] = time.monotonic()
    request[REQUEST_LOG_FIELDS] = {}
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    except web.HTTPException as exc:
        status = exc.status
        if exc.status < 400:
            raise
        err = _http_exception_error(exc)
        request[REQUEST_LOG_FIELDS]["error"] = err.message
        return _error_response(err)
    except asyncio.CancelledError:
        status = 499  # client closed the connection
        request[REQUEST_LOG_FIELDS].setdefault("outcome", "client_disconnected")
        raise
    except ConnectionError:
        status = 499
        request[REQUEST_LOG_FIELDS].setdefault("outcome", "client_disconnected")
        raise
    except Exception as exc:  # noqa: BLE001 - a bug must not become a dropped connection
        err = to_api_error(exc)
        if err is None:
            log.exception("unhandled error in %s %s", request.method, request.path)
            request[REQUEST_LOG_FIELDS]["error"] = f"{type(exc).__name__}: {exc}"
            return _error_response(APIError("internal server error", status=500, error_type="internal_error",
                                             code="internal_error"))
        status = err.status  # a domain error (bad input, overload, engine down) or an APIError
        request[REQUEST_LOG_FIELDS]["error"] = err.message
        return _error_response(err, close=_state(request).draining)
    finally:
        _log_request(request, status)


def _http_exception_error(exc: web.HTTPException) -> APIError:
    """aiohttp's own 4xx (unknown route, wrong method, body too large) as an OpenAI error body."""
    message = exc.reason if exc.status != 413 else f"request body too large (limit {MAX_BODY_BYTES} bytes)"
    err = APIError(message, status=exc.status, code=_HTTP_ERROR_CODES.get(exc.status))
    if "Allow" in exc.headers:
        err.headers["Allow"] = exc.headers["Allow"]
    return err


def _log_request(request: web.Request, status: int) -> None:
    """The one structured log line of a /v1 request."""
    st = _state(request)
    if _guarded(request.path) and not st.args.disable_log_requests:
        fields: dict[str, Any] = {"event": "request", "method": request.method, "path": request.path,
                                  "status": status, "client": request.remote,
                                  "latency_s": round(time.monotonic() - request[REQUEST_STARTED_AT], 4)}
        fields.update(request[REQUEST_LOG_FIELDS])
        request_log.info("request", extra={"fields": fields})


@web.middleware
async def auth_and_drain(request: web.Request, handler) -> web.StreamResponse:
    """/v1/* and /tokenize, /detokenize need the API key (when set), are refused while draining, and
    count as in flight."""
    if not _guarded(request.path):
        return await handler(request)
    st = _state(request)
    key = st.args.api_key
    if key:
        got = request.headers.get("Authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError("Incorrect or missing API key. Send 'Authorization: Bearer <key>'.", status=401,
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    if st.draining:
        st.metrics.rejected("draining")
        raise APIError("the server is shutting down; retry on another replica", status=503,
                       error_type="service_unavailable_error", code="draining", headers={"Connection": "close"})
    st.inflight += 1
    st.idle.clear()
    try:
        return await handler(request)
    finally:
        st.inflight -= 1
        if st.inflight == 0:
            st.idle.set()


_GUARDED_ROOT_PATHS = frozenset({"/tokenize", "/detokenize"})


def _guarded(path: str) -> bool:
    """The API routes: /v1/* and the root tokenizer routes (they run the model's tokenizer)."""
    return path.startswith("/v1/") or path in _GUARDED_ROOT_PATHS


async def health(request: web.Request) -> web.Response:
    eng = _state(request).engine
    if eng.alive:
        return web.json_response({"status": "ok", "engine": eng.state.value})
    return web.json_response({"status": "dead", "engine": eng.state.value, "error": eng.error}, status=503)


async def ready(request: web.Request) -> web.Response:
    st = _state(request)
    if st.draining:
        return web.json_response({"status": "draining"}, status=503)
    if not st.engine.ready:
        return web.json_response({"status": st.engine.state.value}, status=503)
    if not st.adapters_loaded:
        return web.json_response({"status": "loading_adapters"}, status=503)
    return web.json_response({"status": "ready"})


async def metrics_route(request: web.Request) -> web.Response:
    body = _state(request).metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def version(_request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


def _model_card(st: ServerState, name: str, root: str | None = None, parent: str | None = None) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": int(st.started), "owned_by": "kvpilot",
            "root": root or st.args.model, "parent": parent, "max_model_len": st.engine.max_model_len or None}


def _adapter_card(st: ServerState, adapter: Adapter) -> dict[str, Any]:
    """vLLM's shape: the adapter's path as root, the base model (its primary name) as parent."""
    return _model_card(st, adapter.name, adapter.source, adapter.parent or st.serving.names.primary)


async def list_models(request: web.Request) -> web.Response:
    st = _state(request)
    cards = [_model_card(st, n) for n in st.serving.names.listed]
    cards += [_adapter_card(st, a) for a in st.loras.adapters]
    return web.json_response({"object": "list", "data": cards})


async def get_model(request: web.Request) -> web.Response:
    st = _state(request)
    name = request.match_info["model"]
    lora = st.serving.check_model(name)  # the 404 for a name that is neither the base nor an adapter
    if lora is None:
        return web.json_response(_model_card(st, name))
    return web.json_response(next(_adapter_card(st, a) for a in st.loras.adapters if a.name == lora.lora_name))


def build_app(args: ServeArgs, engine: AsyncEngine | None = None) -> web.Application:
    """The application; the engine is created (not started) here unless one is passed in."""
    names = served_names(args.model, args.served_model_name)
    daemon_metrics = DaemonMetrics(names.primary)
    config = args.engine_config()
    if engine is None:
        engine = AsyncEngine(config, max_queued_requests=args.max_queued_requests,
                             max_queued_tokens=args.max_queued_tokens, metrics=daemon_metrics,
                             ready_before_kv_cache_mapped=args.ready_before_kv_cache_mapped)
    else:
        engine.metrics = daemon_metrics
    daemon_metrics.block_size = config.block_size
    daemon_metrics.enable_prefix_caching = config.enable_prefix_caching
    daemon_metrics.stats_fn = lambda: engine.stats
    daemon_metrics.queued_fn = lambda: engine.num_queued
    loras = LoRARegistry(engine, names, args.lora_root)
    serving = OpenAIServing(engine, names, config.scheduling_policy, config.max_num_seqs,
                            enable_auto_tool_choice=args.enable_auto_tool_choice,
                            tool_call_parser=args.tool_call_parser, loras=loras)
    app = web.Application(middlewares=[errors_and_logs, auth_and_drain], client_max_size=MAX_BODY_BYTES)
    state = ServerState(args=args, engine=engine, metrics=daemon_metrics, serving=serving, loras=loras,
                        adapters_loaded=not args.lora_modules)
    state.idle.set()
    app[STATE_KEY] = state
    app.router.add_post("/v1/completions", serving.completions)
    app.router.add_post("/v1/chat/completions", serving.chat)
    tokenize = TokenizeRoutes(engine, serving.check_model, serving.chat_prompt)
    app.router.add_post("/tokenize", tokenize.tokenize)
    app.router.add_post("/detokenize", tokenize.detokenize)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_get("/version", version)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics_route)
    if args.allow_runtime_lora_updating:  # without it the routes do not exist (404), as in vLLM
        LoRARoutes(loras).add_to(app.router)
    return app


def server_state(app: web.Application) -> ServerState:
    return app[STATE_KEY]  # type: ignore[return-value]


async def start_engine(app: web.Application) -> None:
    """Load the model; afterwards the metrics carry the served model name."""
    st = server_state(app)
    await st.engine.start()
    st.metrics.model_name = st.serving.model_name
    log.info("model loaded", extra={"fields": {"model": st.args.model, "served_model_name": st.serving.model_name,
                                               "max_model_len": st.engine.max_model_len,
                                               "kv_capacity_tokens": st.engine.kv_capacity_tokens}})
    await load_startup_adapters(st)


async def load_startup_adapters(st: ServerState) -> None:
    """The --lora-modules adapters, right after the model and before /ready says ready. The operator named
    them, so their paths need no --lora-root; one that cannot be served stops the start, named."""
    for module in st.args.lora_modules:
        try:
            adapter = await st.loras.load(module.name, module.path, trusted=True, parent=module.base_model_name)
        except Exception as exc:
            raise RuntimeError(f"--lora-modules {module.name}={module.path}: {exc}") from exc
        log.info("adapter loaded", extra={"fields": {"lora_name": adapter.name, "lora_path": module.path,
                                                     "lora_int_id": adapter.request.lora_int_id}})
    st.adapters_loaded = True


async def drain(app: web.Application, timeout: float) -> None:
    """Refuse new work, let in-flight requests finish for up to `timeout` s, then abort the rest."""
    st = server_state(app)
    st.draining = True
    log.info("draining", extra={"fields": {"inflight": st.inflight, "timeout_s": timeout}})
    try:
        await asyncio.wait_for(st.idle.wait(), timeout)
    except TimeoutError:
        n = st.engine.abort_all("shutdown timeout")
        log.warning("shutdown timeout: aborted requests", extra={"fields": {"aborted": n}})
        with contextlib.suppress(TimeoutError):  # the aborted requests' handlers now finish their responses
            await asyncio.wait_for(st.idle.wait(), 5.0)


async def serve(args: ServeArgs) -> int:
    """Run until SIGTERM/SIGINT. Exit code 0 after a drain, 1 if the model fails to load. On a node other
    than node 0 of a multi-node group, run only that node's ranks (worker_node.py)."""
    layout = node_layout(args.engine, os.environ)
    if layout.node_rank > 0:
        from .worker_node import serve_worker_node

        return await serve_worker_node(args, layout)
    app = build_app(args)
    st = server_state(app)
    runner, port = await start_app(app, args.host, args.port, shutdown_timeout=5.0)
    log.info("listening", extra={"fields": {"host": args.host, "port": port, "model": args.model}})
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = 0

    def on_signal(sig: signal.Signals) -> None:
        nonlocal signals
        signals += 1
        log.info("signal received", extra={"fields": {"signal": sig.name, "count": signals}})
        if signals > 1:  # a second signal: stop waiting for in-flight work
            st.engine.abort_all("shutdown")
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    load = asyncio.create_task(start_engine(app))
    stopper = asyncio.create_task(stop.wait())
    code = 0
    try:
        await asyncio.wait({load, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if load.done() and load.exception() is not None:
            # the error names the adapter when a --lora-modules one failed (tests match this message)
            log.error("model failed to load; exiting", extra={"fields": {"error": str(load.exception())}})
            code = 1
        else:
            await stop.wait()
            await drain(app, 0.0 if signals > 1 else args.shutdown_timeout)
    finally:
        for t in (load, stopper):
            if not t.done():
                t.cancel()
        st.draining = True
        await runner.cleanup()
        await st.engine.shutdown(timeout=5.0)
        log.info("stopped", extra={"fields": {"exit_code": code}})
    return code
