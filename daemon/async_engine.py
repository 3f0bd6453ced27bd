"""AsyncEngine: the engine on one dedicated thread, an asyncio queue of results per HTTP request.

The engine is not thread-safe, so only the engine thread touches it. The event loop hands it work
through a command list guarded by a condition variable (the thread sleeps on it when idle), and the
thread hands results back in one `call_soon_threadsafe` per iteration. All bookkeeping the server
reads (queue length, active requests, timings) lives on the event loop side, so it needs no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from .engine.config import EngineConfig
from .engine.input_processor import InputLimits, InputProcessor
from .engine.lora import LoRARequest
from .engine.outputs import RequestOutput
from .engine.sampling_params import SamplingParams
from .errors import EngineDead, EngineNotReady, EngineQueueFull

log = logging.getLogger("kvpilot.daemon.engine_loop")

# Before it reports ready, a server waits for the KV blocks of this many full token budgets to be mapped
# in: what the first steps are handed, so they run at full speed. Waiting for the whole cache made the
# start grow with its size (8 s per fresh GiB on some VMs).
_READY_MAPPED_BUDGETS = 2
_HEALTH_POLL_S = 1.0  # an idle loop asks the engine this often whether it can still step (a lost rank)


class EngineState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DEAD = "dead"  # the loop crashed or the model failed to load
    STOPPED = "stopped"


class Engine(Protocol):
    """What the bridge needs from an engine (LLMEngine, or a test double wrapping one)."""

    config: EngineConfig
    tokenizer: Any
    model_name: str
    max_model_len: int
    vocab_size: int

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams, *,
                    priority: int = 0, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None) -> None: ...
    def add_lora(self, lora_request: LoRARequest) -> bool: ...
    def remove_lora(self, lora_int_id: int) -> bool: ...
    def abort_request(self, request_id: str | Iterable[str]) -> None: ...
    def has_unfinished_requests(self) -> bool: ...
    def step(self) -> list[RequestOutput]: ...
    def get_stats(self) -> Any: ...
    def warmup(self) -> None: ...
    def wait_for_kv_cache_mapped(self, num_blocks: int | None = None) -> None: ...
    def pause_kv_cache_mapping_while(self, busy: Callable[[], bool]) -> None: ...


class EngineMetrics(Protocol):
    """The latency and admission hooks the bridge reports to (DaemonMetrics)."""

    @property
    def recent_e2e(self) -> float | None: ...
    def rejected(self, reason: str) -> None: ...
    def observe_ttft(self, seconds: float) -> None: ...
    def observe_itl(self, seconds: float) -> None: ...
    def request_finished(self, e2e_seconds: float, finish_reasons: list[str], *, prompt_tokens: int = 0,
                         generation_tokens: int = 0) -> None: ...


@dataclass
class Submission:
    """One prompt of a user request, handed to the engine as one engine request."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None  # the adapter `model` selected; None: the base model


# Items a submission's sink receives, besides RequestOutput and an EngineDead exception.
@dataclass
class Accepted:
    request_ids: list[str]


@dataclass
class Rejected:
    error: Exception  # what the engine's add_request raised


@dataclass
class Aborted:
    request_id: str
    reason: str


@dataclass
class _Add:
    submissions: list[Submission]
    sink: asyncio.Queue


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Call:
    """Work on the engine itself (an adapter load or removal): run on the engine thread, between steps, in
    order with the other commands; what it returns or raises settles `done` on the event loop."""

    fn: Callable[[Engine], Any]
    done: asyncio.Future


_Command = _Add | _Abort | _Call


@dataclass
class _InFlight:
    """Event-loop-side bookkeeping of one submission until it finishes."""

    sink: asyncio.Queue
    num_prompt_tokens: int
    arrival: float
    queued: bool = True  # no output yet: still waiting for its first scheduled step
    first_token_time: float | None = None
    last_token_time: float | None = None
    tokens_seen: int = 0


class AsyncEngine:
    """Owns the engine thread. Construct on the event loop; `await start()` loads the model."""

    def __init__(self, config: EngineConfig, *, max_queued_requests: int = 1024,
                 max_queued_tokens: int | None = None, metrics: EngineMetrics | None = None,
                 engine_factory: Callable[[EngineConfig], Engine] | None = None,
                 ready_before_kv_cache_mapped: bool = False) -> None:
        self.config = config
        self.ready_before_kv_cache_mapped = ready_before_kv_cache_mapped
        self.max_queued_requests = max_queued_requests
        self.max_queued_tokens = max_queued_tokens
        self.metrics = metrics
        self._factory = engine_factory
        self.state = EngineState.LOADING
        self.error: str | None = None
        self.tokenizer: Any = None  # a copy for the event loop: HF tokenizers are not safe to share
        self.input_processor: InputProcessor | None = None  # set once the model has loaded
        self.model_name: str = config.served_model_name or config.model
        self.max_model_len: int = 0
        self.kv_capacity_tokens: int = 0
        self.vocab_size: int = 0
        self.stats: Any = None  # latest EngineStats, replaced whole by the engine thread
        self._cond = threading.Condition()
        self._cmds: list[_Command] = []
        self._calls: set[asyncio.Future] = set()  # _Call results not yet settled: failed if the engine stops
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started: asyncio.Future | None = None
        self._in_flight: dict[str, _InFlight] = {}
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
        self._fail_calls(EngineDead("the engine was stopped"))

    @property
    def alive(self) -> bool:
        """False once the loop has crashed (or the model failed to load): /health answers 503."""
        return self.state in (EngineState.LOADING, EngineState.READY)

    @property
    def ready(self) -> bool:
        return self.state is EngineState.READY

    @property
    def num_active(self) -> int:
        return len(self._in_flight)

    # ---- event loop API ------------------------------------------------------------------------

    def check_accepting(self) -> InputProcessor:
        """The input processor of the loaded model; EngineNotReady/EngineDead when there is none."""
        if self.state is EngineState.LOADING:
            raise EngineNotReady("the model is still loading; retry shortly")
        if self.state is not EngineState.READY or self.input_processor is None:
            raise EngineDead(f"the engine is not running ({self.error or self.state.value})")
        return self.input_processor

    def submit(self, submissions: list[Submission], sink: asyncio.Queue) -> None:
        """Queue prompts for the engine; the sink gets Accepted or Rejected first, then outputs.

        Raises EngineQueueFull when the waiting queue is full: work that cannot be held is refused
        here, before it reaches the engine.
        """
        self.check_accepting()
        k = len(submissions)
        tokens = sum(len(s.prompt_token_ids) for s in submissions)
        full = self.num_queued + k > self.max_queued_requests
        if not full and self.max_queued_tokens is not None and self.num_queued > 0:
            full = self.num_queued_tokens + tokens > self.max_queued_tokens
        if full:
            if self.metrics is not None:
                self.metrics.rejected("queue_full")
            raise EngineQueueFull(f"server is overloaded: {self.num_queued} requests are waiting "
                                  f"(limit {self.max_queued_requests}); retry later", self.retry_after())
        now = time.monotonic()
        for s in submissions:
            self._in_flight[s.request_id] = _InFlight(sink, len(s.prompt_token_ids), now)
        self.num_queued += k
        self.num_queued_tokens += tokens
        self._send(_Add(submissions, sink))

    def abort(self, request_ids: Iterable[str], reason: str | None = None) -> None:
        """Stop requests and free their KV blocks. With a reason, their sinks get Aborted(reason)."""
        ids = [rid for rid in request_ids if rid in self._in_flight]
        if not ids:
            return
        for rid in ids:
            fl = self._forget(rid)
            if reason is not None and fl is not None:
                fl.sink.put_nowait(Aborted(rid, reason))
        if self.state is EngineState.READY:
            self._send(_Abort(ids))

    async def load_lora(self, lora_request: LoRARequest) -> bool:
        """Have the engine read, check and hold an adapter (LoRAAdapterError if it cannot be served). Runs on
        the engine thread, since the engine is not thread-safe; a load takes up to a second or so, which
        the event loop spends serving other requests."""
        return await self._call(lambda engine: engine.add_lora(lora_request))

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter from the engine (False: it held none with that id). Running requests finish."""
        return await self._call(lambda engine: engine.remove_lora(lora_int_id))

    def abort_all(self, reason: str) -> int:
        ids = list(self._in_flight)
        self.abort(ids, reason)
        return len(ids)

    def retry_after(self) -> int:
        """Seconds a rejected client should wait: about one request's service time, at least 1."""
        e2e = self.metrics.recent_e2e if self.metrics is not None else None
        return max(1, min(30, round(e2e or 1.0)))

    # ---- internals: event loop side ---------------------------------------------------------------

    async def _call(self, fn: Callable[[Engine], Any]) -> Any:
        self.check_accepting()
        assert self._loop is not None
        done = self._loop.create_future()
        self._calls.add(done)
        try:
            self._send(_Call(fn, done))
            return await done
        finally:
            self._calls.discard(done)

    def _settle(self, done: asyncio.Future, result: Any, error: BaseException | None) -> None:
        if done.done():  # failed already: the engine died or stopped meanwhile
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def _fail_calls(self, error: Exception) -> None:
        for done in list(self._calls):
            if not done.done():
                done.set_exception(error)

    def _send(self, cmd: _Command) -> None:
        with self._cond:
            self._cmds.append(cmd)
            self._cond.notify()

    def _forget(self, rid: str) -> _InFlight | None:
        fl = self._in_flight.pop(rid, None)
        if fl is not None:
            self._dequeue(fl)
        return fl

    def _dequeue(self, fl: _InFlight) -> None:
        """The submission has left the waiting queue (first output, or gone)."""
        if fl.queued:
            fl.queued = False
            self.num_queued -= 1
            self.num_queued_tokens -= fl.num_prompt_tokens

    def _deliver(self, acks: list[tuple[_Add, Exception | None]], outputs: list[RequestOutput], t: float) -> None:
        for cmd, error in acks:
            ids = [s.request_id for s in cmd.submissions]
            if error is None:
                cmd.sink.put_nowait(Accepted(ids))
                continue
            if any(rid in self._in_flight for rid in ids):
                cmd.sink.put_nowait(Rejected(error))
            for rid in ids:
                self._forget(rid)
        for out in outputs:
            fl = self._in_flight.get(out.request_id)
            if fl is None:  # aborted while the step ran
                continue
            self._dequeue(fl)
            self._observe_tokens(fl, out, t)
            fl.sink.put_nowait(out)
            if out.finished:
                del self._in_flight[out.request_id]
                if self.metrics is not None:
                    reasons = [o.finish_reason or "abort" for o in out.outputs]
                    self.metrics.request_finished(t - fl.arrival, reasons, prompt_tokens=len(out.prompt_token_ids),
                                                  generation_tokens=sum(len(o.token_ids) for o in out.outputs))

    def _observe_tokens(self, fl: _InFlight, out: RequestOutput, t: float) -> None:
        ntok = sum(len(o.token_ids) for o in out.outputs)
        if ntok <= fl.tokens_seen:
            return
        if fl.first_token_time is None:
            fl.first_token_time = t
            if self.metrics is not None:
                self.metrics.observe_ttft(t - fl.arrival)
        elif self.metrics is not None and fl.last_token_time is not None:
            self.metrics.observe_itl(t - fl.last_token_time)
        fl.last_token_time = t
        fl.tokens_seen = ntok

    def _on_loaded(self, info: dict[str, Any]) -> None:
        self.tokenizer = info["tokenizer"]
        self.model_name = info["model_name"]
        self.max_model_len = info["max_model_len"]
        self.kv_capacity_tokens = info["kv_capacity_tokens"]
        self.vocab_size = info["vocab_size"]
        limits = InputLimits(self.max_model_len, self.vocab_size, self.kv_capacity_tokens or None)
        self.input_processor = InputProcessor(self.tokenizer, limits)
        self.state = EngineState.READY
        if self._started is not None and not self._started.done():
            self._started.set_result(None)

    def _on_dead(self, message: str) -> None:
        self.state = EngineState.DEAD
        self.error = message
        for rid in list(self._in_flight):
            fl = self._forget(rid)
            if fl is not None:
                fl.sink.put_nowait(EngineDead(f"the engine stopped: {message}"))
        self._fail_calls(EngineDead(f"the engine stopped: {message}"))
        if self._started is not None and not self._started.done():
            self._started.set_exception(RuntimeError(f"engine failed to load: {message}"))

    # ---- internals: engine thread -----------------------------------------------------------------

    def _call_loop(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the event loop is closed: the process is exiting
            self._loop.call_soon_threadsafe(fn, *args)

    def _load(self) -> tuple[Engine, dict[str, Any]]:
        factory = self._factory
        if factory is None:
            from .engine import LLMEngine

            factory = LLMEngine
        engine = factory(self.config)
        engine.warmup()
        # The rest of the KV cache maps in only while no request is in hand: beside steps, on a VM whose
        # host backs guest memory on first touch, that work slowed them up to 2x (see PagePopulation).
        engine.pause_kv_cache_mapping_while(lambda: bool(self._cmds) or engine.has_unfinished_requests())
        try:  # before the wait below, which leaves the GIL free: 0.2 s for SmolLM2's tokenizer
            tokenizer = copy.deepcopy(engine.tokenizer)
        except Exception:  # some tokenizers do not deep-copy; sharing read-only encode is still fine
            tokenizer = engine.tokenizer
        if not self.ready_before_kv_cache_mapped:
            # Ready means full speed: the blocks the first steps are handed are mapped in by then.
            started = time.monotonic()
            num_blocks = -(-_READY_MAPPED_BUDGETS * self.config.max_num_batched_tokens // self.config.block_size)
            engine.wait_for_kv_cache_mapped(num_blocks)
            if (waited := time.monotonic() - started) >= 0.05:  # nothing to wait for on a GPU
                log.info("KV cache's first %d blocks mapped in; waited %.1f s after the model loaded",
                         num_blocks, waited)
        stats = engine.get_stats()
        self.stats = stats
        info = {
            "tokenizer": tokenizer,
            "model_name": engine.model_name,
            "max_model_len": int(engine.max_model_len),
            "kv_capacity_tokens": int(stats.num_total_blocks) * int(engine.config.block_size),
            "vocab_size": int(engine.vocab_size),
        }
        return engine, info

    def _thread_main(self) -> None:
        try:
            engine, info = self._load()
        except BaseException as exc:  # noqa: BLE001 - any failure to load is reported, not raised
            log.exception("engine failed to load")
            self._call_loop(self._on_dead, f"{type(exc).__name__}: {exc}")
            return
        self._call_loop(self._on_loaded, info)
        try:
            self._engine_loop(engine)
        except BaseException as exc:  # noqa: BLE001
            log.exception("engine loop crashed")
            self._call_loop(self._on_dead, f"{type(exc).__name__}: {exc}")
        finally:
            stop = getattr(engine, "shutdown", None)  # the other ranks' processes, when there are any
            if stop is not None:
                stop()

    def _engine_loop(self, engine: Engine) -> None:
        check_health = getattr(engine, "check_health", None)
        while True:
            with self._cond:
                while not self._cmds and not self._stop and not engine.has_unfinished_requests():
                    self._cond.wait(_HEALTH_POLL_S)
                    if check_health is not None:  # an idle engine still notices a rank that is gone
                        check_health()
                if self._stop:
                    return
                cmds, self._cmds = self._cmds, []
            acks: list[tuple[_Add, Exception | None]] = []
            for cmd in cmds:
                if isinstance(cmd, _Add):
                    acks.append((cmd, self._add(engine, cmd)))
                elif isinstance(cmd, _Call):
                    self._run_call(engine, cmd)
                else:
                    with contextlib.suppress(KeyError, ValueError):  # already finished: nothing to free
                        engine.abort_request(cmd.request_ids)
            outputs = engine.step() if engine.has_unfinished_requests() else []
            t = time.monotonic()
            self.stats = engine.get_stats()
            if acks or outputs:
                self._call_loop(self._deliver, acks, outputs, t)

    def _run_call(self, engine: Engine, cmd: _Call) -> None:
        """Settled at once, not with the step's outputs: a load's answer need not wait for a step."""
        try:
            result, error = cmd.fn(engine), None
        except Exception as exc:  # noqa: BLE001 - a bad adapter must never stop the loop
            result, error = None, exc
            if not isinstance(exc, ValueError | TypeError):
                log.exception("engine call failed")
        self._call_loop(self._settle, cmd.done, result, error)

    @staticmethod
    def _add(engine: Engine, cmd: _Add) -> Exception | None:
        """Add all of a command's submissions or none of them. Returns what add_request raised."""
        added: list[str] = []
        try:
            for s in cmd.submissions:
                # the keyword only with an adapter: engines (and test doubles) without LoRA keep working
                extra = {"lora_request": s.lora_request} if s.lora_request is not None else {}
                engine.add_request(s.request_id, s.prompt_token_ids, s.params, priority=s.priority,
                                   cache_salt=s.cache_salt, **extra)
                added.append(s.request_id)
        except Exception as exc:  # noqa: BLE001 - a bad request must never stop the loop
            if added:
                engine.abort_request(added)
            if not isinstance(exc, ValueError | TypeError):
                log.exception("add_request failed")
            return exc
        return None
