"""The native CPU kernels (``csrc/*.c``): paged attention, KV writes and the float32 model's row-wise
steps, built on first use.

The C sources are compiled with the system C compiler for this very CPU (``-march=native``) into one
library in kvpilot's user cache, keyed by a hash of the sources, the flags and the CPU, and loaded with
ctypes (which releases the GIL during the call). No compiler, a failed build or
``KernelSettings.cpu_kernels`` off (the engine's ``cpu_kernels``) all mean ``available()`` is False and
callers use the torch reference.

Decode rows (one query token) and prefill chunks (several) each have their kernel; both read the paged
cache in place. ``greedy_stats`` is the greedy sampler's one-pass argmax + logsumexp over logits;
``silu_mul``, ``gelu_tanh_mul``, ``rms_norm`` and ``rope_`` are the model's float32 and bfloat16 elementwise
steps and ``store_kv`` its cache writes, one pass each; ``panel_gemm`` is the GEMM of small decode steps, over weights
that ``pack_panels`` laid out for streaming; ``lora_fn`` is the batched LoRA shrink/expand of a layer
(kernels/lora.py). Attention's queries and output are float32 or bfloat16 (see ``paged_attention``); the
cache is float32, bfloat16 or float16 (``kv_cache_dtype="float16"``: half the bytes a memory-bound decode step
reads, widened to float32 in the kernel). The float16 entry points exist where the compiler has ``_Float16``
(gcc >= 12 on x86); ``supports`` says which caches this build takes. ``csrc/decode_layers_cpu.c`` chains these
kernels over a decode step's layers in one call (``models/native_decode.py`` binds it).
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
from .settings import current

__all__ = [
    "available", "reset", "cache_dtypes", "supports", "paged_attention", "paged_decode", "paged_prefill",
    "greedy_stats", "silu_mul", "gelu_tanh_mul", "rms_norm", "rope_", "store_kv", "pack_panels", "panel_gemm",
    "panel_gemm_max_rows", "moe_panels", "moe_route", "moe_gguf_args", "build_error", "gguf_fn", "gguf_dot_path",
    "lora_fn", "decode_layers_entry",
]

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = tuple(_CSRC / name for name in ("paged_decode_cpu.c", "paged_prefill_cpu.c", "greedy_cpu.c",
                                            "elementwise_cpu.c", "store_kv_cpu.c", "small_gemm_cpu.c",
                                            "gguf_gemm_cpu.c", "lora_cpu.c", "decode_layers_cpu.c", "moe_cpu.c"))
# -ffast-math lets gcc vectorize the dot-product reductions and call glibc's vector expf. It is given to the
# compile step only: on a link line it adds crtfastmath, which sets flush-to-zero/denormals-are-zero for the
# whole process at load time and so changes every other float computation in it (torch's, Python's).
_COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fPIC"]
_LINK_FLAGS = ["-shared", "-pthread"]
# With OpenMP the kernel shares torch's thread pool (same libgomp.so.1) instead of starting pthreads that
# compete with torch's spinning workers. Without libgomp (or where linking it fails) the pthread build is used.
_OPENMP_FLAGS = ["-fopenmp"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None
# the C entry point per cache dtype, bound once the library is loaded (float16 only where built)
_ENTRY_POINTS = {torch.float32: "f32", torch.float16: "f16kv", torch.bfloat16: "bf16kv"}
# query dtypes the attention kernels take: bfloat16 queries (a bfloat16 model's) are widened on the way in
_QUERY_DTYPES = (torch.float32, torch.bfloat16)
_fns: dict[torch.dtype, Callable[..., int]] = {}  # decode
_prefill_fns: dict[torch.dtype, Callable[..., int]] = {}
# by (row dtype, cache dtype): float32 rows into each cache dtype, 16-bit rows copied into a cache of their type
_store_fns: dict[tuple[torch.dtype, torch.dtype], Callable[..., int]] = {}
_row_fns: dict[str, Callable[..., None]] = {}  # the row kernels' entry points, by C name without "kvpilot_"
_build_constants: dict[str, int] = {}  # e.g. panel_width, read from the library when it is bound


def _extra_flags() -> list[str]:
    """KernelSettings.cpu_kernel_cflags, appended to the compile flags (and so part of the cache key)."""
    return list(current().cpu_kernel_cflags)


def reset() -> None:
    """Forget the loaded library and its bound entry points, so that the next call loads (or builds) the one
    the current settings ask for, or none when they turn the kernels off (``ops.configure`` calls this)."""
    global _lib, _error
    with _lock:
        _lib, _error = None, None
        for table in (_fns, _prefill_fns, _store_fns, _row_fns, _build_constants):
            table.clear()


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
    objs = [f"{tmp[:-3]}-{i}.o" for i in range(len(_SOURCES))]
    try:
        for extra in (_OPENMP_FLAGS, []):
            for src, obj in zip(_SOURCES, objs, strict=True):
                proc = subprocess.run([cc, "-c", *_COMPILE_FLAGS, *_extra_flags(), *extra, "-o", obj, str(src)],
                                      capture_output=True, text=True, timeout=120)
                if proc.returncode != 0:
                    break
            if proc.returncode == 0:
                proc = subprocess.run([cc, *_LINK_FLAGS, *extra, "-o", tmp, *objs, "-lm"], capture_output=True,
                                      text=True, timeout=120)
            if proc.returncode == 0:
                break
        else:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        for leftover in (tmp, *objs):
            if os.path.exists(leftover):
                os.unlink(leftover)


def _load() -> ctypes.CDLL | None:
    global _lib, _error
    if _lib is not None or _error is not None:
        return _lib
    with _lock:
        if _lib is not None or _error is not None:
            return _lib
        if not current().cpu_kernels:
            _error = "disabled by the cpu_kernels setting"
            return None
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            _error = "no C compiler on PATH"
            logger.info("native CPU attention kernel unavailable (%s); using the torch reference", _error)
            return None
        flags = " ".join(_COMPILE_FLAGS + _extra_flags() + _LINK_FLAGS + _OPENMP_FLAGS)
        # every file of csrc/ (the sources and the header they share) is part of the key
        key = hashlib.sha256(b"".join(f.read_bytes() for f in sorted(_CSRC.iterdir()) if f.suffix in (".c", ".h"))
                             + flags.encode() + _cpu_signature().encode())
        target = cache_dir() / "kernels" / f"kvpilot_cpu-{key.hexdigest()[:16]}.so"
        try:
            if not target.exists():
                _build(target, cc)
            lib = ctypes.CDLL(str(target))
            _fns.update(_bind(lib, "kvpilot_paged_decode_", _ATTENTION_ARGS))
            _prefill_fns.update(_bind(lib, "kvpilot_paged_prefill_", _ATTENTION_ARGS))
            _store_fns.update({(torch.float32, cache): fn
                               for cache, fn in _bind(lib, "kvpilot_store_kv_", _STORE_ARGS).items()})
            copy16 = lib.kvpilot_store_kv_copy16
            copy16.argtypes, copy16.restype = _STORE_ARGS, ctypes.c_int
            _store_fns.update({(dtype, dtype): copy16 for dtype in (torch.bfloat16, torch.float16)})
            _bind_row_kernels(lib)
            _lib = lib
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _error = str(e)
            logger.warning("native CPU attention kernel unavailable (%s); using the torch reference", e)
    return _lib


_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# the C signatures of the per-cache-dtype entry points (see the sources)
_ATTENTION_ARGS = [_P, _I64, _P, _P, _P, _I64, _P, _P, _I32, _I32, _I32, _I32, _I32, _F32, _I32, _P, _I32, _I32, _P,
                   _F32]
_STORE_ARGS = [_P, _I64, _P, _I64, _P, _P, _P, _I32, _I32, _I64]


def _bind(lib: ctypes.CDLL, prefix: str, argtypes: list) -> dict[torch.dtype, Callable[..., int]]:
    """One kernel's entry points by cache dtype (``prefix`` + f32 / f16kv / bf16kv), all with ``argtypes``."""
    fns = {}
    for dtype, suffix in _ENTRY_POINTS.items():
        name = prefix + suffix
        if dtype is not torch.float32 and not hasattr(lib, name):
            continue  # a compiler without _Float16 builds no float16 kernel; store_kv has no bfloat16 one
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
        fns[dtype] = fn
    return fns


def _bind_row_kernels(lib: ctypes.CDLL) -> None:
    """The sampler's and the model's helpers (same library, plain float32 entry points)."""
    p, i64, i32, f32 = _P, _I64, _I32, _F32
    for name, argtypes in (("greedy_stats", [p, i64, i32, i32, p, p, p, i32]),
                           ("silu_mul_f32", [p, i64, i32, i32, p, i32]),
                           ("silu_mul_bf16", [p, i64, i32, i32, p, i32]),
                           ("rms_norm_f32", [p, i64, i32, i32, p, f32, p, i32]),
                           ("rms_norm_bf16", [p, i64, i32, i32, p, f32, p, i32]),
                           ("rms_norm_bf16_f32w", [p, i64, i32, i32, p, f32, p, i32]),
                           ("gelu_tanh_mul_f32", [p, i64, i32, i32, p, i32]),
                           ("gelu_tanh_mul_bf16", [p, i64, i32, i32, p, i32]),
                           ("rope_f32", [p, i64, i32, i32, i32, p, i32]),
                           ("rope_bf16", [p, i64, i32, i32, i32, p, i32]),
                           ("pack_panels_f32", [p, i64, i32, i32, p, i32]),
                           ("panel_gemm_f32", [p, i64, p, p, p, i64, p, i64, i32, i32, i32, i32]),
                           ("moe_route_f32", [p, i64, i32, i32, i32, i32, i32, p, p])):
        fn = getattr(lib, "kvpilot_" + name)
        fn.argtypes = argtypes
        fn.restype = None
        _row_fns[name] = fn
    # the GGUF kernels (kernels/gguf.py calls them through gguf_fn): an int status each; the GEMM takes its
    # arguments packed in one int64 array (converting 15 ctypes arguments costs more than a small GEMM)
    # the batched LoRA (kernels/lora.py calls it through lora_fn), packed the same way
    for name, argtypes in (("gguf_dequant", [i32, p, i64, i32, i32, p, i64, i32, i32]),
                           ("gguf_gemm_packed", [ctypes.POINTER(ctypes.c_int64)]),
                           ("lora_shrink_expand_packed", [ctypes.POINTER(ctypes.c_int64)]),
                           ("moe_gguf_packed", [ctypes.POINTER(ctypes.c_int64)]),
                           ("moe_panels_f32", [p, i64, i32, i32, i32, i32, i32, p, p, p, p, p, p, p, i64, i32])):
        fn = getattr(lib, "kvpilot_" + name)
        fn.argtypes = argtypes
        fn.restype = i32
        _row_fns[name] = fn
    for name in ("panel_width", "panel_gemm_max_rows", "prefill_max_group", "prefill_max_head_dim", "gguf_dot_path",
                 "moe_gguf_args"):
        # constants of the build, read once here
        fn = getattr(lib, "kvpilot_" + name)
        fn.argtypes = []
        fn.restype = i32
        _build_constants[name] = int(fn())


def decode_layers_entry() -> tuple[Callable[..., int], int, int, int] | None:
    """``kvpilot_decode_layers`` (csrc/decode_layers_cpu.c) and its record sizes: slots per layer, slots per
    step, GGUF segments per GEMM; None without the library."""
    lib = _load()
    if lib is None or not hasattr(lib, "kvpilot_decode_layers"):
        return None
    fn = lib.kvpilot_decode_layers
    fn.argtypes, fn.restype = [_P, _I32, _P], _I32
    sizes = []
    for name in ("decode_layer_slots", "decode_step_slots", "decode_max_segments"):
        size = getattr(lib, "kvpilot_" + name)
        size.argtypes, size.restype = [], _I32
        sizes.append(int(size()))
    return fn, sizes[0], sizes[1], sizes[2]


def _build_constant(name: str) -> int:
    """A constant the library was built with (``kvpilot_<name>()``); 0 without the library."""
    if name not in _build_constants:
        _load()
    return _build_constants.get(name, 0)


def _row_kernel(name: str) -> Callable[..., None] | None:
    """A row kernel's entry point (the first call builds and binds the library); None without one."""
    fn = _row_fns.get(name)
    if fn is None and _load() is not None:
        fn = _row_fns.get(name)
    return fn


def gguf_fn(name: str) -> Callable[..., int] | None:
    """The GGUF kernels' entry point ``kvpilot_<name>`` (gguf_dequant, gguf_gemm_packed; see
    csrc/gguf_gemm_cpu.c; moe_gguf_packed, csrc/moe_cpu.c), bound on first use; None without the library."""
    return _row_kernel(name)


def lora_fn() -> Callable[..., int] | None:
    """The batched LoRA kernel's entry point (``kvpilot_lora_shrink_expand_packed``, csrc/lora_cpu.c), bound on
    first use; None without the library."""
    return _row_kernel("lora_shrink_expand_packed")


def moe_gguf_args() -> int:
    """How many int64 slots ``kvpilot_moe_gguf_packed`` reads (its argument layout's version check)."""
    return _build_constant("moe_gguf_args")


def gguf_dot_path() -> bool:
    """Whether this build multiplies GGUF weights with the bfloat16 dot-product path (AVX512-BF16 + VBMI)."""
    return _build_constant("gguf_dot_path") == 1


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> bool:
    """``kernels.store_kv`` in one native pass: float32 CPU key/value ``[T, kvh, d]`` (each token's heads
    contiguous, rows any stride apart) into contiguous float32 or float16 caches, or bfloat16/float16 ones
    into a cache of their own dtype. False, with nothing written, where it does not apply (the caller uses
    the torch reference, which also reports bad input)."""
    if not (key.is_cpu and value.dtype is key.dtype and key.dim() == 3
            and value.shape == key.shape and k_cache.dtype is v_cache.dtype and k_cache.shape == v_cache.shape
            and k_cache.is_contiguous() and v_cache.is_contiguous() and slot_mapping.dim() == 1):
        return False
    tokens, kvh, d = key.shape
    if (k_cache.dim() != 4 or k_cache.shape[2] != kvh or k_cache.shape[3] != d or slot_mapping.shape[0] > tokens
            or key.stride(2) != 1 or key.stride(1) != d or value.stride(2) != 1 or value.stride(1) != d):
        return False
    kind = (key.dtype, k_cache.dtype)
    fn = _store_fns.get(kind)
    if fn is None and _load() is not None:
        fn = _store_fns.get(kind)
    if fn is None:
        return False
    slots = slot_mapping if slot_mapping.dtype is torch.int64 and slot_mapping.is_contiguous() else (
        slot_mapping.to(torch.int64).contiguous())
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    rc = fn(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            slots.data_ptr(), slots.shape[0], kvh * d, num_slots)
    return rc == 0


def _rows_f32(t: torch.Tensor) -> bool:
    """A float32 CPU matrix whose rows are contiguous (any row stride): what the row kernels read."""
    return t.is_cpu and t.dtype is torch.float32 and t.dim() == 2 and t.stride(1) == 1


# the elementwise kernels' variants by dtype: bfloat16 ones round op by op as HF's bfloat16 modules do
_ELEMENTWISE_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _elementwise_rows(t: torch.Tensor) -> str | None:
    """The elementwise kernels' suffix for a CPU matrix with contiguous rows (any row stride) of a dtype
    they take; None otherwise."""
    if not (t.is_cpu and t.dim() == 2 and t.stride(1) == 1):
        return None
    return _ELEMENTWISE_SUFFIX.get(t.dtype)


# silu_mul (gelu_tanh_mul) and rms_norm run several times per layer per step: their checks stay few (a few us
# per call is a measurable share of a small decode step)
def _act_mul(name: str, gate_up: torch.Tensor) -> torch.Tensor | None:
    suffix = _elementwise_rows(gate_up)
    if suffix is None or gate_up.shape[1] % 2:
        return None
    fn = _row_kernel(name + suffix)
    if fn is None:
        return None
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty((rows, inter))
    if rows:
        fn(gate_up.data_ptr(), gate_up.stride(0), rows, inter, out.data_ptr(), torch.get_num_threads())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` of a fused ``[rows, 2 * inter]`` float32 or bfloat16 gate|up projection, as a new
    contiguous ``[rows, inter]`` tensor; None where the kernel is unavailable or the input is not such a
    matrix."""
    return _act_mul("silu_mul_", gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``gelu(gate, approximate="tanh") * up`` (Gemma's GeGLU) of a fused ``[rows, 2 * inter]`` float32 or
    bfloat16 gate|up projection, as a new contiguous ``[rows, inter]`` tensor; None where the kernel is
    unavailable or the input is not such a matrix. bfloat16 rounds as torch's bfloat16 ops do: GELU(gate)
    (computed in float32), then its product with up."""
    return _act_mul("gelu_tanh_mul_", gate_up)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm of each row of ``x`` [rows, dim], scaled by ``weight`` [dim]; None where the kernel is
    unavailable or the tensors are not float32 or bfloat16 CPU rows with a weight of their dtype, or bfloat16
    rows with a float32 weight (use torch then). A bfloat16 weight scales the row rounded to bfloat16, in
    bfloat16 (HF's Llama); a float32 one scales bfloat16 rows in float32 before the one rounding (Gemma's,
    OLMo 2's: ``rms_norm(x.float(), ..., weight).to(bfloat16)``)."""
    suffix = _elementwise_rows(x)
    if (suffix is None or not weight.is_cpu or not weight.is_contiguous() or weight.dim() != 1
            or weight.shape[0] != x.shape[1]):
        return None
    if weight.dtype is not x.dtype:  # float32 with bfloat16 rows (Gemma's, OLMo 2's); any other mix is torch's
        if weight.dtype is not torch.float32:
            return None
        suffix = "bf16_f32w"
    fn = _row_kernel("rms_norm_" + suffix)
    if fn is None:
        return None
    out = torch.empty_like(x, memory_format=torch.contiguous_format)  # half new_empty's cost (~0.8 us)
    if x.shape[0]:
        fn(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], weight.data_ptr(), eps, out.data_ptr(),
           torch.get_num_threads())
    return out


def rope_(x: torch.Tensor, cis: torch.Tensor, heads: int) -> bool:
    """RoPE in place on ``x`` [rows, heads * head_dim] (float32 or bfloat16 CPU rows, each head's dims as
    interleaved pairs): row r's pairs times ``cis[r]`` ([rows, head_dim / 2] complex64, contiguous). False,
    with nothing done, where the kernel is unavailable or the tensors are not such (use torch then)."""
    suffix = _elementwise_rows(x)
    if suffix is None or heads < 1 or x.shape[1] % (2 * heads):
        return False
    rows, half = x.shape[0], x.shape[1] // (2 * heads)
    if (cis.dtype is not torch.complex64 or not cis.is_cpu or not cis.is_contiguous() or cis.dim() < 2
            or cis.shape[0] != rows or cis.shape[-1] != half or cis.numel() != rows * half):
        return False
    fn = _row_kernel("rope_" + suffix)
    if fn is None:
        return False
    if rows:
        fn(x.data_ptr(), x.stride(0), rows, heads, half, cis.data_ptr(), torch.get_num_threads())
    return True


def pack_panels(weight: torch.Tensor) -> torch.Tensor | None:
    """A float32 CPU weight ``[N, K]`` (rows contiguous) repacked for ``panel_gemm``: ``[panels, K, width]``,
    each panel ``width`` output columns as K consecutive runs (the last one zero-padded), so that a
    product streams the weight sequentially; None where the kernel is unavailable or the tensor is not
    such a matrix. A second copy of the weight: the caller decides whether memory allows it."""
    fn = _row_kernel("pack_panels_f32") if _rows_f32(weight) else None
    if fn is None:
        return None
    n, k = weight.shape
    width = _panel_width()
    out = torch.empty((-(-n // width), k, width), dtype=torch.float32)
    fn(weight.data_ptr(), weight.stride(0), n, k, out.data_ptr(), torch.get_num_threads())
    return out


def panel_gemm(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """``residual + x @ weight.T (+ bias)`` (no residual: the product alone) for float32 CPU rows ``x``
    [M, K] and ``panels = pack_panels(weight)`` of an ``[n, K]`` weight, reading the weight once per call;
    None where the kernel is unavailable or the tensors do not fit together (use torch then). Meant for
    the few rows of a decode step (see the C source); ``panel_gemm_max_rows`` says up to how many rows it
    beats a library GEMM here. The residual (float32 rows ``[M, n]``) is added per tile as it is stored.
    ``out`` (float32 rows ``[M, n]``) receives the product instead of a fresh tensor."""
    if (not _rows_f32(x) or panels.dim() != 3 or not panels.is_cpu or panels.dtype is not torch.float32
            or not panels.is_contiguous()
            or panels.shape[1] != x.shape[1] or panels.shape[2] != _panel_width()
            or panels.shape[0] != -(-n // panels.shape[2])
            or (bias is not None and not (bias.is_cpu and bias.dtype is torch.float32 and bias.is_contiguous()
                                          and bias.shape == (n,)))
            or (residual is not None and not (_rows_f32(residual) and residual.shape == (x.shape[0], n)))
            or (out is not None and not (_rows_f32(out) and out.shape == (x.shape[0], n)))):
        return None
    fn = _row_kernel("panel_gemm_f32")
    if fn is None:
        return None
    if out is None:
        out = x.new_empty((x.shape[0], n))
    if x.shape[0]:
        fn(x.data_ptr(), x.stride(0), panels.data_ptr(), 0 if bias is None else bias.data_ptr(),
           0 if residual is None else residual.data_ptr(), 0 if residual is None else residual.stride(0),
           out.data_ptr(), out.stride(0), x.shape[0], n, x.shape[1], torch.get_num_threads())
    return out


_MOE_SCRATCH_BYTES = 64 << 20


def moe_route(logits: torch.Tensor, top_k: int, *, renormalize: bool = False,
              topk_before_softmax: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``kernels.moe.moe_route`` with softmax scoring and no correction bias, natively (csrc/moe_cpu.c): the
    routing of the layers that ``moe_panels`` runs, which the native decode loop repeats bit for bit. Float32 CPU
    ``logits [T, E]`` (rows contiguous); ``(weights float32 [T, k], ids int64 [T, k])``, or None where the
    kernel is unavailable or the logits are not such rows."""
    if not _rows_f32(logits) or not 1 <= top_k <= logits.shape[1]:
        return None
    fn = _row_kernel("moe_route_f32")
    if fn is None:
        return None
    t, e = logits.shape
    ids = torch.empty((t, top_k), dtype=torch.int64)
    weights = torch.empty((t, top_k), dtype=torch.float32)
    if t:
        fn(logits.data_ptr(), logits.stride(0), t, e, top_k, int(topk_before_softmax), int(renormalize),
           ids.data_ptr(), weights.data_ptr())
    return weights, ids


def moe_panels(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, inter: int, topk_ids: torch.Tensor,
               topk_weights: torch.Tensor, w13_bias: torch.Tensor | None = None,
               w2_bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """A MoE layer's routed experts with SiLU-gated MLPs in one native call (csrc/moe_cpu.c): float32 CPU rows
    ``x [T, H]``, ``w13 [E, ceil(2I / width), H, width]`` and ``w2 [E, ceil(H / width), I, width]`` (each
    expert's gate|up ``[2I, H]`` and down ``[H, I]`` weight through ``pack_panels``), ``topk_ids [T, k]`` and
    float32 ``topk_weights [T, k]``, float32 biases ``[E, 2I]`` / ``[E, H]`` or None. Returns float32 ``[T, H]``;
    None where the kernel is unavailable or the tensors do not fit together (the caller takes the torch path,
    which also reports bad input). An expert id outside ``[0, E)`` raises ``ValueError``."""
    width = _panel_width()
    if not _rows_f32(x) or width == 0 or w13.dim() != 4 or w2.dim() != 4:
        return None
    t, h = x.shape
    e, k = w13.shape[0], topk_ids.shape[-1] if topk_ids.dim() == 2 else 0
    fits = (w13.shape == (e, -(-2 * inter // width), h, width) and w2.shape == (e, -(-h // width), inter, width)
            and all(w.is_cpu and w.dtype is torch.float32 and w.is_contiguous() for w in (w13, w2))
            and topk_ids.shape == (t, k) and topk_weights.shape == (t, k) and k > 0
            and topk_ids.dtype is torch.int64 and topk_weights.dtype is torch.float32
            and topk_ids.is_contiguous() and topk_weights.is_contiguous()
            and all(b is None or (b.is_cpu and b.dtype is torch.float32 and b.is_contiguous() and b.shape == shape)
                    for b, shape in ((w13_bias, (e, 2 * inter)), (w2_bias, (e, h)))))
    fn = _row_kernel("moe_panels_f32") if fits else None
    if fn is None:
        return None
    out = x.new_empty((t, h))
    # the kernel keeps its scratch rows between calls (csrc/moe_cpu.c): tokens go in chunks that hold it to 64 MB
    chunk = max(1, _MOE_SCRATCH_BYTES // (k * 4 * (h + 3 * inter) + 4 * k))
    threads = torch.get_num_threads()
    for lo in range(0, t, chunk):
        hi = min(t, lo + chunk)
        status = fn(x[lo].data_ptr(), x.stride(0), hi - lo, h, inter, e, k, topk_ids[lo].data_ptr(),
                    topk_weights[lo].data_ptr(), w13.data_ptr(), 0 if w13_bias is None else w13_bias.data_ptr(),
                    w2.data_ptr(), 0 if w2_bias is None else w2_bias.data_ptr(), out[lo].data_ptr(), out.stride(0),
                    threads)
        if status == -1:  # the kernel checks the ids before it writes anything
            raise ValueError(f"topk_ids holds expert ids outside [0, {e})")
        if status != 0:
            raise MemoryError("the native MoE kernel could not allocate its scratch rows")
    return out


def panel_gemm_max_rows() -> int:
    """Up to how many rows ``panel_gemm`` is the faster GEMM in this build (512 with AVX-512, 64 with AVX2);
    0 without the kernel."""
    return _build_constant("panel_gemm_max_rows")


def _panel_width() -> int:
    return _build_constant("panel_width")


def greedy_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Per row of float32 CPU ``logits`` [rows, vocab]: (argmax int64, max, logsumexp), in one C pass
    per row; None where the kernel is unavailable or the tensor is not such a matrix (use torch then).
    The argmax is torch's: the first index of the largest value."""
    fn = _row_kernel("greedy_stats") if _rows_f32(logits) and logits.shape[1] > 0 else None
    if fn is None:
        return None
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.long)
    mx = torch.empty(rows, dtype=torch.float32)
    lse = torch.empty(rows, dtype=torch.float32)
    fn(logits.data_ptr(), logits.stride(0), rows, vocab, tokens.data_ptr(), mx.data_ptr(), lse.data_ptr(),
       torch.get_num_threads())
    return tokens, mx, lse


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
    """float32 or bfloat16 CPU queries over a float32, bfloat16 or (where built) float16 cache, in the
    layouts the kernel reads (see the C source)."""
    return (
        query.device.type == "cpu"
        and query.dtype in _QUERY_DTYPES
        and query.stride(2) == 1
        and query.stride(1) == query.shape[2]
        and k_cache.is_contiguous()
        and k_cache.dtype in cache_dtypes()
    )


def _call(fns: dict[torch.dtype, Callable[..., int]], what: str, query: torch.Tensor, k_cache: torch.Tensor,
          v_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
          query_start_loc: torch.Tensor, scale: float, sliding_window: int | None, out: torch.Tensor,
          soft_cap: float | None, sinks: torch.Tensor | None) -> int:
    lib = _load()
    if lib is None:
        raise RuntimeError(f"native CPU kernel unavailable: {_error}")
    if not (out.is_contiguous() and v_cache.is_contiguous() and v_cache.shape == k_cache.shape):
        raise ValueError(f"{what} needs a contiguous out and caches of one shape")
    fn = fns.get(k_cache.dtype)
    if fn is None or v_cache.dtype != k_cache.dtype or query.dtype not in _QUERY_DTYPES or out.dtype != query.dtype:
        raise ValueError(f"{what} takes float32 or bfloat16 queries and out of their dtype over caches of one dtype "
                         f"in {[str(d) for d in fns]}; got query {query.dtype}, out {out.dtype}, caches "
                         f"{k_cache.dtype}/{v_cache.dtype}")
    if sinks is not None and not (sinks.is_cpu and sinks.dtype is torch.float32 and sinks.shape == query.shape[1:2]):
        raise ValueError(f"sinks must be a float32 CPU tensor of shape ({query.shape[1]},), got {sinks.dtype} "
                         f"{tuple(sinks.shape)} on {sinks.device}")
    sinks = None if sinks is None else sinks.contiguous()  # alive until the call returns
    bt = block_tables.to(torch.int32).contiguous()
    ctx = context_lens.to(torch.int32).contiguous()
    qsl = query_start_loc.to(torch.int32).contiguous()
    _, bs, kvh, d = k_cache.shape
    return fn(
        query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        bt.data_ptr(), bt.stride(0), ctx.data_ptr(), qsl.data_ptr(), ctx.shape[0], query.shape[1], kvh, d, bs,
        scale, sliding_window or 0, out.data_ptr(), torch.get_num_threads(), int(query.dtype is torch.bfloat16),
        None if sinks is None else sinks.data_ptr(), float(soft_cap or 0.0),
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
    *,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Fill ``out`` rows of every sequence with a single query token this step; other rows untouched. ``soft_cap``
    (0 or None: off) and ``sinks`` as in ``paged_attention``."""
    rc = _call(_fns, "paged_decode", query, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
               sliding_window, out, soft_cap, sinks)
    if rc != 0:
        raise RuntimeError("paged_decode could not start its threads")


def paged_prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
    *,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Fill ``out`` rows of every sequence with more than one query token this step (prompt chunks,
    causal from position ``context_len - q_len``); other rows untouched. ``soft_cap`` and ``sinks`` as in
    ``paged_decode``."""
    if (query.shape[1] // k_cache.shape[2] > _build_constant("prefill_max_group")
            or query.shape[2] > _build_constant("prefill_max_head_dim")):
        # wider groups of query heads per kv head, or longer heads, than the kernel takes go to SDPA
        reference.attend_prefill_chunks(query, k_cache, v_cache, block_tables, context_lens.long(),
                                        query_start_loc.long(), scale, sliding_window, out, soft_cap=soft_cap,
                                        sinks=sinks)
        return
    rc = _call(_prefill_fns, "paged_prefill", query, k_cache, v_cache, block_tables, context_lens,
               query_start_loc, scale, sliding_window, out, soft_cap, sinks)
    if rc == -1:
        raise MemoryError("paged_prefill could not allocate its key tiles")
    if rc != 0:
        raise ValueError(f"paged_prefill does not take this shape (rc {rc})")


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
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as ``reference.paged_attention`` (``soft_cap`` and ``sinks`` included): decode rows and
    prefill chunks in C, each by its kernel. bfloat16 queries are read and bfloat16 output rows written by the kernels themselves, rounded
    once from float32 accumulators. Over a bfloat16 cache on CPUs with bfloat16 dot products (AVX512-BF16)
    the products multiply bfloat16 pairs exactly and add them in float32, the prefill kernel's softmax
    weights rounded to bfloat16 as torch's bfloat16 SDPA does; otherwise the queries are widened (exactly)
    and all arithmetic is float32."""
    del max_context_len  # the C kernel bounds every row by its own context length
    num_tokens, num_heads, _ = query.shape
    if num_heads % k_cache.shape[2]:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {k_cache.shape[2]}")
    soft_cap = reference.check_features(soft_cap, sinks, num_heads, query.device)
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype)
    if num_tokens == 0 or context_lens.shape[0] == 0:
        return out
    # the kernels read queries and write rows of one dtype: bfloat16 when both are, else float32
    io_dtype = torch.bfloat16 if query.dtype is torch.bfloat16 and out.dtype is torch.bfloat16 else torch.float32
    if query.dtype is not io_dtype:
        query = query.float()
    direct = out.is_contiguous() and out.dtype is io_dtype
    target = out if direct else torch.empty(out.shape, dtype=io_dtype)
    paged_decode(query, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, sliding_window,
                 target, soft_cap=soft_cap, sinks=sinks)
    if max_query_len is None or max_query_len > 1:
        paged_prefill(query, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, sliding_window,
                      target, soft_cap=soft_cap, sinks=sinks)
    if target is not out:
        # only the rows this call owns: rows past query_start_loc[-1] stay untouched
        end = int(query_start_loc[-1])
        out[:end] = target[:end]
    return out
