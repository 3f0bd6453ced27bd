"""Fixtures that several test files share."""

from __future__ import annotations

import os

import pytest

from kvpilot.daemon.engine import LLM

# Test engines (and the servers tests start, which inherit this) keep their KV caches lazily mapped:
# mapping in a 1 GiB default cache per engine costs CI seconds of a core and the memory to hold it.
# tests/test_host_memory.py turns it on to test it.
os.environ.setdefault("KVPILOT_POPULATE_KV", "0")

# tests/test_kernels.py's narrower-builds test runs the native-kernel tests in a child with the library built
# with extra flags: a test-only variable (KVPILOT_TEST_* is no flag's), turned into the kernels' setting here
if _test_cflags := os.environ.get("KVPILOT_TEST_CPU_KERNEL_CFLAGS", "").split():
    from dataclasses import replace

    from kvpilot.kernels import ops

    ops.configure(replace(ops.current(), cpu_kernel_cflags=tuple(_test_cflags)))


@pytest.fixture(scope="module")
def llm() -> LLM:
    """The real small model, once a module (loading it is the slow part); a module that wants other
    settings defines its own `llm`, which wins over this one. float32 on every machine: "auto" is
    bfloat16 where the CPU has AMX or AVX512-BF16, and the tests' exact comparisons (a seeded request
    alone and in a batch) are float32's."""
    return LLM(model="builtin://smollm2-135m", dtype="float32", num_kv_blocks=256)
