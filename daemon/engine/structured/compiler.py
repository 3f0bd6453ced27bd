"""Grammar compilation off the engine thread, into a cache keyed by the spec.

`GrammarCompiler.submit(spec)` returns a Future at once: the engine keeps the request out of the
batch until `future.done()` and the rest of the batch keeps decoding meanwhile. Equal specs (same
kind, same canonical payload) share one Future, so a popular schema compiles once.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr

from .matcher import SequenceMatcher
from .spec import StructuredOutputError, StructuredOutputSpec, clean_xgrammar_error

_tokenizer_infos: dict[tuple[int, int, tuple[int, ...]], tuple[Any, xgr.TokenizerInfo]] = {}
_infos_lock = threading.Lock()


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of a tokenizer, built once per (tokenizer, logits width, stop ids).

    vocab_size is the model's logits width (embedding rows), which may exceed len(tokenizer): xgrammar
    then treats the padding ids as never allowed, so a mask always covers the whole logits row."""
    stops = tuple(sorted(set(stop_token_ids)))
    key = (id(tokenizer), vocab_size, stops)
    with _infos_lock:
        hit = _tokenizer_infos.get(key)
        if hit is not None and hit[0] is tokenizer:  # id() alone could be a recycled address
            return hit[1]
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stops) or None)
        _tokenizer_infos[key] = (tokenizer, info)
        return info


@dataclass
class CompilerStats:
    hits: int = 0
    misses: int = 0
    compile_seconds: float = 0.0


class GrammarCompiler:
    """Compiles specs on a small thread pool; keeps the last `cache_size` results (LRU)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int] = (), *,
                 max_workers: int = 1, cache_size: int = 256) -> None:
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids))
        self.info = tokenizer_info(tokenizer, vocab_size, self.stop_token_ids)
        # xgrammar's own cache is off: ours is keyed by spec and holds Futures, so waiters share one.
        self._xgr = xgr.GrammarCompiler(self.info, max_threads=max_workers, cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple[str, str], Future[xgr.CompiledGrammar]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.stats = CompilerStats()

    def submit(self, spec: StructuredOutputSpec) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar for spec, as a Future; a failure is a StructuredOutputError inside it."""
        with self._lock:
            fut = self._cache.get(spec.key)
            if fut is not None:
                self._cache.move_to_end(spec.key)
                self.stats.hits += 1
                return fut
            self.stats.misses += 1
            fut = self._pool.submit(self._compile, spec)
            self._cache[spec.key] = fut
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return fut

    def compile(self, spec: StructuredOutputSpec, timeout: float | None = None) -> xgr.CompiledGrammar:
        """Blocking form of submit (tests, offline use)."""
        return self.submit(spec).result(timeout)

    def matcher(self, compiled: xgr.CompiledGrammar) -> SequenceMatcher:
        return SequenceMatcher(compiled, self.stop_token_ids)

    def _compile(self, spec: StructuredOutputSpec) -> xgr.CompiledGrammar:
        started = time.perf_counter()
        try:
            return self._xgr.compile_grammar(spec.parsed)
        except StructuredOutputError:
            raise
        except (RuntimeError, ValueError) as exc:
            raise StructuredOutputError(spec.field, f"cannot compile: {clean_xgrammar_error(exc)}") from None
        finally:
            with self._lock:
                self.stats.compile_seconds += time.perf_counter() - started

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


_shared: dict[tuple[str, int, int], GrammarCompiler] = {}
_shared_lock = threading.Lock()


def shared_compiler(tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int] = ()) -> GrammarCompiler:
    """One compiler (and cache) per vocabulary in this process: the daemon's event loop compiles a
    request's grammar before submitting it (a bad one is a 400) and the engine thread then finds it
    cached. Its own tokenizer copy is fine: a compiled grammar depends on the vocabulary only, and
    matchers take their stop tokens from whoever creates them."""
    key = (str(getattr(tokenizer, "name_or_path", "")), len(tokenizer), vocab_size)
    with _shared_lock:
        hit = _shared.get(key)
        if hit is None:
            hit = _shared[key] = GrammarCompiler(tokenizer, vocab_size, stop_token_ids)
        return hit
