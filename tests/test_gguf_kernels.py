"""GGUF-quantized weights: the torch reference's dequantizer against the ``gguf`` package's own, then every
backend of ``linear``/``dequantize``/``embedding`` (native CPU kernels, Triton under TRITON_INTERPRET=1 in a child
process) against a float64 product with the reference's weights, on ragged shapes.

Native tests have "native" in their names: tests/test_kernels.py's narrower-builds test reruns them against the
library built without AVX-512 (the AVX2 paths), without AVX2 (the plain C loops) and without AVX512-BF16 (the
float32 paths on an AVX-512 CPU)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import replace

import numpy as np
import pytest
import torch

from kvpilot.kernels import cpu_native, gguf, gguf_reference
from kvpilot.kernels import ops as K
from support.triton_child import run_triton_tests_in_interpreter

gguf_pkg = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType, quants  # noqa: E402

# Triton tests run in a fresh interpreter with TRITON_INTERPRET=1 from the start (triton reads it on import):
# a normal run spawns it and the child runs test_triton_* (tests/test_kernels.py does the same)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

TYPES = sorted(gguf_reference.GGUF_TYPES)
NAMES = {t: name for t, (name, _, _) in gguf_reference.GGUF_TYPES.items()}
SMALL_TYPES = [t for t in TYPES if gguf_reference.GGUF_TYPES[t][1] == 32]  # the gguf package quantizes these
K_TYPES = [t for t in TYPES if gguf_reference.GGUF_TYPES[t][1] == 256]


@pytest.fixture
def kernel_settings() -> Iterator[Callable[..., None]]:
    before = K.current()
    yield lambda **changes: K.configure(replace(before, **changes))
    K.configure(before)


def make_weight(qtype: int, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """A valid ``[rows, row_bytes]`` weight: the gguf package's quantization of normal values for the types it
    quantizes; for the K-quants (it only dequantizes those) random bytes with finite random fp16 scales, so every
    code, 6-bit scale and min occurs."""
    rng = np.random.default_rng(seed)
    if qtype in SMALL_TYPES:
        data = rng.standard_normal((rows, cols)).astype(np.float32) * 0.1
        return torch.from_numpy(quants.quantize(data, GGMLQuantizationType(qtype)))
    _, elems, nbytes = gguf_reference.GGUF_TYPES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // elems, nbytes), dtype=np.uint8)
    scale_offsets = (208,) if qtype == 14 else (0, 2)  # Q6_K: d last; Q4_K/Q5_K: d, dmin first
    for off in scale_offsets:
        halves = (rng.standard_normal(blocks.shape[:2]) * 0.01).astype(np.float16)
        blocks[:, :, off:off + 2] = halves.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return torch.from_numpy(blocks.reshape(rows, -1))


# ------------------------------------------------------------------------------------- the reference


def test_type_table_is_ggmls():
    for qtype, (name, elems, nbytes) in gguf_reference.GGUF_TYPES.items():
        assert GGMLQuantizationType(qtype).name == name
        assert gguf_pkg.GGML_QUANT_SIZES[GGMLQuantizationType(qtype)] == (elems, nbytes)


def test_reference_dequantizes_a_hand_made_q4_0_block():
    # d = 0.5; byte j holds element j (low nibble) and j + 16 (high nibble): w = d * (q - 8)
    d = np.array([0.5], dtype=np.float16).view(np.uint8).tolist()
    qs = [(j & 15) | ((15 - j) << 4) for j in range(16)]
    block = torch.tensor([[*d, *qs]], dtype=torch.uint8)
    want = [0.5 * (j - 8) for j in range(16)] + [0.5 * (15 - j - 8) for j in range(16)]
    assert gguf_reference.dequantize(block, 2, 32).tolist() == [want]


@pytest.mark.parametrize("qtype", TYPES, ids=NAMES.get)
def test_reference_dequantize_matches_the_gguf_package(qtype):
    w = make_weight(qtype, 7, 512)
    want = quants.dequantize(w.numpy(), GGMLQuantizationType(qtype))
    got = gguf_reference.dequantize(w, qtype, 512)
    assert got.dtype == torch.float32 and got.shape == (7, 512)
    assert torch.equal(got, torch.from_numpy(want))
    assert torch.equal(gguf_reference.dequantize(w, qtype, 512, torch.bfloat16), got.bfloat16())


@pytest.mark.parametrize("qtype", SMALL_TYPES, ids=NAMES.get)
def test_reference_round_trips_the_gguf_packages_quantization(qtype):
    # the package's own quantize -> our dequantize: close to the data (a check of the oracle's direction too)
    rng = np.random.default_rng(1)
    data = rng.standard_normal((3, 96)).astype(np.float32)
    w = torch.from_numpy(quants.quantize(data, GGMLQuantizationType(qtype)))
    err = (gguf_reference.dequantize(w, qtype, 96) - torch.from_numpy(data)).abs().max().item()
    assert err < {8: 0.02, 6: 0.15, 7: 0.15}.get(qtype, 0.3)


def test_row_bytes():
    assert gguf.row_bytes(3, 576) == 18 * 20
    assert gguf.row_bytes(8, 576) == 18 * 34
    assert gguf.row_bytes(14, 512) == 2 * 210
    assert K.gguf_row_bytes(12, 256) == 144
    assert K.gguf_supported(3) and K.gguf_supported(14) and not K.gguf_supported(10) and not K.gguf_supported(1)
    with pytest.raises(ValueError, match="whole blocks of 256"):
        gguf.row_bytes(12, 576)
    with pytest.raises(ValueError, match="unsupported GGUF quantization type 10"):
        gguf.row_bytes(10, 256)


@pytest.mark.parametrize("backend", ["torch", "cpu", "auto"])
def test_bad_weights_are_value_errors(kernel_settings, backend):
    kernel_settings(attention_backend=backend)
    w = make_weight(3, 5, 96)
    x = torch.randn(2, 96)
    with pytest.raises(ValueError, match="row_bytes 60, got 80"):
        K.gguf_linear(torch.randn(2, 128)[:, :96], torch.cat([w, w[:, :20]], dim=1), 3)
    with pytest.raises(ValueError, match="row_bytes 80, got 60"):
        K.gguf_linear(torch.randn(2, 128), w, 3)  # x's width says 128 columns
    with pytest.raises(ValueError, match="row_bytes"):
        K.gguf_dequantize(w, 3, 64)
    with pytest.raises(ValueError, match="row_bytes"):
        K.gguf_embedding(torch.tensor([0]), w, 3, 128)
    with pytest.raises(ValueError, match="unsupported GGUF quantization type 10"):
        K.gguf_linear(x, w, 10)
    with pytest.raises(ValueError, match="unsupported GGUF quantization type 99"):
        K.gguf_dequantize(w, 99, 96)
    with pytest.raises(ValueError, match="uint8"):
        K.gguf_linear(x, w.to(torch.int16), 3)
    with pytest.raises(ValueError, match="bias"):
        K.gguf_linear(x, w, 3, bias=torch.zeros(4))
    with pytest.raises(ValueError, match="residual"):
        K.gguf_linear(x, w, 3, residual=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="out"):
        K.gguf_linear(x, w, 3, out=torch.zeros(2, 5, dtype=torch.bfloat16))
    with pytest.raises(IndexError):
        K.gguf_embedding(torch.tensor([5]), w, 3, 96)


# ---------------------------------------------------------------------------------- shared checks


def linear_f64(x, w_f32, bias, residual):
    """The definition in float64, with the per-element scale the tolerances are relative to."""
    y = x.double() @ w_f32.double().T
    scale = x.double().abs() @ w_f32.double().abs().T
    if bias is not None:
        y, scale = y + bias.double(), scale + bias.double().abs()
    if residual is not None:
        y, scale = y + residual.double(), scale + residual.double().abs()
    return y, scale


def assert_linear_close(got, x, w_f32, bias, residual, dtype, m):
    """float32: products and sums in another order than float64, ~1e-7 of the scale, held to 2e-6. bfloat16:
    the output's rounding (2^-9 of the value), and past NATIVE_MAX_ROWS the weight's rounding to bfloat16 for
    the GEMM (2^-9 of each product): held to 2^-7 of the scale."""
    want, scale = linear_f64(x, w_f32, bias, residual)
    assert got.dtype == dtype and got.shape == want.shape
    rtol = 2e-6 if dtype == torch.float32 else 2.0**-7
    excess = ((got.double() - want).abs() - rtol * scale).max().item()
    assert excess <= 0, f"M={m}: error past the tolerance by {excess:.3g}"


# (M, N, K) per family: M 1..33 around the native/large-M switch at 16; N never a multiple of anything; K an
# odd number of blocks (a partial last group of 4 in the dot kernels) and more
SMALL_SHAPES = [(1, 37, 96), (2, 19, 416), (3, 37, 96), (7, 45, 160), (16, 37, 416), (33, 29, 96)]
K_SHAPES = [(1, 37, 256), (2, 19, 768), (3, 37, 512), (7, 45, 256), (16, 21, 512), (33, 29, 256)]


def shapes_for(qtype):
    return SMALL_SHAPES if qtype in SMALL_TYPES else K_SHAPES


def make_case(qtype, m, n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = make_weight(qtype, n, k, seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    residual = torch.randn(m, n, generator=g).to(dtype)
    return x, w, bias, residual


# ---------------------------------------------------------------------------------- native CPU kernels

# with a C compiler the native kernels must build (a broken build fails these tests instead of skipping them)
needs_native = pytest.mark.skipif(
    os.environ.get("CC") is None and shutil.which("cc") is None and shutil.which("gcc") is None,
    reason="no C compiler to build the CPU kernels",
)


@needs_native
def test_native_build_has_the_paths_its_cpu_flags_allow():
    # the bfloat16 dot path exactly where the compiler (with this run's extra flags) has AVX512-BF16 and VBMI: on
    # in a native build on such a CPU, off in the narrower builds tests/test_kernels.py makes
    assert cpu_native.available(), cpu_native.build_error()
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    macros = subprocess.run([cc, "-march=native", *K.current().cpu_kernel_cflags, "-dM", "-E", "-x", "c", "-"],
                            input="", capture_output=True, text=True).stdout
    needed = ("__AVX2__", "__FMA__", "__AVX512F__", "__AVX512BW__", "__AVX512VL__", "__AVX512DQ__", "__AVX512BF16__",
              "__AVX512VBMI__")
    assert cpu_native.gguf_dot_path() == all(f"#define {m} " in macros for m in needed)


@needs_native
@pytest.mark.parametrize("qtype", TYPES, ids=NAMES.get)
def test_native_dequantize_matches_the_reference(qtype):
    w = make_weight(qtype, 13, 768 if qtype in K_TYPES else 160, seed=2)
    cols = 768 if qtype in K_TYPES else 160
    assert gguf.backend_for(w) == "cpu"
    want = gguf_reference.dequantize(w, qtype, cols)
    got = K.gguf_dequantize(w, qtype, cols)
    # the same formulas; the compiler may fuse a multiply and an add (one rounding less)
    torch.testing.assert_close(got, want, rtol=2.5e-7, atol=1e-7 * want.abs().max().item())
    got16 = K.gguf_dequantize(w, qtype, cols, torch.bfloat16)
    assert got16.dtype == torch.bfloat16
    torch.testing.assert_close(got16.float(), want.bfloat16().float(), rtol=2.0**-8, atol=0)
    half = K.gguf_dequantize(w, qtype, cols, torch.float16)  # other dtypes: float32, then converted
    assert half.dtype == torch.float16 and torch.equal(half, got.half())
    # strided rows (every other row of a larger matrix) and no rows
    torch.testing.assert_close(K.gguf_dequantize(w[::2], qtype, cols), want[::2], rtol=2.5e-7,
                               atol=1e-7 * want.abs().max().item())
    assert K.gguf_dequantize(w[:0], qtype, cols).shape == (0, cols)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("qtype", TYPES, ids=NAMES.get)
def test_native_linear_matches_the_definition(qtype, dtype):
    for i, (m, n, k) in enumerate(shapes_for(qtype)):
        x, w, bias, residual = make_case(qtype, m, n, k, dtype, seed=i)
        assert gguf.backend_for(x) == "cpu"
        w_f32 = gguf_reference.dequantize(w, qtype, k)
        assert_linear_close(K.gguf_linear(x, w, qtype), x, w_f32, None, None, dtype, m)
        assert_linear_close(K.gguf_linear(x, w, qtype, bias, residual), x, w_f32, bias, residual, dtype, m)
        # into a column slice of a wider output, bias only / residual only
        wide = torch.full((m, n + 7), 7.0, dtype=dtype)
        got = K.gguf_linear(x, w, qtype, bias=bias, out=wide[:, 3:3 + n])
        assert got.data_ptr() == wide[:, 3:].data_ptr()
        assert_linear_close(wide[:, 3:3 + n], x, w_f32, bias, None, dtype, m)
        assert (wide[:, :3] == 7).all() and (wide[:, 3 + n:] == 7).all()
        K.gguf_linear(x, w, qtype, out=wide[:, 1:1 + n])  # no bias, no residual
        assert_linear_close(wide[:, 1:1 + n], x, w_f32, None, None, dtype, m)
        assert (wide[:, 0] == 7).all()
        assert_linear_close(K.gguf_linear(x, w, qtype, residual=residual), x, w_f32, None, residual, dtype, m)


@needs_native
@pytest.mark.parametrize("qtype", [3, 8, 12, 14], ids=NAMES.get)
def test_native_linear_rows_do_not_depend_on_the_thread_count_or_batch(qtype):
    # each output row is one thread's, summed in one order: any thread count gives the same bits, and a row of x
    # gives the same result alone as in a batch of up to 4 (the kernels' register tile) -- what makes a
    # seeded request reproducible alone and batched
    m, n, k = 4, 301, 512
    x, w, _, _ = make_case(qtype, m, n, k, torch.float32, seed=3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = K.gguf_linear(x, w, qtype)
        torch.set_num_threads(2)
        two = K.gguf_linear(x, w, qtype)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    assert torch.equal(K.gguf_linear(x[2:3], w, qtype), one[2:3])


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("qtype", SMALL_TYPES, ids=NAMES.get)
def test_native_decode_row_on_two_threads(qtype, dtype):
    # one x row (a decode step) on the 32-element formats: tiles of 4 weight rows (the last one partial), the rows
    # in chunks that two threads share (each taking the other's not-started chunks): every row written once,
    # with bias and residual, into a strided output, the same bits on one thread, and as the row of a batch
    m, n, k = 4, 1001, 416  # about 0.2-0.4 MB of weight: two threads, many chunks; 13 blocks (Q8_0's odd tail)
    x, w, bias, residual = make_case(qtype, m, n, k, dtype, seed=5)
    w_f32 = gguf_reference.dequantize(w, qtype, k)
    before = torch.get_num_threads()
    try:
        got = {}
        for threads in (2, 1):
            torch.set_num_threads(threads)
            wide = torch.full((1, n + 5), float("nan"), dtype=dtype)
            K.gguf_linear(x[1:2], w, qtype, bias=bias, residual=residual[1:2], out=wide[:, 2:2 + n])
            assert wide[:, :2].isnan().all() and wide[:, 2 + n:].isnan().all()
            got[threads] = wide[:, 2:2 + n].clone()
            assert_linear_close(got[threads], x[1:2], w_f32, bias, residual[1:2], dtype, 1)
            plain = K.gguf_linear(x[1:2], w, qtype)
            assert torch.equal(plain, K.gguf_linear(x, w, qtype)[1:2])
            assert_linear_close(plain, x[1:2], w_f32, None, None, dtype, 1)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got[1], got[2])


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_native_linear_reads_no_uninitialized_scratch(dtype):
    # the kernels' per-call scratch (widened x, block sums) comes from malloc; heap memory freed full of NaN right
    # before makes a slot they forget to write show up as NaN or a changed result
    for qtype, k in ((3, 96), (2, 160), (12, 256), (14, 256)):  # an odd number of 32-element blocks, and K-quants
        x, w, _, _ = make_case(qtype, 1, 37, k, dtype)
        first = K.gguf_linear(x, w, qtype)
        assert torch.isfinite(first).all()
        for i in range(60):
            junk = torch.full((32 + 8 * (i % 16),), float("nan"))
            del junk
            assert torch.equal(K.gguf_linear(x, w, qtype), first), (NAMES[qtype], i)


@needs_native
def test_native_linear_takes_strided_and_batched_x():
    qtype, n, k = 3, 37, 160
    w = make_weight(qtype, n, k)
    w_f32 = gguf_reference.dequantize(w, qtype, k)
    base = torch.randn(2, 3, k + 32)
    x = base[..., 16:16 + k]  # rows k + 32 apart
    y = K.gguf_linear(x, w, qtype)
    assert y.shape == (2, 3, n)
    assert_linear_close(y.reshape(6, n), x.reshape(6, k), w_f32, None, None, torch.float32, 6)
    res = torch.randn(2, 3, n)
    y = K.gguf_linear(x, w, qtype, residual=res, out=torch.empty(2, 3, n))
    assert_linear_close(y.reshape(6, n), x.reshape(6, k), w_f32, None, res.reshape(6, n), torch.float32, 6)
    assert K.gguf_linear(torch.randn(0, k), w, qtype).shape == (0, n)
    # float16 x: no native kernel takes it, the reference does
    assert K.gguf_linear(x.half(), w, qtype).dtype == torch.float16


@needs_native
@pytest.mark.parametrize("qtype", [8, 3, 14], ids=NAMES.get)
def test_native_embedding_gathers_then_dequantizes(qtype):
    k = 256
    w = make_weight(qtype, 50, k)
    ids = torch.tensor([[3, 0, 49], [7, 7, 12]])
    want = gguf_reference.dequantize(w, qtype, k)
    for dtype in (torch.float32, torch.bfloat16):
        got = K.gguf_embedding(ids, w, qtype, k, dtype)
        assert got.shape == (2, 3, k) and got.dtype == dtype
        torch.testing.assert_close(got.float(), want[ids].to(dtype).float(), rtol=2.0**-8, atol=1e-7)
    assert K.gguf_embedding(torch.tensor([], dtype=torch.long), w, qtype, k).shape == (0, k)


@needs_native
def test_native_backend_setting(kernel_settings):
    x, w, bias, _ = make_case(3, 2, 37, 96, torch.float32)
    kernel_settings(attention_backend="torch")
    assert gguf.backend_for(x) == "torch"
    ref = K.gguf_linear(x, w, 3, bias)
    assert torch.equal(ref, gguf_reference.linear(x, w, 3, bias))
    kernel_settings(attention_backend="cpu")
    assert gguf.backend_for(x) == "cpu"
    torch.testing.assert_close(K.gguf_linear(x, w, 3, bias), ref, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------ Triton

if not INTERPRETED:

    @pytest.mark.slow
    def test_gguf_under_triton_interpreter():
        run_triton_tests_in_interpreter(__file__)

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled Triton kernels need a CUDA GPU")
    @pytest.mark.parametrize("qtype", TYPES, ids=NAMES.get)
    def test_gguf_compiled_on_cuda(qtype):
        for dtype in (torch.float32, torch.bfloat16):
            for i, (m, n, k) in enumerate(shapes_for(qtype)):
                x, w, bias, residual = make_case(qtype, m, n, k, dtype, seed=i)
                assert gguf.backend_for(x.cuda()) == "triton"
                got = K.gguf_linear(x.cuda(), w.cuda(), qtype, bias.cuda(), residual.cuda()).cpu()
                assert_linear_close(got, x, gguf_reference.dequantize(w, qtype, k), bias, residual, dtype, m)


@pytest.fixture(scope="module")
def gt():
    import triton.language as tl

    import kvpilot.kernels.gguf_triton as mod

    # fail loudly rather than run compiled kernels on CPU tensors
    assert mod._INTERPRET and type(tl.standard.cdiv).__name__ == "InterpretedFunction"
    return mod


@pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("qtype", TYPES, ids=NAMES.get)
def test_triton_linear_matches_the_definition(gt, qtype, dtype):
    # the interpreter runs every program in numpy: a decode row and a ragged batch past one BLOCK_M
    for i, (m, n, k) in enumerate([shapes_for(qtype)[0], shapes_for(qtype)[-1]]):
        x, w, bias, residual = make_case(qtype, m, n, k, dtype, seed=i)
        w_f32 = gguf_reference.dequantize(w, qtype, k)
        assert_linear_close(gt.linear(x, w, qtype, bias, residual), x, w_f32, bias, residual, dtype, m)
    assert_linear_close(gt.linear(x, w, qtype), x, w_f32, None, None, dtype, m)


@pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child")
def test_triton_dispatch(gt, kernel_settings):
    kernel_settings(attention_backend="triton")
    x, w, bias, residual = make_case(12, 3, 29, 256, torch.float32)
    assert gguf.backend_for(x) == "triton"
    wide = torch.zeros(3, 40)
    K.gguf_linear(x, w, 12, bias, residual, out=wide[:, 5:34])
    assert_linear_close(wide[:, 5:34], x, gguf_reference.dequantize(w, 12, 256), bias, residual, torch.float32, 3)
    with pytest.raises(ValueError, match="row_bytes"):
        K.gguf_linear(torch.randn(3, 512), w, 12)
