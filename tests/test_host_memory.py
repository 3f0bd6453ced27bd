"""The KV cache's pages are mapped in on a background thread (host_malloc.populate_in_background),
checked with mincore(2): what the kernel reports resident, not what the code believes it did."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import mmap
import os
import sys
import threading
import time

import numpy as np
import pytest

from kvpilot.daemon.engine import LLM, host_malloc

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="MADV_POPULATE_WRITE and mincore are Linux's")

PAGE = os.sysconf("SC_PAGE_SIZE")
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident_pages(address: int, nbytes: int) -> tuple[int, int]:
    """(resident, total) whole pages of the range, as the kernel reports them."""
    start = -(-address // PAGE) * PAGE
    pages = (address + nbytes - start) // PAGE
    vec = (ctypes.c_ubyte * pages)()
    assert _libc.mincore(start, pages * PAGE, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec), pages


def fresh_zeros(nbytes: int) -> np.ndarray:
    """Zeroed memory no one has touched yet, as the runner's calloc gives the CPU KV cache. A private
    anonymous mapping of its own: np.zeros may reuse heap pages once host_malloc's settings are on."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(m, dtype=np.uint8)


def test_populate_maps_every_page_and_keeps_contents(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPILOT_POPULATE_KV", raising=False)
    bufs = [fresh_zeros(24 << 20), fresh_zeros(40 << 20)]
    bufs[0][5 * PAGE + 3] = 7  # written before the thread runs: must survive it
    before = [resident_pages(b.ctypes.data, b.nbytes) for b in bufs]
    assert all(res < total // 2 for res, total in before), before  # fresh: mostly not mapped yet

    thread = host_malloc.populate_in_background([(b.ctypes.data, b.nbytes) for b in bufs])
    assert thread is not None
    bufs[1][-1] = 9  # written while it runs
    thread.join(timeout=60)
    assert not thread.is_alive()

    for b in bufs:
        res, total = resident_pages(b.ctypes.data, b.nbytes)
        assert res == total, (res, total)
    assert bufs[0][5 * PAGE + 3] == 7 and bufs[1][-1] == 9
    assert int(bufs[0].sum()) == 7 and int(bufs[1].sum()) == 9  # nothing else was written


def test_populate_off_by_env_or_when_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPILOT_POPULATE_KV", "0")
    buf = fresh_zeros(8 << 20)
    assert host_malloc.populate_in_background([(buf.ctypes.data, buf.nbytes)]) is None
    res, total = resident_pages(buf.ctypes.data, buf.nbytes)
    assert res < total // 2
    monkeypatch.delenv("KVPILOT_POPULATE_KV")
    assert host_malloc.populate_in_background([]) is None


def test_engine_kv_cache_is_resident_after_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine starts the thread over every layer's K and V cache (the test suite switches it off
    elsewhere, to keep test engines' caches lazily mapped)."""
    monkeypatch.setenv("KVPILOT_POPULATE_KV", "1")
    llm = LLM(model="builtin://smollm2-135m", num_kv_blocks=512)
    runner = llm.engine.runner
    assert runner._populate_thread is not None  # noqa: SLF001
    runner._populate_thread.join(timeout=60)  # noqa: SLF001
    caches = runner.k_caches + runner.v_caches
    assert len(caches) == 2 * runner.num_layers
    for t in caches:
        res, total = resident_pages(t.data_ptr(), t.numel() * t.element_size())
        assert res == total, (res, total)
    out = llm.generate(["The capital of France is"], use_tqdm=False)
    assert out[0].outputs[0].token_ids


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="no SCHED_IDLE on this platform")
def test_a_server_populates_at_idle_priority(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPILOT_POPULATE_KV", raising=False)
    monkeypatch.setattr(host_malloc, "_idle_priority", threading.Event())  # this test's switch only
    buf = fresh_zeros(512 << 20)  # big enough to watch the thread run: fresh pages map in at ~GB/s at best
    host_malloc.populate_at_idle_priority()
    thread = host_malloc.populate_in_background([(buf.ctypes.data, buf.nbytes)])
    assert thread is not None
    seen: set[int] = set()
    while thread.is_alive():
        try:
            seen.add(os.sched_getscheduler(thread.native_id))
        except OSError:  # it ended between the two calls
            break
    thread.join(timeout=60)
    if not seen:
        pytest.skip("the population finished before its policy could be read")
    # it lowers itself before its first chunk; an offline run's thread (the test above) keeps SCHED_OTHER
    assert seen <= {os.SCHED_IDLE, os.SCHED_OTHER} and os.SCHED_IDLE in seen, seen
    res, total = resident_pages(buf.ctypes.data, buf.nbytes)
    assert res == total, (res, total)  # at idle priority, on a quiet test machine, it still finishes


@pytest.mark.parametrize("ready_before_mapped", [False, True])
async def test_a_server_is_ready_once_its_kv_cache_is_mapped(monkeypatch: pytest.MonkeyPatch,
                                                               ready_before_mapped: bool) -> None:
    # Readiness means full speed: by default the daemon reports ready only after the population has
    # finished; --ready-before-kv-cache-mapped reports it as soon as the model is loaded. The real
    # population runs, only held back a while, so that the order of the two is visible on any host.
    from kvpilot.daemon.async_engine import AsyncEngine
    from kvpilot.daemon.engine.config import EngineConfig

    monkeypatch.delenv("KVPILOT_POPULATE_KV", raising=False)
    monkeypatch.setenv("KVPILOT_NUM_THREADS", "1")
    monkeypatch.setattr(host_malloc, "_idle_priority", threading.Event())  # this test's switch only
    mapped = threading.Event()
    real_populate = host_malloc._populate

    def slow_populate(ranges: list[tuple[int, int]]) -> None:
        time.sleep(3.0)
        real_populate(ranges)
        mapped.set()

    monkeypatch.setattr(host_malloc, "_populate", slow_populate)
    engine = AsyncEngine(EngineConfig(max_num_seqs=2, kv_cache_memory=32 << 20),
                         ready_before_kv_cache_mapped=ready_before_mapped)
    await engine.start()
    try:
        assert engine.ready
        assert mapped.is_set() is not ready_before_mapped
        assert host_malloc._idle_priority.is_set() is ready_before_mapped  # idle priority only beside requests
    finally:
        await engine.shutdown()
    await asyncio.to_thread(mapped.wait, 30)
    assert mapped.is_set()
