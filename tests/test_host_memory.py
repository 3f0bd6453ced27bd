"""The KV cache's pages are mapped in on a background thread (host_malloc.PagePopulation),
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


def test_populate_maps_every_page_and_keeps_contents() -> None:
    bufs = [fresh_zeros(24 << 20), fresh_zeros(40 << 20)]
    bufs[0][5 * PAGE + 3] = 7  # written before the thread runs: must survive it
    before = [resident_pages(b.ctypes.data, b.nbytes) for b in bufs]
    assert all(res < total // 2 for res, total in before), before  # fresh: mostly not mapped yet

    population = host_malloc.PagePopulation.start([(b.ctypes.data, b.nbytes) for b in bufs])
    assert population is not None
    bufs[1][-1] = 9  # written while it runs
    assert population.wait(timeout=60)
    assert population.done and population.mapped_bytes == 40 << 20

    for b in bufs:
        res, total = resident_pages(b.ctypes.data, b.nbytes)
        assert res == total, (res, total)
    assert bufs[0][5 * PAGE + 3] == 7 and bufs[1][-1] == 9
    assert int(bufs[0].sum()) == 7 and int(bufs[1].sum()) == 9  # nothing else was written


def test_populate_off_when_disabled_or_empty() -> None:
    buf = fresh_zeros(8 << 20)
    assert host_malloc.PagePopulation.start([(buf.ctypes.data, buf.nbytes)], enabled=False) is None
    res, total = resident_pages(buf.ctypes.data, buf.nbytes)
    assert res < total // 2
    assert host_malloc.PagePopulation.start([]) is None


def test_population_maps_the_lowest_offsets_first_and_pauses_while_busy() -> None:
    # A server waits for the first blocks only, then maps the rest in its idle time: wait(n) must mean
    # the first n bytes of every buffer, and a busy engine must hold the thread back.
    bufs = [fresh_zeros(256 << 20), fresh_zeros(256 << 20)]
    busy = True
    population = host_malloc.PagePopulation.start([(b.ctypes.data, b.nbytes) for b in bufs])
    assert population is not None
    assert population.wait(4 << 20, timeout=60)
    population.pause_while(lambda: busy)
    for b in bufs:
        res, total = resident_pages(b.ctypes.data, 4 << 20)
        assert res == total, (res, total)
    time.sleep(0.05)  # a chunk under way when the pause came may still finish
    held = population.mapped_bytes
    resident = [resident_pages(b.ctypes.data, b.nbytes)[0] for b in bufs]
    time.sleep(0.5)
    if held == 256 << 20:
        pytest.skip("the population finished before it could be paused")
    assert population.mapped_bytes == held and not population.done
    assert [resident_pages(b.ctypes.data, b.nbytes)[0] for b in bufs] == resident
    assert all(r < (256 << 20) // PAGE for r in resident), resident
    busy = False
    assert population.wait(timeout=60)
    for b in bufs:
        res, total = resident_pages(b.ctypes.data, b.nbytes)
        assert res == total, (res, total)


def test_engine_kv_cache_is_resident_after_start() -> None:
    """The engine starts the thread over every layer's K and V cache (the test suite switches it off
    elsewhere, to keep test engines' caches lazily mapped)."""
    llm = LLM(model="builtin://smollm2-135m", num_kv_blocks=512, populate_kv=True)
    runner = llm.engine.runner
    assert runner.kv_population is not None
    assert runner.kv_population.wait(timeout=60)
    caches = runner.k_caches + runner.v_caches
    assert len(caches) == 2 * runner.num_layers
    for t in caches:
        res, total = resident_pages(t.data_ptr(), t.numel() * t.element_size())
        assert res == total, (res, total)
    out = llm.generate(["The capital of France is"], use_tqdm=False)
    assert out[0].outputs[0].token_ids


@pytest.mark.parametrize("ready_before_mapped", [False, True])
async def test_a_server_is_ready_once_its_first_kv_blocks_are_mapped(monkeypatch: pytest.MonkeyPatch,
                                                                    ready_before_mapped: bool) -> None:
    # Readiness means full speed: by default the daemon reports ready once the blocks of two token
    # budgets are mapped in, which its first steps are handed; --ready-before-kv-cache-mapped reports it
    # as soon as the model is loaded. The real population runs, only held back a while, so that the
    # order of the two is visible on any host. The rest maps in only while the server is idle.
    from kvpilot.daemon.async_engine import AsyncEngine
    from kvpilot.daemon.engine import LLMEngine
    from kvpilot.daemon.engine.config import EngineConfig

    real_run = host_malloc.PagePopulation._run
    release = threading.Event()

    def held_run(self: host_malloc.PagePopulation) -> None:
        release.wait(60)
        real_run(self)

    monkeypatch.setattr(host_malloc.PagePopulation, "_run", held_run)
    if not ready_before_mapped:
        threading.Timer(3.0, release.set).start()  # the server must wait for it
    built: list[LLMEngine] = []

    def factory(config: EngineConfig) -> LLMEngine:
        built.append(LLMEngine(config))
        return built[-1]

    config = EngineConfig(max_num_seqs=2, max_num_batched_tokens=256, kv_cache_memory=64 << 20, populate_kv=True,
                          num_threads=1)
    engine = AsyncEngine(config, ready_before_kv_cache_mapped=ready_before_mapped, engine_factory=factory)
    started = time.monotonic()
    await engine.start()
    waited = time.monotonic() - started
    population = built[0].runner.kv_population
    assert population is not None
    try:
        assert engine.ready
        first_blocks = 2 * 256 // config.block_size * built[0].runner.k_caches[0][0].nbytes
        if ready_before_mapped:
            assert population.mapped_bytes == 0
        else:
            assert waited >= 3.0 and population.mapped_bytes >= first_blocks
        assert population._busy is not None and not population._busy()  # noqa: SLF001 - idle: maps on
        engine._cmds.append(object())  # noqa: SLF001 - a command in hand counts as busy
        assert population._busy()  # noqa: SLF001
        engine._cmds.clear()  # noqa: SLF001
    finally:
        release.set()
        await engine.shutdown()
    assert await asyncio.to_thread(population.wait, None, 30)
    assert population.done
