"""The kernels' entry module: paged KV-cache kernels with backend dispatch, and the native CPU row kernels.

The engine imports kernels only from here (tests/test_import_directions.py keeps it so). Triton runs when the tensors are on CUDA and triton is
importable. On the CPU, float32 or bfloat16 queries over a float32, bfloat16 or float16 cache go to the
native kernels (``cpu_native``, built on first use: decode rows and prefill chunks in C, each reading the
paged cache in place and computing in float32) when a C compiler is there, and everything else to the
torch reference; ``store_kv`` of float32 rows, and of 16-bit rows into a cache of their dtype, goes to C
as well. ``KernelSettings.attention_backend`` (the engine's ``attention_backend``) = triton|cpu|torch
forces one (forcing triton on CPU tensors is how tests run it under ``TRITON_INTERPRET=1``). Triton is
optional: it is imported on first use only.

Settings: the engine calls ``configure(KernelSettings(...))`` once at start; every kernel reads
``current()`` from then on (see ``settings``).

Caller contract (every backend):
- caches are contiguous ``[num_blocks, block_size, num_kv_heads, head_dim]`` and hold finite
  values (allocate with ``torch.zeros``): the reference masks unused slots by score, and a NaN
  left in a slot it gathers would still leak through ``0 * NaN``; Triton never reads them.
- query/key/value may be strided views (e.g. slices of a fused qkv) with a contiguous last dim.
- the caches (k and v of one dtype) may have another dtype than query/key/value (the engine's
  ``kv_cache_dtype``): ``store_kv`` converts key/value to it (into float16 saturating at +-65504,
  not inf) and ``paged_attention`` reads it as the query's dtype; ``out`` is the query's dtype.
- ``block_tables`` entries past a sequence's last block are never used; pad them with 0 or -1.
- ``max_query_len``/``max_context_len`` must be upper bounds when given (on CUDA, pass them to
  avoid a device sync). Rows of ``query`` past ``query_start_loc[-1]`` are left untouched.
- ``copy_blocks`` pairs must not chain (no dst that is also a src in the same call).
"""

from __future__ import annotations

from types import ModuleType

import torch

from . import cpu_native, reference
from . import settings as _settings

# The model's native CPU steps: each returns None (or False) where it does not apply, and the caller falls
# back to torch.
from .cpu_native import available as native_available
from .cpu_native import (
    gelu_tanh_mul,
    greedy_stats,
    pack_panels,
    panel_gemm,
    panel_gemm_max_rows,
    rms_norm,
    rope_,
    silu_mul,
)
from .lazy import LazyModule
from .lora import LoRASegments, lora_shrink_expand
from .settings import KernelSettings, current

__all__ = [
    "KernelSettings",
    "configure",
    "current",
    "store_kv",
    "paged_attention",
    "copy_blocks",
    "swap_blocks",
    "backend_for",
    "attention_backend_for",
    "triton_available",
    "native_available",
    "greedy_stats",
    "pack_panels",
    "panel_gemm",
    "panel_gemm_max_rows",
    "rms_norm",
    "rope_",
    "silu_mul",
    "gelu_tanh_mul",
    "moe_route",
    "native_moe_route",
    "moe_backend_for",
    "fused_moe",
    "fused_moe_cpu",
    "PackedExperts",
    "onednn_pack_supported",
    "GGUFExperts",
    "fused_moe_gguf",
    "gguf_moe_native_args",
    "gguf_moe_native_available",
    "decode_layers_entry",
    "GGUF_NATIVE_MAX_ROWS",
    "fp8_quantize",
    "fp8_quantize_weight",
    "fp8_dequantize",
    "fp8_linear",
    "fp8_block_linear",
    "GGUF_TYPES",
    "gguf_supported",
    "gguf_row_bytes",
    "gguf_dequantize",
    "gguf_linear",
    "gguf_embedding",
    "LoRASegments",
    "lora_shrink_expand",
]

_TRITON = LazyModule("triton_kernels")


def triton_available() -> bool:
    return _TRITON.load() is not None


def configure(settings: KernelSettings) -> KernelSettings:
    """Put ``settings`` in effect for every later kernel call and return the previous ones (a test restores
    them with another ``configure``). A native CPU build made under other build settings is dropped, so the
    next call builds or loads the one these ask for. Forcing triton where it cannot be imported fails here,
    at engine start, rather than at the first step. The settings are the process's: one engine per process."""
    if not isinstance(settings, KernelSettings):
        raise TypeError(f"expected KernelSettings, got {type(settings).__name__}")
    if settings.attention_backend == "triton" and _TRITON.load() is None:
        raise RuntimeError(f"attention_backend='triton' but triton cannot be imported: {_TRITON.error}")
    previous = _settings._set(settings)  # noqa: SLF001 - the one writer of the settings
    if (previous.cpu_kernels, previous.cpu_kernel_cflags) != (settings.cpu_kernels, settings.cpu_kernel_cflags):
        cpu_native.reset()
    return previous


def backend_for(t: torch.Tensor) -> str:
    """'triton' or 'torch' for a call on tensor ``t`` (the configured backend first, then the device). The
    CPU attention choice between 'cpu' and 'torch' is ``attention_backend_for``."""
    forced = current().attention_backend
    if forced in ("torch", "cpu"):
        return "torch"
    if forced == "triton":
        if _TRITON.load() is None:
            raise RuntimeError(f"attention_backend='triton' but triton cannot be imported: {_TRITON.error}")
        return "triton"
    if t.is_cuda and _TRITON.load() is not None:
        return "triton"
    return "torch"


def attention_backend_for(query: torch.Tensor, k_cache: torch.Tensor) -> str:
    """'triton', 'cpu' (native decode kernel) or 'torch' for a paged_attention call."""
    if backend_for(query) == "triton":
        return "triton"
    forced = current().attention_backend
    if forced != "torch" and cpu_native.supports(query, k_cache):
        return "cpu"
    if forced == "cpu":
        raise RuntimeError(f"attention_backend='cpu' needs float32 or bfloat16 CPU queries, a float32, bfloat16 or "
                           f"float16 cache and a built kernel ({cpu_native.build_error() or 'unsupported tensors'})")
    return "torch"


def _impl(t: torch.Tensor) -> ModuleType:
    return _TRITON.module if backend_for(t) == "triton" else reference  # type: ignore[return-value]


_ATTENTION_IMPLS = {"torch": reference, "cpu": cpu_native}


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` ``[T, kvh, d]`` into cache slots, converted to the cache dtype; slot -1
    is skipped. In place."""
    # float32 rows on the CPU: one native pass (a slot out of range falls through to the reference's error)
    native = k_cache.is_cpu and current().attention_backend not in ("torch", "triton")
    if native and cpu_native.store_kv(key, value, k_cache, v_cache, slot_mapping):
        return
    _impl(k_cache).store_kv(key, value, k_cache, v_cache, slot_mapping)


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
    """Varlen causal attention over the paged cache; returns ``[num_query_tokens, H, d]``.

    ``context_lens[i]`` counts sequence i's tokens in the cache including this step's (store_kv
    runs first); its query rows are the last ``q_i`` positions. With ``sliding_window`` w a
    query at position p sees keys k with p - w < k <= p.

    ``soft_cap`` c (Gemma 2's attention logit soft-capping; None or 0: off): each score
    s = scale * q.k becomes c * tanh(s / c) before the mask and softmax.
    ``sinks`` (gpt-oss's attention sinks; None: off): a float32 tensor ``[H]`` on the query's device, one
    logit per query head of this call, that joins every row's softmax denominator with no value:
    out = sum_j e^(s_j - m) v_j / (sum_j e^(s_j - m) + e^(sinks[h] - m)), m the max over the visible
    scores and the sink (the sink is neither scaled nor capped, and is there under a sliding window too).
    Sinks of another shape or dtype, or a negative (or non-finite) soft_cap, raise ValueError.
    """
    backend = attention_backend_for(query, k_cache)
    impl = _TRITON.module if backend == "triton" else _ATTENTION_IMPLS[backend]
    return impl.paged_attention(  # type: ignore[union-attr]
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        query_start_loc,
        scale,
        max_query_len=max_query_len,
        max_context_len=max_context_len,
        sliding_window=sliding_window,
        out=out,
        soft_cap=soft_cap,
        sinks=sinks,
    )


def copy_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], src_to_dst: torch.Tensor) -> None:
    """Copy-on-write: for each (src, dst) row of int64 ``[N, 2]``, copy the block in every layer."""
    if not k_caches:
        return
    _impl(k_caches[0]).copy_blocks(k_caches, v_caches, src_to_dst)


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, src_to_dst: torch.Tensor) -> None:
    """Copy blocks between a device cache and a host cache (same block shape), for swap preemption."""
    reference.swap_blocks(src, dst, src_to_dst)


# ------------------------------------------------------------------------------- mixture of experts
# Routing is plain torch (moe.moe_route), or native for the layers whose experts run natively (cpu_native's
# moe_route, which the native decode loop repeats bit for bit). fused_moe follows the attention switch:
# attention_backend=triton forces Triton (tests run it on CPU tensors under TRITON_INTERPRET=1), torch forces the
# reference, cpu and auto take the CPU path on CPU tensors and Triton on CUDA ones. The MoE Triton module loads on
# its own, so a problem in the attention kernels' module does not take MoE down with it.
from . import moe, moe_reference  # noqa: E402 - kept beside their dispatch
from .cpu_native import moe_route as native_moe_route  # noqa: E402
from .moe import PackedExperts, fused_moe_cpu, moe_route, onednn_pack_supported  # noqa: E402

_MOE_TRITON = LazyModule("moe_triton")


def moe_backend_for(hidden: torch.Tensor) -> str:
    """'triton', 'cpu' (moe.fused_moe_cpu) or 'torch' (moe_reference) for a fused_moe call on ``hidden``."""
    forced = current().attention_backend
    if forced == "triton" or (forced == "auto" and hidden.is_cuda):
        if _MOE_TRITON.load() is not None:
            return "triton"
        if forced == "triton":
            raise RuntimeError(f"attention_backend='triton' but the MoE kernels cannot load: {_MOE_TRITON.error}")
    if hidden.is_cpu and forced != "torch":
        return "cpu"
    return "torch"


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    swiglu_alpha: float = moe_reference.GPT_OSS_ALPHA,
    swiglu_limit: float = moe_reference.GPT_OSS_LIMIT,
) -> torch.Tensor:
    """The routed experts of a MoE layer, ``[T, H]`` in the hidden dtype: ``hidden [T, H]``, ``w13 [E, 2I, H]``
    (gate|up stacked; interleaved for ``activation="gpt_oss"``), ``w2 [E, H, I]``, ``topk_weights``/``topk_ids``
    ``[T, k]`` from ``moe_route``. The definition is ``moe_reference``'s docstring."""
    backend = moe_backend_for(hidden)
    if backend == "triton":
        impl = _MOE_TRITON.module.fused_moe  # type: ignore[union-attr]
    elif backend == "cpu":
        impl = moe.fused_moe_cpu
    else:
        impl = moe_reference.fused_moe
    return impl(hidden, w13, w2, topk_weights, topk_ids, activation=activation, w13_bias=w13_bias,
                w2_bias=w2_bias, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)


# ------------------------------------------------------------------------------- FP8 weights
# per-channel e4m3 weights: torch._scaled_mm on CUDA (fp8 tensor cores), block-scaled ones a Triton kernel; the
# torch reference elsewhere (kernels/fp8.py). The CPU models dequantize FP8 at load and never call these.
# a CPU decode step's layers in one native call (models/native_decode.py writes its records)
from .cpu_native import decode_layers_entry  # noqa: E402
from .fp8 import block_linear as fp8_block_linear  # noqa: E402 - kept beside their dispatch
from .fp8 import dequantize as fp8_dequantize  # noqa: E402
from .fp8 import linear as fp8_linear  # noqa: E402
from .fp8 import quantize as fp8_quantize  # noqa: E402
from .fp8 import quantize_weight as fp8_quantize_weight  # noqa: E402

# ------------------------------------------------------------------------------- GGUF-quantized weights
# blocks kept as the file has them: native CPU kernels (small M in registers, large M through dequantized tiles and
# torch's GEMM), a Triton kernel on CUDA, the torch reference elsewhere (kernels/gguf.py)
from .gguf import GGUF_TYPES  # noqa: E402 - kept beside their dispatch
from .gguf import NATIVE_MAX_ROWS as GGUF_NATIVE_MAX_ROWS  # noqa: E402
from .gguf import dequantize as gguf_dequantize  # noqa: E402
from .gguf import embedding as gguf_embedding  # noqa: E402
from .gguf import linear as gguf_linear  # noqa: E402
from .gguf import row_bytes as gguf_row_bytes  # noqa: E402
from .gguf import supported as gguf_supported  # noqa: E402
from .gguf_moe import GGUFExperts, fused_moe_gguf  # noqa: E402 - a GGUF's MoE experts on their blocks
from .gguf_moe import native_args as gguf_moe_native_args  # noqa: E402
from .gguf_moe import native_available as gguf_moe_native_available  # noqa: E402
