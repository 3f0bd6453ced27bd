"""Host memory for CPU inference: glibc malloc settings that keep freed activation buffers instead of
unmapping them, and ``populate_in_background`` for the KV cache's fresh pages (see there; a server
waits for it before it reports ready, or calls ``populate_at_idle_priority`` first).

A forward pass allocates activations of up to tens of MiB per op (a 2048-token chunk's gate/up output
is 24 MiB). glibc serves blocks that large with a fresh mmap and unmaps them on free, so every op
page-faults its whole output in again, zero-filling it first: measured at 25% of a 2048-token
prefill on 2 cores. Raising the mmap threshold to its maximum (32 MiB on 64-bit) and the trim
threshold well above the working set makes those blocks come from the heap and stay there, as
tcmalloc or jemalloc (which vLLM preloads) would do. The cost is that the process keeps its peak
activation memory after a burst.

``KVPILOT_MALLOC_TUNING=0`` leaves malloc alone; non-glibc systems are left alone too.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import threading

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc refuses more (HEAP_MAX_SIZE / 2 on 64-bit)
_TRIM_THRESHOLD = 1 << 30
_done = False


def _libc_function(name: str) -> ctypes._CFuncPtr | None:
    """A libc function, errno kept for ctypes.get_errno(); None where there is no such libc (musl lacks
    mallopt, macOS has no MADV_POPULATE_WRITE)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True), name)
    except (OSError, AttributeError):
        return None


def keep_freed_memory() -> bool:
    """Apply the settings once per process; True when they are in effect."""
    global _done
    if _done:
        return True
    if os.environ.get("KVPILOT_MALLOC_TUNING", "").strip() == "0":
        return False
    mallopt = _libc_function("mallopt")
    if mallopt is None:  # not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1 and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1
    if not ok:
        logger.info("mallopt refused the activation-buffer settings; malloc left as it is")
    _done = ok
    return ok


_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in writable without touching their contents
_POPULATE_CHUNK = 1 << 20


_idle_priority = threading.Event()


def populate_at_idle_priority() -> None:
    """Population threads run under SCHED_IDLE from now on (one already running switches at its next
    chunk): only on a core nothing else wants. For a server that reports ready before the population
    has finished (``--ready-before-kv-cache-mapped``), whose first requests would otherwise share the
    cores with it. Measured on 2 cores, requests every 2 s from the start: the first five requests'
    first tokens took 1.8-3.4 s with the population at normal priority and 0.3-0.9 s at idle priority.
    Idle priority is still not free where the host backs guest memory on first touch: at 2 req/s from
    the start the first requests' steps ran up to 2x slower, hence a server's default of waiting.
    Offline runs keep normal priority: there the population overlapping the first steps is the point
    (96 requests: 41 s against 44-49 s at idle priority, where the steps fault the pages in themselves)."""
    _idle_priority.set()


def _populate(ranges: list[tuple[int, int]]) -> None:
    madvise = _libc_function("madvise")
    if madvise is None:
        return
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = os.sysconf("SC_PAGE_SIZE")
    # madvise wants a page-aligned start (a partial head page is left to map in on use)
    spans = [(start, address + nbytes) for address, nbytes in ranges
             if (start := -(-address // page) * page) < address + nbytes]
    # the same offsets of every buffer together, lowest first: the KV cache hands out low block ids
    # first, and a block is used in every layer's cache at once
    longest = max((end - start for start, end in spans), default=0)
    lowered = False
    for offset in range(0, longest, _POPULATE_CHUNK):
        if not lowered and _idle_priority.is_set():
            lowered = True
            with contextlib.suppress(AttributeError, OSError):  # no SCHED_IDLE here: stay as it is
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread, on Linux
        for start, end in spans:
            lo = start + offset
            if lo < end and madvise(lo, min(_POPULATE_CHUNK, end - lo), _MADV_POPULATE_WRITE) != 0:
                logger.debug("MADV_POPULATE_WRITE refused (errno %d); pages map in on first use", ctypes.get_errno())
                return


def populate_in_background(ranges: list[tuple[int, int]]) -> threading.Thread | None:
    """Map in the pages of freshly allocated buffers (``(address, bytes)`` each) on a background thread.

    Why: the CPU KV cache is fresh zero pages, and without this every 4 KiB of it page-faults on first
    use, inside a step's KV store. On a VM whose memory the hypervisor backs lazily that is 2-4 s per
    GiB (3.4 s of a 48 s benchmark run, measured here), which writing the pages at start would add to
    the start instead. ``MADV_POPULATE_WRITE`` maps them without writing their contents, so steps may
    fill the same pages meanwhile; ctypes drops the GIL for the call, so the thread only costs a core
    while it runs. None where there is nothing to do or ``KVPILOT_POPULATE_KV=0``; older kernels refuse
    the advice and the pages then map in on first use, as before.
    """
    if not ranges or os.environ.get("KVPILOT_POPULATE_KV", "").strip() == "0":
        return None
    thread = threading.Thread(target=_populate, args=(ranges,), name="kvpilot-kv-populate", daemon=True)
    thread.start()
    return thread
