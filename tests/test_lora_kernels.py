"""Batched LoRA (kernels/lora.py): the torch reference against a float64 definition, then every backend of
``lora_shrink_expand`` against it (the native CPU kernel, that kernel built for narrower CPUs, Triton under
TRITON_INTERPRET=1 in a child process), on segment tables with base runs, empty runs, a single row, and more
segments than slots; bfloat16's rounding; the native kernel's rows not depending on their segment's length or the
thread count; ``LoRASegments``' constructors; bad input.

Native tests have "native" in their names. The narrower builds (AVX2 only, no AVX2, AVX-512 without bfloat16, no
OpenMP) compile csrc/lora_cpu.c alone with the library's compile line plus the flags that turn those extensions
off, and swap its entry point in: building the whole library once per variant takes most of a minute here."""

from __future__ import annotations

import ctypes
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

from kvpilot.kernels import cpu_native, lora, lora_reference
from kvpilot.kernels import ops as K
from kvpilot.kernels.lora import LoRASegments
from support import narrower_builds
from support.triton_child import run_triton_tests_in_interpreter

# Triton tests run in a fresh interpreter with TRITON_INTERPRET=1 from the start (triton reads it on import)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["f32", "bf16"]


@pytest.fixture
def kernel_settings() -> Iterator[Callable[..., None]]:
    before = K.current()
    yield lambda **changes: K.configure(replace(before, **changes))
    K.configure(before)


# ------------------------------------------------------------------------------------------- the cases

# segment tables: (starts, slots) over 3 slots
TABLES = {
    "base-runs": LoRASegments.from_row_slots(np.array([-1, -1, 0, 0, 0, -1, 1, 1, 2, -1])),
    "empty-runs": LoRASegments(np.array([0, 0, 3, 3, 6, 9, 9]), np.array([1, 0, -1, 2, 0, 1])),
    "single-row": LoRASegments.from_row_slots(np.array([2])),
    # more segments than slots, each slot several times; rows from 1 to past the kernels' row tiles
    "many": LoRASegments(np.cumsum([0, 1, 5, 17, 2, 30, 1, 3, 13, 4, 1, 2, 26, 9, 3]),
                         np.array([0, 1, 2, 0, -1, 1, 0, 2, 2, 1, -1, 0, 1, 2])),
    "all-base": LoRASegments.from_row_slots(np.full(4, -1)),
}
# (in, out, R, the rank of each slot's adapter, zero-padded to R): ragged sizes so every tile has an edge
SHAPES = {"r16": (200, 72, 16, (4, 8, 16)), "r64": (100, 37, 64, (16, 4, 8)), "r7": (45, 21, 7, (7, 3, 1))}


@dataclass
class Case:
    y: torch.Tensor
    x: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    segments: LoRASegments


def make_case(table: str, shape: str, dtype: torch.dtype, seed: int = 0) -> Case:
    """Adapters whose update is about as large as y, so that a missing or misplaced one shows at bfloat16's
    precision."""
    g = torch.Generator().manual_seed(seed)
    k, n, r, ranks = SHAPES[shape]
    segments = TABLES[table]
    t = segments.num_rows
    a = torch.zeros(len(ranks), r, k)
    b = torch.zeros(len(ranks), n, r)
    for slot, rank in enumerate(ranks):
        a[slot, :rank] = torch.randn(rank, k, generator=g) / k**0.5
        b[slot, :, :rank] = torch.randn(n, rank, generator=g) / rank**0.5
    x, y = torch.randn(t, k, generator=g), torch.randn(t, n, generator=g)
    return Case(y.to(dtype), x.to(dtype), a.to(dtype), b.to(dtype), segments)


def definition(case: Case) -> torch.Tensor:
    """y + per segment (x A^T, rounded to the dtype as the shrink's output is) B^T, in float64."""
    y = case.y.double()
    starts, slots = case.segments.starts, case.segments.slots
    for i, slot in enumerate(slots):
        s, e = int(starts[i]), int(starts[i + 1])
        if slot >= 0:
            t = (case.x[s:e].double() @ case.a[slot].double().T).to(case.x.dtype).double()
            y[s:e] += t @ case.b[slot].double().T
    return y


def base_rows(segments: LoRASegments) -> np.ndarray:
    """The rows no adapter touches."""
    return np.repeat(segments.slots, np.diff(segments.starts)) < 0


def assert_matches(got: torch.Tensor, case: Case) -> None:
    """Base rows unchanged to the bit; the others as the definition, within the dtype's rounding (bfloat16: the
    result's, and the shrink's rounding where sums in another order round the other way)."""
    assert got.dtype == case.y.dtype and got.shape == case.y.shape
    base = torch.from_numpy(base_rows(case.segments))
    assert torch.equal(got[base], case.y[base])
    want = definition(case)
    tol = 1e-5 if case.y.dtype == torch.float32 else 2.0**-7
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * max(1.0, want.abs().max().item()))


def run(case: Case) -> torch.Tensor:
    y = case.y.clone()
    lora.lora_shrink_expand(y, case.x, case.a, case.b, case.segments)
    return y


def assert_rounds_once_to_nearest_even(device: str = "cpu") -> None:
    """bfloat16 y + two exact updates of 2^-9 each: summed first, 2^-8 is half an ulp of y = 1 + 2^-7, a tie that
    rounds to the even 1 + 2^-6 (each added and rounded alone would leave y as it was). A 1-row segment and a
    4-row one (the native kernel's two expand forms) at R = 16. (Not under the Triton interpreter: its float32 to
    bfloat16 conversion truncates, where the GPU's rounds to nearest even.)"""
    y = torch.full((5, 3), 1 + 2.0**-7, device=device).bfloat16()
    a = torch.zeros(1, 16, 2)
    a[0, :2, 0] = 1.0  # t = (x0, x0, 0, ...) with x0 = 1
    b = torch.zeros(1, 3, 16)
    b[0, :, :2] = 2.0**-9
    x = torch.tensor([[1.0, 0.0]]).expand(5, 2).contiguous()
    segments = LoRASegments(np.array([0, 1, 5]), np.array([0, 0]))
    lora.lora_shrink_expand(y, x.bfloat16().to(device), a.bfloat16().to(device), b.bfloat16().to(device), segments)
    assert (y.float() == 1 + 2.0**-6).all(), y
    # the shrink's output is rounded the same way: t = 1 + 2^-7 + 2^-8 (exact in float32) becomes 1 + 2^-6
    a[0, 0, :] = torch.tensor([1 + 2.0**-7, 2.0**-8])
    b[0, :, 1] = 0.0
    b[0, :, 0] = 1.0
    y = torch.zeros(5, 3, device=device).bfloat16()
    x = torch.ones(5, 2, dtype=torch.bfloat16)
    lora.lora_shrink_expand(y, x.to(device), a.bfloat16().to(device), b.bfloat16().to(device), segments)
    assert (y.float() == 1 + 2.0**-6).all(), y


# ------------------------------------------------------------------------------------------- reference


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("table", TABLES)
def test_reference_matches_the_definition(table, shape, dtype, kernel_settings):
    kernel_settings(attention_backend="torch")
    case = make_case(table, shape, dtype)
    assert lora.backend_for(case.x) == "torch"
    assert_matches(run(case), case)


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_bfloat16_sums_round_once_to_nearest_even(backend, kernel_settings):
    kernel_settings(attention_backend=backend)
    assert_rounds_once_to_nearest_even()


def test_the_definition_adds_the_update():
    # the tests' yardstick itself: a hand-worked row
    x = torch.tensor([[1.0, 2.0]])
    a = torch.tensor([[[1.0, 1.0]]])  # rank 1: t = x . (1, 1) = 3
    b = torch.tensor([[[2.0], [-1.0]]])  # y += 3 * (2, -1)
    case = Case(torch.tensor([[10.0, 20.0]]), x, a, b, LoRASegments.from_row_slots(np.array([0])))
    assert definition(case).tolist() == [[16.0, 17.0]]
    assert run(case).tolist() == [[16.0, 17.0]]


# ---------------------------------------------------------------------------------- native CPU kernel

# with a C compiler the native kernels must build (a broken build fails these tests instead of skipping them)
CC = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
needs_native = pytest.mark.skipif(CC is None, reason="no C compiler to build the CPU kernels")


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("table", TABLES)
def test_native_matches_the_definition(table, shape, dtype):
    assert cpu_native.available(), cpu_native.build_error()
    case = make_case(table, shape, dtype)
    assert lora.backend_for(case.x) == "cpu"
    assert_matches(run(case), case)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_native_long_segments_go_to_torch(dtype, monkeypatch):
    # segments past NATIVE_MAX_ROWS run through the reference's GEMM, the others through the kernel, in one call
    monkeypatch.setitem(lora.NATIVE_MAX_ROWS, dtype, 4)
    calls = []
    reference = lora_reference.lora_shrink_expand
    monkeypatch.setattr(lora_reference, "lora_shrink_expand",
                        lambda *args: calls.append((args[4], args[5])) or reference(*args))
    case = make_case("many", "r16", dtype)
    assert_matches(run(case), case)
    starts, slots = case.segments.starts, case.segments.slots
    long = [([int(starts[i]), int(starts[i + 1])], [int(slot)]) for i, slot in enumerate(slots)
            if slot >= 0 and starts[i + 1] - starts[i] > 4]
    assert calls == long and len(long) == 5


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_native_reads_strided_rows(dtype):
    # x and y as column slices of wider matrices (rows any stride apart, the last dim contiguous)
    case = make_case("many", "r16", dtype, seed=1)
    k, n = case.x.shape[1], case.y.shape[1]
    wide_x = torch.zeros(case.x.shape[0], k + 5, dtype=dtype)
    wide_x[:, 2:2 + k] = case.x
    wide_y = torch.full((case.y.shape[0], n + 9), 7.0, dtype=dtype)
    wide_y[:, 4:4 + n] = case.y
    lora.lora_shrink_expand(wide_y[:, 4:4 + n], wide_x[:, 2:2 + k], case.a, case.b, case.segments)
    assert_matches(wide_y[:, 4:4 + n], case)
    assert (wide_y[:, :4] == 7).all() and (wide_y[:, 4 + n:] == 7).all()


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_native_results_do_not_depend_on_the_thread_count(dtype):
    # each output is one thread's, summed in one order: one thread and two give the same bits (the case is large
    # enough for the kernel to use both)
    case = make_case("many", "r64", dtype, seed=2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(case)
        torch.set_num_threads(2)
        two = run(case)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    assert_matches(two, case)


def assert_rows_do_not_depend_on_their_segment(dtype: torch.dtype) -> None:
    """Each row's result is the same bits whether its segment is that row alone, a few rows, or 40, and with one
    thread or two: what makes a request's output the same alone and batched with others of its adapter."""
    before = torch.get_num_threads()
    try:
        for shape in SHAPES:
            k, n, r, _ = SHAPES[shape]
            case = make_case("single-row", shape, dtype, seed=4)
            g = torch.Generator().manual_seed(5)
            x, y = torch.randn(40, k, generator=g).to(dtype), torch.randn(40, n, generator=g).to(dtype)
            torch.set_num_threads(2)
            whole = y.clone()
            lora.lora_shrink_expand(whole, x, case.a, case.b, LoRASegments.from_row_slots(np.full(40, 1)))
            for threads, size in ((1, 1), (2, 1), (1, 2), (1, 3), (2, 4), (1, 5), (1, 13)):
                torch.set_num_threads(threads)
                for start in range(0, 40 - size + 1, 7):
                    part = y[start:start + size].clone()
                    lora.lora_shrink_expand(part, x[start:start + size], case.a, case.b,
                                            LoRASegments.from_row_slots(np.full(size, 1)))
                    assert torch.equal(part, whole[start:start + size]), (shape, threads, size, start)
    finally:
        torch.set_num_threads(before)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_native_rows_do_not_depend_on_their_segment(dtype):
    assert lora.backend_for(torch.zeros(1, dtype=dtype)) == "cpu"
    assert_rows_do_not_depend_on_their_segment(dtype)


# Narrower builds: csrc/lora_cpu.c alone with the library's own compile line (see the module docstring)
@pytest.fixture(scope="module", params=narrower_builds.VARIANTS, ids=[v[0] for v in narrower_builds.VARIANTS])
def narrower_build(request, tmp_path_factory) -> Callable[..., int]:
    lib = narrower_builds.build_alone("lora_cpu", request.param, tmp_path_factory.mktemp(request.param[0]))
    fn = lib.kvpilot_lora_shrink_expand_packed
    fn.argtypes, fn.restype = [ctypes.POINTER(ctypes.c_int64)], ctypes.c_int
    return fn


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_native_narrower_builds_match_the_definition(narrower_build, dtype, monkeypatch):
    assert cpu_native.available(), cpu_native.build_error()
    monkeypatch.setitem(cpu_native._row_fns, "lora_shrink_expand_packed", narrower_build)
    for table in TABLES:
        for shape in SHAPES:
            case = make_case(table, shape, dtype)
            assert_matches(run(case), case)
    if dtype == torch.bfloat16:
        assert_rounds_once_to_nearest_even()
    assert_rows_do_not_depend_on_their_segment(dtype)
    before = torch.get_num_threads()
    try:  # both threads' shares (the case is large enough for two)
        torch.set_num_threads(2)
        case = make_case("many", "r64", dtype, seed=2)
        assert_matches(run(case), case)
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------- LoRASegments


def test_from_row_slots():
    seg = LoRASegments.from_row_slots(np.array([3, 3, -1, 0, 0, 0, 3]))
    assert seg.starts.tolist() == [0, 2, 3, 6, 7] and seg.slots.tolist() == [3, -1, 0, 3]
    assert seg.num_rows == 7 and seg.num_segments == 4 and seg.any_adapter and seg.max_slot == 3
    assert seg.max_segment_rows == 3
    one = LoRASegments.from_row_slots([5])
    assert one.starts.tolist() == [0, 1] and one.slots.tolist() == [5]
    empty = LoRASegments.from_row_slots(np.zeros(0, dtype=np.int64))
    assert empty.starts.tolist() == [0] and empty.slots.tolist() == [] and empty.num_rows == 0
    assert not empty.any_adapter and empty.max_slot == -1 and empty.max_segment_rows == 0
    base = LoRASegments.from_row_slots(np.full(3, -1))
    assert base.slots.tolist() == [-1] and not base.any_adapter and base.max_segment_rows == 0
    with pytest.raises(ValueError, match="1-D"):
        LoRASegments.from_row_slots(np.zeros((2, 2)))


def test_narrow():
    seg = LoRASegments(np.array([0, 2, 2, 5, 9]), np.array([0, 1, -1, 2]))  # an empty run at 2
    cases = {
        (0, 9): ([0, 2, 5, 9], [0, -1, 2]),  # the empty run dropped
        (1, 7): ([0, 1, 4, 6], [0, -1, 2]),  # cut inside the first and last runs
        (2, 5): ([0, 3], [-1]),
        (3, 3): ([0], []),
        (6, 12): ([0, 3], [2]),  # an end past the last row is clipped, as slicing does
        (9, 9): ([0], []),
    }
    for (start, end), (starts, slots) in cases.items():
        got = seg.narrow(start, end)
        assert (got.starts.tolist(), got.slots.tolist()) == (starts, slots), (start, end)
        assert got.num_rows == min(end, 9) - start
    for start, end in ((-1, 3), (4, 2)):
        with pytest.raises(ValueError, match="narrow"):
            seg.narrow(start, end)
    # narrowed segments drive the kernel like any other: the rows of a slice of a batch
    case = make_case("many", "r16", torch.float32, seed=3)
    sub = Case(case.y[20:50], case.x[20:50], case.a, case.b, case.segments.narrow(20, 50))
    assert_matches(run(sub), sub)


@pytest.mark.parametrize("starts,slots", [([1, 3], [0]), ([0, 3, 2], [0, 1]), ([0, 3], [0, 1]), ([0, 3], [-2]),
                                          ([[0, 3]], [0])],
                         ids=["start-not-0", "decreasing", "lengths", "slot-below-base", "2-D"])
def test_malformed_segments_raise(starts, slots):
    seg = LoRASegments(np.array(starts), np.array(slots))
    x = torch.zeros(3, 8)
    with pytest.raises(ValueError):
        lora.lora_shrink_expand(torch.zeros(3, 4), x, torch.zeros(2, 2, 8), torch.zeros(2, 4, 2), seg)


# ------------------------------------------------------------------------------------------- bad input

def _bad_inputs() -> dict[str, tuple]:
    seg = LoRASegments.from_row_slots(np.array([0, 0, 1]))
    y, x, a, b = torch.zeros(3, 6), torch.zeros(3, 8), torch.zeros(2, 4, 8), torch.zeros(2, 6, 4)
    return {
        "rows-vs-segments": (y[:2], x[:2], a, b, seg),
        "x-rows": (y, x[:2], a, b, seg),
        "x-cols": (y, torch.zeros(3, 7), a, b, seg),
        "y-cols": (torch.zeros(3, 5), x, a, b, seg),
        "rank": (y, x, a, torch.zeros(2, 6, 3), seg),
        "slots": (y, x, a, torch.zeros(3, 6, 4), seg),
        "slot-out-of-range": (y, x, a[:1], b[:1], seg),
        "x-1d": (y, x[0], a, b, seg),
        "a-2d": (y, x, a[0], b, seg),
        "dtype": (y, x.bfloat16(), a, b, seg),
        "b-dtype": (y, x, a, b.double(), seg),
    }


BAD = _bad_inputs()


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("name", BAD)
def test_bad_input_raises(name, backend, kernel_settings):
    kernel_settings(attention_backend=backend)
    y, x, a, b, seg = BAD[name]
    before = y.clone()
    with pytest.raises(ValueError):
        lora.lora_shrink_expand(y, x, a, b, seg)
    assert torch.equal(y, before)


def test_dispatch(kernel_settings):
    x = torch.zeros(2, 4)
    assert lora.backend_for(x) == ("cpu" if cpu_native.lora_fn() is not None else "torch")
    assert lora.backend_for(x.half()) == "torch"  # the native kernel reads float32 and bfloat16
    kernel_settings(attention_backend="torch")
    assert lora.backend_for(x) == "torch"
    # the engine's entry points are these
    assert K.lora_shrink_expand is lora.lora_shrink_expand and K.LoRASegments is LoRASegments


def test_float16_runs_the_reference():
    case = make_case("base-runs", "r16", torch.float16)
    got = run(case)
    base = torch.from_numpy(base_rows(case.segments))
    assert torch.equal(got[base], case.y[base])
    torch.testing.assert_close(got.double(), definition(case), rtol=2.0**-9, atol=2.0**-8 * 8)


# ------------------------------------------------------------------------------------------------ Triton

if not INTERPRETED:

    @pytest.mark.slow
    def test_lora_under_triton_interpreter():
        run_triton_tests_in_interpreter(__file__)

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled Triton kernels need a CUDA GPU")
    @pytest.mark.parametrize("dtype", [*DTYPES, torch.float16], ids=[*DTYPE_IDS, "f16"])
    def test_lora_compiled_on_cuda(dtype):
        for table in TABLES:
            for shape in SHAPES:
                case = make_case(table, shape, dtype)
                y = case.y.cuda()
                assert lora.backend_for(y) == "triton"
                lora.lora_shrink_expand(y, case.x.cuda(), case.a.cuda(), case.b.cuda(), case.segments)
                assert_matches(y.cpu(), case)
        if dtype == torch.bfloat16:
            assert_rounds_once_to_nearest_even("cuda")


@pytest.fixture(scope="module")
def lt():
    import triton.language as tl

    import kvpilot.kernels.lora_triton as mod

    # fail loudly rather than run compiled kernels on CPU tensors
    assert mod.INTERPRET and type(tl.standard.cdiv).__name__ == "InterpretedFunction"
    return mod


@pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", ["r16", "r7"])
@pytest.mark.parametrize("table", ["base-runs", "empty-runs", "many"])
def test_triton_matches_the_definition(lt, table, shape, dtype, kernel_settings):
    kernel_settings(attention_backend="triton")
    case = make_case(table, shape, dtype)
    assert lora.backend_for(case.x) == "triton"
    assert_matches(run(case), case)


@pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child")
def test_triton_ranks_past_one_tile_and_strided_rows(lt, kernel_settings):
    kernel_settings(attention_backend="triton")
    case = make_case("base-runs", "r64", torch.float32)
    case.a = torch.cat([case.a, case.a], dim=1)  # R = 128: two rank tiles in the shrink, two steps in the expand
    case.b = torch.cat([case.b, case.b], dim=2)
    n = case.y.shape[1]
    wide = torch.full((case.y.shape[0], n + 3), 7.0)
    wide[:, 1:1 + n] = case.y
    lora.lora_shrink_expand(wide[:, 1:1 + n], case.x, case.a, case.b, case.segments)
    assert_matches(wide[:, 1:1 + n], case)
    assert (wide[:, 0] == 7).all() and (wide[:, 1 + n:] == 7).all()
    starts, slots = case.segments.device_tables(torch.device("cpu"))
    assert starts.dtype == slots.dtype == torch.int32 and starts.tolist() == case.segments.starts.tolist()
    assert case.segments.device_tables(torch.device("cpu"))[0] is starts  # made once per batch


@pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child")
@pytest.mark.parametrize("name", ["rows-vs-segments", "rank", "slot-out-of-range", "dtype"])
def test_triton_bad_input_raises(lt, name, kernel_settings):
    kernel_settings(attention_backend="triton")
    y, x, a, b, seg = BAD[name]
    with pytest.raises(ValueError):
        lora.lora_shrink_expand(y, x, a, b, seg)
