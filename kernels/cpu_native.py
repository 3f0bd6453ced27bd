"""The native CPU decode-attention kernel (``csrc/paged_decode_cpu.c``), built on first use.

The C source is compiled with the system C compiler for this very CPU (``-march=native``) into
kvpilot's user cache, keyed by a hash of the source, the flags and the CPU, and loaded with
ctypes (which releases the GIL during the call). No compiler, a failed build or
``KVPILOT_CPU_KERNEL=0`` all mean ``available()`` is False and callers use the torch reference.

Queries and output are float32; the cache is float32 or float16 (``kv_cache_dtype="float16"``: half the
bytes a memory-bound decode step reads, widened to float32 in the kernel). The float16 entry point exists
where the compiler has ``_Float16`` (gcc >= 12 on x86); ``supports`` says which caches this build takes.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from kvpilot.paths import cache_dir

from . import reference

__all__ = ["available", "cache_dtypes", "supports", "paged_attention", "paged_decode", "build_error"]

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_decode_cpu.c"
# -ffast-math lets gcc vectorize the dot-product reductions and call glibc's vector expf. It is given to the
# compile step only: on a link line it adds crtfastmath, which sets flush-to-zero/denormals-are-zero for the
# whole process at load time and so changes every other float computation in it (torch's, Python's).
_COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fPIC"]
_LINK_FLAGS = ["-shared", "-pthread"]
# With OpenMP the kernel shares torch's thread pool (same libgomp.so.1) instead of starting
# pthreads that compete with torch's spinning workers: decode steps 10-25% faster on 2 cores.
# Without libgomp (or where linking it fails) the pthread build is used.
_OPENMP_FLAGS = ["-fopenmp"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None
# the C entry point per cache dtype, bound once the library is loaded (float16 only where built)
_ENTRY_POINTS = {torch.float32: "kvpilot_paged_decode_f32", torch.float16: "kvpilot_paged_decode_f16kv"}
_fns: dict[torch.dtype, Callable[..., int]] = {}


def _cpu_signature() -> str:
    """The library is built with -march=native, so a cache shared across machines must key on the CPU."""
    sig = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features")):
                    sig += line
                if line.startswith(("flags", "Features")):
                    break
    except OSError:
        pass
    return sig


def _build(target: Path, cc: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    obj = tmp[:-3] + ".o"
    try:
        for extra in (_OPENMP_FLAGS, []):
            proc = subprocess.run([cc, "-c", *_COMPILE_FLAGS, *extra, "-o", obj, str(_SOURCE)],
                                  capture_output=True, text=True, timeout=120)
            if proc.returncode == 0:
                proc = subprocess.run([cc, *_LINK_FLAGS, *extra, "-o", tmp, obj, "-lm"], capture_output=True,
                                      text=True, timeout=120)
            if proc.returncode == 0:
                break
        else:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        for leftover in (tmp, obj):
            if os.path.exists(leftover):
                os.unlink(leftover)


def _load() -> ctypes.CDLL | None:
    global _lib, _error
    if _lib is not None or _error is not None:
        return _lib
    with _lock:
        if _lib is not None or _error is not None:
            return _lib
        if os.environ.get("KVPILOT_CPU_KERNEL", "1").strip() == "0":
            _error = "disabled by KVPILOT_CPU_KERNEL=0"
            return None
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            _error = "no C compiler on PATH"
            logger.info("native CPU attention kernel unavailable (%s); using the torch reference", _error)
            return None
        flags = " ".join(_COMPILE_FLAGS + _LINK_FLAGS + _OPENMP_FLAGS)
        key = hashlib.sha256(_SOURCE.read_bytes() + flags.encode() + _cpu_signature().encode())
        target = cache_dir() / "kernels" / f"paged_decode_cpu-{key.hexdigest()[:16]}.so"
        try:
            if not target.exists():
                _build(target, cc)
            lib = ctypes.CDLL(str(target))
            _fns.update(_bind(lib))
            _lib = lib
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _error = str(e)
            logger.warning("native CPU attention kernel unavailable (%s); using the torch reference", e)
    return _lib


def _bind(lib: ctypes.CDLL) -> dict[torch.dtype, Callable[..., int]]:
    """The library's entry points by cache dtype, with their C signature (one for all of them)."""
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    fns = {}
    for dtype, name in _ENTRY_POINTS.items():
        if dtype is not torch.float32 and not hasattr(lib, name):
            continue  # a compiler without _Float16 builds the float32 kernel only
        fn = getattr(lib, name)
        fn.argtypes = [p, i64, p, p, p, i64, p, p, i32, i32, i32, i32, i32, f32, i32, p, i32]
        fn.restype = ctypes.c_int
        fns[dtype] = fn
    return fns


def available() -> bool:
    return _load() is not None


def cache_dtypes() -> tuple[torch.dtype, ...]:
    """The cache dtypes this build of the kernel reads (empty when it is unavailable)."""
    _load()
    return tuple(_fns)


def build_error() -> str | None:
    _load()
    return _error


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """float32 CPU queries over a float32 or (where built) float16 cache, in the layouts the kernel
    reads (see the C source)."""
    return (
        query.device.type == "cpu"
        and query.dtype == torch.float32
        and query.stride(2) == 1
        and query.stride(1) == query.shape[2]
        and k_cache.is_contiguous()
        and k_cache.dtype in cache_dtypes()
    )


def paged_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
) -> None:
    """Fill ``out`` rows of every sequence with a single query token this step; other rows untouched."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"native CPU kernel unavailable: {_error}")
    if not (out.is_contiguous() and v_cache.is_contiguous() and v_cache.shape == k_cache.shape):
        raise ValueError("paged_decode needs a contiguous out and caches of one shape")
    fn = _fns.get(k_cache.dtype)
    if fn is None or v_cache.dtype != k_cache.dtype or query.dtype != torch.float32 or out.dtype != torch.float32:
        raise ValueError(f"paged_decode takes float32 queries and out over caches of one dtype in "
                         f"{[str(d) for d in _fns]}; got query {query.dtype}, caches {k_cache.dtype}/{v_cache.dtype}")
    bt = block_tables.to(torch.int32).contiguous()
    ctx = context_lens.to(torch.int32).contiguous()
    qsl = query_start_loc.to(torch.int32).contiguous()
    _, bs, kvh, d = k_cache.shape
    rc = fn(
        query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        bt.data_ptr(), bt.stride(0), ctx.data_ptr(), qsl.data_ptr(), ctx.shape[0], query.shape[1], kvh, d, bs,
        scale, sliding_window or 0, out.data_ptr(), torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError("paged_decode could not start its threads")


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    max_context_len: int | None = None,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as ``reference.paged_attention``: decode rows in C, prefill chunks in torch SDPA
    (a chunk is a matmul-shaped problem that SDPA already does well)."""
    del max_context_len  # the C kernel bounds every row by its own context length
    num_tokens, num_heads, _ = query.shape
    if num_heads % k_cache.shape[2]:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {k_cache.shape[2]}")
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype)
    if num_tokens == 0 or context_lens.shape[0] == 0:
        return out
    target = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype)
    paged_decode(query, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, sliding_window,
                 target)
    if max_query_len is None or max_query_len > 1:
        reference.attend_prefill_chunks(query, k_cache, v_cache, block_tables, context_lens.long(),
                                        query_start_loc.long(), scale, sliding_window, target)
    if target is not out:
        # only the rows this call owns: rows past query_start_loc[-1] stay untouched
        end = int(query_start_loc[-1])
        out[:end] = target[:end]
    return out
