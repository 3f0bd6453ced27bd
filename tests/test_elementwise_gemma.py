"""Gemma's elementwise steps in the native CPU kernels (csrc/elementwise_cpu.c) against the torch expressions
they replace in the decoder:

- ``rms_norm`` of bfloat16 rows with a float32 weight (Gemma's folded ``1 + w``, OLMo 2's):
  ``F.rms_norm(x.float(), (dim,), weight, eps).to(bfloat16)``, normalized and scaled in float32, rounded once.
  The kernel sums the squares in another order than torch (float32 lanes added in float64) and computes
  1/sqrt(mean + eps) rounded once where torch rounds sqrt and the division: the float32 products differ by
  at most a float32 ulp or two, so a bfloat16 result differs only where they straddle a bfloat16 rounding
  boundary (about 2^-16 of the elements; measured 3 in 192,000) and then by one bfloat16 ulp.
- ``gelu_tanh_mul``: ``F.gelu(gate, approximate="tanh") * up``. torch computes a bfloat16 GELU in float32 and
  rounds it, then rounds the product: so does the kernel. Its float32 GELU is x / (1 + e^(-2u)), the same
  function as torch's 0.5 x (1 + tanh(u)) without the cancellation in 1 + tanh(u) as tanh(u) nears -1: there
  (gate below about -3, |GELU| < 5e-3) torch's float32 result carries an absolute error of about |x| 2^-25,
  more than a bfloat16 ulp of its tiny value, and below about -5.1 torch gives 0 where the kernel keeps the
  tiny value. Above -3 the two agree to a bfloat16 ulp (where float32 results straddle a rounding boundary).

Ragged widths leave scalar tails after the vector loops, rows are views with a row stride (as the model passes
them), 0 rows return an empty result, 32+ rows take the threaded path. Every test runs against the library as
built here and against ``csrc/elementwise_cpu.c`` built alone for narrower CPUs (no AVX2/FMA: the plain C
loops; AVX2 without AVX-512; AVX-512 without its bfloat16 conversion; no OpenMP), its entry points swapped
in."""

from __future__ import annotations

import ctypes
import math

import pytest
import torch
import torch.nn.functional as F

from kvpilot.kernels import cpu_native
from kvpilot.kernels import ops as K
from support import narrower_builds

pytestmark = pytest.mark.skipif(narrower_builds.CC is None, reason="no C compiler to build the CPU kernels")

BF16 = torch.bfloat16
EPS = 1e-6
# Gemma 3 270M's hidden size and head_dim, Gemma 3 1B's hidden size, and ragged widths (scalar tails)
DIMS = (640, 1152, 256, 100, 7)
ROWS = (0, 1, 5, 40)  # 40: the threaded path of every kernel here
# the new kernels' entry points and their ctypes signatures (see cpu_native._bind_row_kernels)
_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
ENTRY_POINTS = {"rms_norm_bf16_f32w": [_P, _I64, _I32, _I32, _P, _F32, _P, _I32],
                "rms_norm_bf16": [_P, _I64, _I32, _I32, _P, _F32, _P, _I32],
                "gelu_tanh_mul_f32": [_P, _I64, _I32, _I32, _P, _I32],
                "gelu_tanh_mul_bf16": [_P, _I64, _I32, _I32, _P, _I32]}
# "native": the library as built; the others csrc/elementwise_cpu.c built alone for a narrower CPU
VARIANTS = [("native", None, ()), *narrower_builds.VARIANTS]


@pytest.fixture(scope="module", params=VARIANTS, ids=[v[0] for v in VARIANTS])
def build(request, tmp_path_factory) -> dict[str, ctypes._CFuncPtr] | None:
    """None for the library as built; else csrc/elementwise_cpu.c built alone for a narrower CPU."""
    assert cpu_native.available(), cpu_native.build_error()
    if request.param[1] is None:
        return None
    lib = narrower_builds.build_alone("elementwise_cpu", request.param, tmp_path_factory.mktemp(request.param[0]))
    assert (torch.full((4,), 1e-39) * 1.0).min().item() > 0  # subnormals survive the load
    fns = {}
    for entry, argtypes in ENTRY_POINTS.items():
        fn = getattr(lib, "kvpilot_" + entry)
        fn.argtypes, fn.restype = argtypes, None
        fns[entry] = fn
    return fns


@pytest.fixture
def kernels(build, monkeypatch) -> None:
    """cpu_native's row kernels, with the variant's entry points swapped in."""
    for entry, fn in (build or {}).items():
        monkeypatch.setitem(cpu_native._row_fns, entry, fn)


def _rows(rows: int, dim: int, g: torch.Generator, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """[rows, dim] with a row stride of dim + 3: a view, as the model's slices of a fused projection are."""
    return (torch.randn(rows, dim + 3, generator=g) * scale).to(dtype)[:, :dim]


def _bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 values at |v| (8 significant bits), as float32; 0 at 0."""
    v = v.float().abs()
    ulp = torch.exp2(torch.floor(torch.log2(v.clamp_min(torch.finfo(torch.float32).tiny))) - 7)
    return torch.where(v == 0, torch.zeros_like(ulp), ulp)


def _assert_within_one_ulp_mostly_equal(got: torch.Tensor, want: torch.Tensor, max_unequal: float) -> None:
    assert got.dtype == want.dtype == BF16 and got.shape == want.shape
    diff = (got.float() - want.float()).abs()
    bound = torch.maximum(_bf16_ulp(got), _bf16_ulp(want))
    assert bool((diff <= bound).all()), f"max excess {(diff - bound).max().item()}"
    if want.numel():
        assert (got != want).float().mean().item() <= max_unequal


# ----------------------------------------------------------------------------------------------- rms_norm


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dim", DIMS)
def test_native_rms_norm_bf16_rows_float32_weight_rounds_once(kernels, rows, dim):
    g = torch.Generator().manual_seed(rows * 7919 + dim)
    x = _rows(rows, dim, g, 3.0, BF16)
    w = 1 + 0.5 * torch.randn(dim, generator=g)  # Gemma's 1 + w, folded when the weights load
    got = cpu_native.rms_norm(x, w, EPS)
    assert got is not None and got.dtype == BF16 and got.shape == (rows, dim) and got.is_contiguous()
    want = F.rms_norm(x.float(), (dim,), w, EPS).to(BF16)  # decoder._rms_norm's torch fallback
    _assert_within_one_ulp_mostly_equal(got, want, max_unequal=1e-3)


def test_native_rms_norm_float32_weight_is_not_rounded_before_it_scales(kernels):
    # the one rounding, not HF Llama's two (the row rounded, then scaled in bfloat16): weights near 1 + 1/512
    # move a product by less than a bfloat16 ulp, so rounding first would lose them
    g = torch.Generator().manual_seed(1)
    x = _rows(64, 640, g, 1.0, BF16)
    w = torch.full((640,), 1 + 1 / 512)
    got = cpu_native.rms_norm(x, w, EPS)
    want = F.rms_norm(x.float(), (640,), w, EPS).to(BF16)
    twice = (F.rms_norm(x.float(), (640,), None, EPS).to(BF16).float() * w).to(BF16)
    assert (twice != want).float().mean().item() > 0.1  # the case tells the two apart
    _assert_within_one_ulp_mostly_equal(got, want, max_unequal=1e-3)


@pytest.mark.parametrize("dim", (640, 256, 100))
def test_native_rms_norm_bfloat16_weight_keeps_hf_llama_rounding(kernels, dim):
    # a bfloat16 weight (a Llama-style model's) scales the row rounded to bfloat16, in bfloat16, as before
    g = torch.Generator().manual_seed(dim)
    x = _rows(40, dim, g, 3.0, BF16)
    w = torch.randn(dim, generator=g).to(BF16)
    got = cpu_native.rms_norm(x, w, EPS)
    want = w * F.rms_norm(x.float(), (dim,), None, EPS).to(BF16)
    assert got is not None
    # the normalized row may round another way (1/sqrt and the sum differ in the last float32 bit), and then
    # the bfloat16 product by up to an ulp either way of it
    diff = (got.float() - want.float()).abs()
    assert bool((diff <= 2 * torch.maximum(_bf16_ulp(got), _bf16_ulp(want))).all())
    assert (got != want).float().mean().item() <= 1e-2


def test_native_rms_norm_threads_do_not_change_the_bits(kernels):
    g = torch.Generator().manual_seed(2)
    x = _rows(256 * 4, 256, g, 3.0, BF16)  # Gemma 3 270M's q-norm over 4 heads of 256 tokens
    w = 1 + 0.5 * torch.randn(256, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_native.rms_norm(x, w, EPS)
        torch.set_num_threads(2)
        two = cpu_native.rms_norm(x, w, EPS)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_native_rms_norm_leaves_other_dtypes_and_layouts_to_torch(kernels):
    x = torch.randn(4, 640).to(BF16)
    w = torch.ones(640)
    assert cpu_native.rms_norm(x.float(), w.to(BF16), EPS) is None  # float32 rows, bfloat16 weight
    assert cpu_native.rms_norm(x.half(), w, EPS) is None
    assert cpu_native.rms_norm(x, w.double(), EPS) is None
    assert cpu_native.rms_norm(x, w.half(), EPS) is None
    assert cpu_native.rms_norm(x, torch.ones(1280)[::2], EPS) is None  # weight not contiguous
    assert cpu_native.rms_norm(x, w[:-1], EPS) is None
    assert cpu_native.rms_norm(x.t(), torch.ones(4), EPS) is None  # columns not contiguous
    assert cpu_native.rms_norm(x[None], w, EPS) is None  # not a matrix


# ----------------------------------------------------------------------------------------------- GeGLU


def _gelu_tanh_exact(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation in float64, as x sigmoid(2u) = 0.5 x (1 + tanh(u)): in float64 too the
    form with tanh cancels, its 1 + tanh(u) losing digits below gate ~ -6."""
    x = x.double()
    return x * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))


def test_native_gelu_tanh_of_every_bfloat16_gate(kernels):
    # up = 1: the output is GELU(gate) rounded to bfloat16, for every bfloat16 value in [-12, 12]
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(BF16)
    gate = bits[torch.isfinite(bits.float()) & (bits.float().abs() <= 12)]
    got = K.gelu_tanh_mul(torch.stack([gate, torch.ones_like(gate)], 1))[:, 0]
    want = F.gelu(gate, approximate="tanh")
    accurate = gate.float() >= -3  # where torch's float32 GELU is accurate to a few float32 ulps
    _assert_within_one_ulp_mostly_equal(got[accurate], want[accurate], max_unequal=1e-3)
    # below: torch loses the digits of 1 + tanh(u); both are within a few float32 ulps of 1 of each other
    low = ~accurate
    assert bool(((got[low].float() - want[low].float()).abs() <= 2.0 ** -20 * gate[low].float().abs()).all())
    # and the kernel is the accurate one: the exact value rounded, to an ulp, down to tiny values (from gate
    # ~ -10.4 on e^(-2u) is held at e^88: what is left there, |gate| e^-88, stands for 0)
    exact = _gelu_tanh_exact(gate)
    normal = exact.abs() >= 1e-30
    diff = (got[normal].double() - exact[normal]).abs()
    assert bool((diff <= _bf16_ulp(exact[normal]).double()).all())
    assert bool((got[~normal].float().abs() <= 1e-30).all())


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("inter", (2048, 1152, 256, 100, 7))
def test_native_gelu_tanh_mul_bfloat16_rounds_as_torch(kernels, rows, inter):
    g = torch.Generator().manual_seed(rows * 7919 + inter + 1)
    gu = _rows(rows, 2 * inter, g, 2.5, BF16)
    got = cpu_native.gelu_tanh_mul(gu)
    assert got is not None and got.dtype == BF16 and got.shape == (rows, inter) and got.is_contiguous()
    gate, up = gu.split(inter, dim=-1)
    want = F.gelu(gate, approximate="tanh") * up  # the decoder's torch expression
    # GELU(gate) rounded another way (an ulp) moves the product by up to two ulps of its own; where gate < -3
    # torch's GELU is off by up to |gate| 2^-25 (see the module docstring)
    diff = (got.float() - want.float()).abs()
    bound = 2 * torch.maximum(_bf16_ulp(got), _bf16_ulp(want)) + 2.0 ** -20 * (gate.float() * up.float()).abs()
    assert bool((diff <= bound).all())
    # bits equal but where GELU(gate) sits near a rounding boundary: over all bfloat16 gates above -3 that is
    # one value (-2.984375, where torch is the one off), 0.1% of these normal samples
    accurate = gate >= -3
    assert (got[accurate] != want[accurate]).sum().item() <= 2 + 2e-3 * accurate.sum().item()


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("inter", (2048, 100, 7))
def test_native_gelu_tanh_mul_float32(kernels, rows, inter):
    g = torch.Generator().manual_seed(rows * 7919 + inter + 2)
    gu = _rows(rows, 2 * inter, g, 2.5, torch.float32)
    got = cpu_native.gelu_tanh_mul(gu)
    assert got is not None and got.dtype == torch.float32 and got.shape == (rows, inter) and got.is_contiguous()
    gate, up = gu.split(inter, dim=-1)
    torch.testing.assert_close(got, F.gelu(gate, approximate="tanh") * up, atol=1e-5, rtol=1e-5)
    # relatively accurate everywhere (torch's form is not, below gate ~ -3): to the float32 rounding of the
    # exponent 2u carried through e^(-2u), a relative |2u| 2^-24, under 1e-5 while e^(-2u) is finite
    exact = _gelu_tanh_exact(gate) * up.double()
    torch.testing.assert_close(got.double(), exact, atol=1e-30, rtol=1e-5)


def test_native_gelu_tanh_mul_threads_do_not_change_the_bits(kernels):
    gu = _rows(64, 4096, torch.Generator().manual_seed(3), 2.5, BF16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_native.gelu_tanh_mul(gu)
        torch.set_num_threads(2)
        two = cpu_native.gelu_tanh_mul(gu)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_native_gelu_tanh_mul_leaves_other_inputs_to_torch(kernels):
    assert K.gelu_tanh_mul is cpu_native.gelu_tanh_mul
    gu = torch.randn(3, 64)
    assert cpu_native.gelu_tanh_mul(gu.double()) is None
    assert cpu_native.gelu_tanh_mul(gu.half()) is None
    assert cpu_native.gelu_tanh_mul(torch.zeros(2, 3)) is None  # no even split into gate and up
    assert cpu_native.gelu_tanh_mul(gu.t()) is None  # columns not contiguous
    assert cpu_native.gelu_tanh_mul(gu[0]) is None  # not a matrix
