"""One native kernel source (``kernels/csrc/<name>.c``) built alone for a narrower CPU than this one, so that a
test can swap its entry points in and run the paths those CPUs take: the plain C loops (no AVX2/FMA), AVX2
without AVX-512, AVX-512 without its bfloat16 instructions, and no OpenMP."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kvpilot.kernels import cpu_native

CC = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
# (name, extra flags, the compiler macros the flags must turn off)
VARIANTS = [("portable", "-mno-avx2 -mno-fma", ("__AVX2__", "__FMA__")), ("avx2", "-mno-avx512f", ("__AVX512F__",)),
            ("avx512-without-bf16", "-mno-avx512bf16", ("__AVX512BF16__",)), ("no-openmp", "", ())]


def _macros(flags: list[str]) -> str:
    assert CC is not None
    proc = subprocess.run([CC, "-march=native", *flags, "-dM", "-E", "-x", "c", "-"], input="", capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"{CC} does not take {' '.join(flags)}")
    return proc.stdout


def build_alone(source: str, variant: tuple[str, str, tuple[str, ...]], out: Path) -> ctypes.CDLL:
    """``csrc/<source>.c`` built for ``variant`` (one of VARIANTS) into ``out``, with the library's own compile
    flags; skips the test where this CPU has none of what the variant turns off, or the compiler refuses it."""
    name, flags, dropped = variant
    if CC is None:
        pytest.skip("no C compiler to build the CPU kernels")
    if not all(f"#define {macro} " in _macros([]) for macro in dropped):
        pytest.skip(f"the native build has no {' '.join(dropped)} to turn off: it runs the narrower paths already")
    assert not any(f"#define {macro} " in _macros(flags.split()) for macro in dropped)
    openmp = [] if name == "no-openmp" else cpu_native._OPENMP_FLAGS  # noqa: SLF001
    src = Path(cpu_native.__file__).parent / "csrc" / f"{source}.c"
    obj, lib = out / f"{source}.o", out / f"{source}.so"
    # compiled and linked apart, as cpu_native builds: -ffast-math on a link line adds crtfastmath, which would
    # switch this whole test process to flush subnormals to zero when the library loads
    subprocess.run([CC, "-c", *cpu_native._COMPILE_FLAGS, *flags.split(), *openmp, "-o", str(obj), str(src)],  # noqa: SLF001
                   check=True, capture_output=True, timeout=120)
    subprocess.run([CC, *cpu_native._LINK_FLAGS, *openmp, "-o", str(lib), str(obj), "-lm"], check=True,  # noqa: SLF001
                   capture_output=True, timeout=120)
    return ctypes.CDLL(str(lib))
