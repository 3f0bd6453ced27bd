"""AsyncEngine: the engine on one dedicated thread, an asyncio queue of results per HTTP request.

The engine is not thread-safe, so only the engine thread touches it. The event loop hands it work
through a command list guarded by a condition variable (the thread sleeps on it when idle), and the
thread hands results back in one `call_soon_threadsafe` per iteration. All bookkeeping the server
reads (queue length, active requests, timings) lives on the event loop side, so it needs no locks.
"""

from __future__ import annotations

import asyncio
import copy
import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .engine.config import EngineConfig
from .engine.request import RequestOutput
from .engine.sampling_params import SamplingParams
from .protocol import APIError

log = logging.getLogger("kvpilot.daemon.engine_loop")


class EngineState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DEAD = "dead"  # the loop crashed or the model failed to load
    STOPPED = "stopped"


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0


# Items a request's sink receives, besides RequestOutput.
@dataclass
class Accepted:
    request_ids: list[str]


@dataclass
class Rejected:
    message: str
    internal: bool = False  # an engine error rather than bad input


@dataclass
class Aborted:
    request_id: str
    reason: str


@dataclass
class EngineDead:
    message: str


@dataclass
class _Add:
    requests: list[EngineRequest]
    sink: asyncio.Queue


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Tracked:
    """Event-loop-side state of one engine request."""

    sink: asyncio.Queue
    num_prompt_tokens: int
    arrival: float
    queued: bool = True  # no output yet: still waiting for its first scheduled step
    first_token_time: float | None = None
    last_token_time: float | None = None
    tokens_seen: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class AsyncEngine:
    """Owns the engine thread. Construct on the event loop; `await start()` loads the model."""

    def __init__(self, config: EngineConfig, *, max_queued_requests: int = 1024,
                 max_queued_tokens: int | None = None, metrics: Any = None,
                 engine_factory: Callable[[EngineConfig], Any] | None = None) -> None:
        self.config = config
        self.max_queued_requests = max_queued_requests
        self.max_queued_tokens = max_queued_tokens
        self.metrics = metrics
        self._factory = engine_factory
        self.state = EngineState.LOADING
        self.error: str | None = None
        self.tokenizer: Any = None  # a copy for the event loop: HF tokenizers are not safe to share
        self.model_name: str = config.served_model_name or config.model
        self.max_model_len: int = 0
        self.kv_capacity_tokens: int = 0
        self.vocab_size: int = 0
        self.stats: Any = None  # latest EngineStats, replaced whole by the engine thread
        self._cond = threading.Condition()
        self._cmds: list[_Add | _Abort] = []
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started: asyncio.Future | None = None
        self._tracked: dict[str, _Tracked] = {}
        self.num_queued = 0
        self.num_queued_tokens = 0

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the model and warm it up on the engine thread; raises if loading fails."""
        self._loop = asyncio.get_running_loop()
        self._started = self._loop.create_future()
        self._thread = threading.Thread(target=self._thread_main, name="kvpilot-engine", daemon=True)
        self._thread.start()
        await asyncio.shield(self._started)

    async def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None and self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, timeout)
        if self.state in (EngineState.READY, EngineState.LOADING):
            self.state = EngineState.STOPPED

    @property
    def alive(self) -> bool:
        """False once the loop has crashed (or the model failed to load): /health answers 503."""
        return self.state in (EngineState.LOADING, EngineState.READY)

    @property
    def ready(self) -> bool:
        return self.state is EngineState.READY

    @property
    def num_active(self) -> int:
        return len(self._tracked)

    # ---- event loop API ------------------------------------------------------------------------

    def check_accepting(self) -> None:
        if self.state is EngineState.LOADING:
            raise APIError("the model is still loading; retry shortly", status=503,
                           type="service_unavailable_error", code="model_loading", headers={"Retry-After": "5"})
        if self.state is not EngineState.READY:
            raise APIError(f"the engine is not running ({self.error or self.state.value})", status=503,
                           type="service_unavailable_error", code="engine_dead")

    def submit(self, requests: list[EngineRequest], sink: asyncio.Queue) -> None:
        """Queue requests for the engine; the sink gets Accepted or Rejected first, then outputs.

        Raises APIError 429 when the waiting queue is full: work that cannot be held is refused here,
        before it reaches the engine.
        """
        self.check_accepting()
        k = len(requests)
        tokens = sum(len(r.prompt_token_ids) for r in requests)
        full = self.num_queued + k > self.max_queued_requests
        if not full and self.max_queued_tokens is not None and self.num_queued > 0:
            full = self.num_queued_tokens + tokens > self.max_queued_tokens
        if full:
            if self.metrics is not None:
                self.metrics.rejected("queue_full")
            raise APIError(f"server is overloaded: {self.num_queued} requests are waiting "
                           f"(limit {self.max_queued_requests}); retry later",
                           status=429, type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(self.retry_after())})
        now = time.monotonic()
        for r in requests:
            self._tracked[r.request_id] = _Tracked(sink, len(r.prompt_token_ids), now)
        self.num_queued += k
        self.num_queued_tokens += tokens
        self._send(_Add(requests, sink))

    def abort(self, request_ids: Iterable[str], reason: str | None = None) -> None:
        """Stop requests and free their KV blocks. With a reason, their sinks get Aborted(reason)."""
        ids = [rid for rid in request_ids if rid in self._tracked]
        if not ids:
            return
        for rid in ids:
            tr = self._untrack(rid)
            if reason is not None and tr is not None:
                tr.sink.put_nowait(Aborted(rid, reason))
        if self.state is EngineState.READY:
            self._send(_Abort(ids))

    def abort_all(self, reason: str) -> int:
        ids = list(self._tracked)
        self.abort(ids, reason)
        return len(ids)

    def retry_after(self) -> int:
        """Seconds a rejected client should wait: about one request's service time, at least 1."""
        e2e = getattr(self.metrics, "recent_e2e", None) if self.metrics is not None else None
        return max(1, min(30, round(e2e or 1.0)))

    # ---- internals: event loop side ---------------------------------------------------------------

    def _send(self, cmd: _Add | _Abort) -> None:
        with self._cond:
            self._cmds.append(cmd)
            self._cond.notify()

    def _untrack(self, rid: str) -> _Tracked | None:
        tr = self._tracked.pop(rid, None)
        if tr is not None and tr.queued:
            tr.queued = False
            self.num_queued -= 1
            self.num_queued_tokens -= tr.num_prompt_tokens
        return tr

    def _deliver(self, acks: list[tuple[_Add, str | None, bool]], outputs: list[RequestOutput], t: float) -> None:
        for cmd, error, internal in acks:
            ids = [r.request_id for r in cmd.requests]
            if error is None:
                cmd.sink.put_nowait(Accepted(ids))
            else:
                if any(rid in self._tracked for rid in ids):
                    cmd.sink.put_nowait(Rejected(error, internal))
                for rid in ids:
                    self._untrack(rid)
        for out in outputs:
            tr = self._tracked.get(out.request_id)
            if tr is None:  # aborted while the step ran
                continue
            if tr.queued:
                tr.queued = False
                self.num_queued -= 1
                self.num_queued_tokens -= tr.num_prompt_tokens
            ntok = sum(len(o.token_ids) for o in out.outputs)
            if ntok > tr.tokens_seen:
                if tr.first_token_time is None:
                    tr.first_token_time = t
                    if self.metrics is not None:
                        self.metrics.observe_ttft(t - tr.arrival)
                elif self.metrics is not None and tr.last_token_time is not None:
                    self.metrics.observe_itl(t - tr.last_token_time)
                tr.last_token_time = t
                tr.tokens_seen = ntok
            tr.sink.put_nowait(out)
            if out.finished:
                del self._tracked[out.request_id]
                if self.metrics is not None:
                    reasons = [o.finish_reason or "abort" for o in out.outputs]
                    self.metrics.request_finished(t - tr.arrival, reasons)

    def _on_loaded(self, info: dict[str, Any]) -> None:
        self.tokenizer = info["tokenizer"]
        self.model_name = info["model_name"]
        self.max_model_len = info["max_model_len"]
        self.kv_capacity_tokens = info["kv_capacity_tokens"]
        self.vocab_size = info["vocab_size"]
        self.state = EngineState.READY
        if self._started is not None and not self._started.done():
            self._started.set_result(None)

    def _on_dead(self, message: str, during_load: bool) -> None:
        self.state = EngineState.DEAD
        self.error = message
        for rid in list(self._tracked):
            tr = self._untrack(rid)
            if tr is not None:
                tr.sink.put_nowait(EngineDead(message))
        if self._started is not None and not self._started.done():
            self._started.set_exception(RuntimeError(f"engine failed to load: {message}"))

    # ---- internals: engine thread -----------------------------------------------------------------

    def _call_loop(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: the process is exiting
            pass

    def _thread_main(self) -> None:
        try:
            factory = self._factory
            if factory is None:
                from .engine import LLMEngine

                factory = LLMEngine
            engine = factory(self.config)
            engine.warmup()
            stats = engine.get_stats()
            self.stats = stats
            try:
                tokenizer = copy.deepcopy(engine.tokenizer)
            except Exception:  # some tokenizers do not deep-copy; sharing read-only encode is still fine
                tokenizer = engine.tokenizer
            block_size = getattr(getattr(engine, "config", None), "block_size", self.config.block_size)
            info = {
                "tokenizer": tokenizer,
                "model_name": engine.model_name,
                "max_model_len": int(engine.max_model_len),
                "kv_capacity_tokens": int(stats.num_total_blocks) * int(block_size),
                "vocab_size": int(getattr(engine, "vocab_size", None) or len(tokenizer)),
            }
        except BaseException as exc:  # noqa: BLE001 - any failure to load is reported, not raised
            log.exception("engine failed to load")
            self._call_loop(self._on_dead, f"{type(exc).__name__}: {exc}", True)
            return
        self._call_loop(self._on_loaded, info)
        try:
            self._engine_loop(engine)
        except BaseException as exc:  # noqa: BLE001
            log.exception("engine loop crashed")
            self._call_loop(self._on_dead, f"{type(exc).__name__}: {exc}", False)

    def _engine_loop(self, engine: Any) -> None:
        while True:
            with self._cond:
                while not self._cmds and not self._stop and not engine.has_unfinished_requests():
                    self._cond.wait()
                if self._stop:
                    return
                cmds, self._cmds = self._cmds, []
            acks: list[tuple[_Add, str | None, bool]] = []
            for cmd in cmds:
                if isinstance(cmd, _Add):
                    acks.append((cmd, *self._add(engine, cmd)))
                else:
                    try:
                        engine.abort_request(cmd.request_ids)
                    except (KeyError, ValueError):  # already finished: nothing to free
                        pass
            outputs = engine.step() if engine.has_unfinished_requests() else []
            t = time.monotonic()
            self.stats = engine.get_stats()
            if acks or outputs:
                self._call_loop(self._deliver, acks, outputs, t)

    @staticmethod
    def _add(engine: Any, cmd: _Add) -> tuple[str | None, bool]:
        """Add all of a command's requests or none of them. Returns (error, is_internal)."""
        added: list[str] = []
        try:
            for r in cmd.requests:
                engine.add_request(r.request_id, r.prompt_token_ids, r.params, priority=r.priority)
                added.append(r.request_id)
        except Exception as exc:  # noqa: BLE001 - a bad request must never stop the loop
            if added:
                engine.abort_request(added)
            internal = not isinstance(exc, ValueError | TypeError)
            if internal:
                log.exception("add_request failed")
            return str(exc) or type(exc).__name__, internal
        return None, False
