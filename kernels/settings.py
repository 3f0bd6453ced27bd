"""The kernels' switches, resolved once: the engine builds a ``KernelSettings`` from its EngineConfig at
start and hands it to ``ops.configure``; the kernels read ``current()`` and never the environment, so a
per-layer call costs an attribute read and a setting has one source.

This module imports nothing of the engine (import direction: kvpilot common <- kernels <- engine).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ATTENTION_BACKENDS", "TRITON_FP32_PRECISIONS", "KernelSettings", "current"]

ATTENTION_BACKENDS = ("auto", "triton", "cpu", "torch")
# tl.dot's input_precision values for float32 operands
TRITON_FP32_PRECISIONS = ("tf32x3", "ieee", "tf32")


@dataclass(frozen=True)
class KernelSettings:
    """What the engine's config says about kernel choice. The defaults are what an engine without
    settings runs."""

    # auto: triton for CUDA tensors, the native CPU kernels where they apply, else the torch reference;
    # forcing triton on CPU tensors is how tests run it under TRITON_INTERPRET=1
    attention_backend: str = "auto"
    # build and use the native C kernels on the CPU (attention, KV writes, row kernels, panel GEMM)
    cpu_kernels: bool = True
    # extra compile flags for that build (part of its cache key): e.g. "-mno-avx2" builds the portable
    # loops CPUs without AVX2 run, which is how tests check them on a machine that has it
    cpu_kernel_cflags: tuple[str, ...] = ()
    # oneDNN-prepacked GEMM weights on the CPU (engine/models/linear.py)
    prepack_weights: bool = True
    # panel copies of the GEMM weights for small steps: None decides by memory, True/False force it
    small_batch_gemm: bool | None = None
    # float32 Triton attention: tl.dot's precision and the rows of a prefill program (benchmarks compare
    # them: bench/kernels_gpu.py --fp32-variants)
    triton_fp32_precision: str = "tf32x3"
    triton_fp32_prefill_block_m: int = 32

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.triton_fp32_precision not in TRITON_FP32_PRECISIONS:
            raise ValueError(f"triton_fp32_precision must be one of {TRITON_FP32_PRECISIONS}, "
                             f"got {self.triton_fp32_precision!r}")
        m = self.triton_fp32_prefill_block_m
        if m < 16 or m & (m - 1):
            raise ValueError(f"triton_fp32_prefill_block_m must be a power of two >= 16, got {m}")
        if isinstance(self.cpu_kernel_cflags, str) or not all(isinstance(f, str) for f in self.cpu_kernel_cflags):
            raise ValueError(f"cpu_kernel_cflags must be a tuple of flags, got {self.cpu_kernel_cflags!r}")


_current = KernelSettings()


def current() -> KernelSettings:
    """The settings in effect (the defaults until ``ops.configure`` is called)."""
    return _current


def _set(settings: KernelSettings) -> KernelSettings:
    """Swap the settings in and return the previous ones; ``ops.configure`` is the public way in, as it
    also drops what the old settings built."""
    global _current
    previous, _current = _current, settings
    return previous
