"""Host memory for CPU inference: glibc malloc settings that keep freed activation buffers instead of
unmapping them, and ``PagePopulation`` for the KV cache's fresh pages (see there).

A forward pass allocates activations of up to tens of MiB per op. glibc serves blocks that large with a
fresh mmap and unmaps them on free, so every op page-faults its whole output in again, zero-filling it
first: a large share of a long prefill. Raising the mmap threshold to its maximum (32 MiB on 64-bit) and
the trim threshold well above the working set makes those blocks come from the heap and stay there, as
tcmalloc or jemalloc (which vLLM preloads) would do. The cost is that the process keeps its peak
activation memory after a burst.

The engine's ``malloc_tuning`` off leaves malloc alone; non-glibc systems are left alone too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc refuses a higher mmap threshold (HEAP_MAX_SIZE / 2 on 64-bit): a block above this is a fresh mapping
# that page-faults all of itself in and is unmapped on free, whatever the settings (see row_slices)
MMAP_THRESHOLD_MAX = 32 << 20
_TRIM_THRESHOLD = 1 << 30
_done = False


def _libc_function(name: str) -> ctypes._CFuncPtr | None:
    """A libc function, errno kept for ctypes.get_errno(); None where there is no such libc (musl lacks
    mallopt, macOS has no MADV_POPULATE_WRITE)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True), name)
    except (OSError, AttributeError):
        return None


def keep_freed_memory(enabled: bool = True) -> bool:
    """Apply the settings once per process (``enabled``: the engine's ``malloc_tuning``); True when they are
    in effect."""
    global _done
    if _done:
        return True
    if not enabled:
        return False
    mallopt = _libc_function("mallopt")
    if mallopt is None:  # not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1 and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1
    if not ok:
        logger.info("mallopt refused the activation-buffer settings; malloc left as it is")
    _done = ok
    return ok


def row_slices(rows: int, bytes_per_row: int) -> list[slice] | None:
    """None when a ``[rows, ...]`` output of ``bytes_per_row`` a row stays within malloc's reach (at most
    ``MMAP_THRESHOLD_MAX``); else equal slices of rows whose outputs each do, for an op whose rows are
    independent to run slice by slice on blocks malloc keeps and hands out again."""
    reach = max(1, MMAP_THRESHOLD_MAX // bytes_per_row)
    if rows <= reach:
        return None
    size = -(-rows // -(-rows // reach))
    return [slice(a, a + size) for a in range(0, rows, size)]


_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in writable without touching their contents
_POPULATE_CHUNK = 512 << 10  # per buffer and call: short enough that a pause takes effect soon
_PAUSED_POLL_S = 0.005


class PagePopulation:
    """Maps in the pages of freshly allocated buffers (``(address, bytes)`` each) on a background thread.

    Why: the CPU KV cache is fresh zero pages, and without this every 4 KiB of it page-faults on first
    use, inside a step's KV store. On a VM whose host backs guest memory on first touch that costs
    seconds per fresh GiB, which writing the pages at start would add to the start instead.
    ``MADV_POPULATE_WRITE`` maps them without writing their contents, so steps may fill the same pages
    meanwhile; ctypes drops the GIL for the call.

    The same offsets of every buffer map in together, lowest first: the KV cache hands out low block
    ids first, and a block lives at the same offset of every layer's cache. ``wait(nbytes)`` returns
    once the first ``nbytes`` of every buffer are mapped, so a server can report ready after the blocks
    its first steps use. ``pause_while(busy)`` then keeps the rest off the cores while ``busy()`` holds:
    beside a step it slows that step on such a VM even at idle priority, where a step that touches a
    block not yet mapped pays only for that block.
    """

    def __init__(self, ranges: list[tuple[int, int]]) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        # madvise wants page-aligned addresses: each buffer from its first whole page (a partial head
        # page maps in on first use, and counts as mapped: offsets below are from the aligned start,
        # which lies at most a page above the buffer's own)
        self._spans = [(start, address + nbytes) for address, nbytes in ranges
                       if (start := -(-address // page) * page) < address + nbytes]
        self._longest = max((end - start for start, end in self._spans), default=0)
        self._mapped = 0  # bytes from the start of every buffer that are mapped in
        self._done = False
        self._busy: Callable[[], bool] | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kvpilot-kv-populate", daemon=True)

    @classmethod
    def start(cls, ranges: list[tuple[int, int]], enabled: bool = True) -> PagePopulation | None:
        """A running population; None where there is nothing to map or not ``enabled`` (the engine's
        ``populate_kv``). Older kernels refuse the advice: the thread then ends and the pages map in on
        first use, as before."""
        if not ranges or not enabled:
            return None
        population = cls(ranges)
        population._thread.start()
        return population

    @property
    def done(self) -> bool:
        return self._done

    @property
    def mapped_bytes(self) -> int:
        """Bytes from the start of every buffer mapped in so far."""
        return self._mapped

    def pause_while(self, busy: Callable[[], bool] | None) -> None:
        """From the next chunk on, map only while ``busy()`` is false (None: always)."""
        self._busy = busy

    def wait(self, nbytes: int | None = None, timeout: float | None = None) -> bool:
        """Block until the first ``nbytes`` of every buffer (None: all) are mapped; False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._done or (nbytes is not None and self._mapped >= nbytes), timeout)

    def _run(self) -> None:
        try:
            madvise = _libc_function("madvise")
            if madvise is None:
                return
            madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            for offset in range(0, self._longest, _POPULATE_CHUNK):
                while (busy := self._busy) is not None and busy():
                    time.sleep(_PAUSED_POLL_S)
                for start, end in self._spans:
                    lo = start + offset
                    if lo < end and madvise(lo, min(_POPULATE_CHUNK, end - lo), _MADV_POPULATE_WRITE) != 0:
                        logger.debug("MADV_POPULATE_WRITE refused (errno %d); pages map in on first use",
                                     ctypes.get_errno())
                        return
                with self._cond:
                    self._mapped = min(offset + _POPULATE_CHUNK, self._longest)
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()
