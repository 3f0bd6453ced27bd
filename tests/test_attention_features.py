"""Attention logit soft-capping (Gemma 2) and attention sinks (gpt-oss) in every ``paged_attention`` backend: the
torch reference, the native C kernels (float32 and bfloat16 queries over float32/bfloat16/float16 caches) and the
Triton kernel (under TRITON_INTERPRET=1 in a child process, as tests/test_kernels.py runs it), each against a
float64 dense implementation written here from the definitions, not against another backend."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, replace

import pytest
import torch

from kvpilot.kernels import ops as K
from kvpilot.kernels import reference as R

# tests/test_kernels.py's narrower-builds test runs this file's native tests against narrower builds too

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_cc = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler to build the CPU kernel"
)

# ------------------------------------------------------------------------------------------ the definition


def dense_features(q, k, v, scale, *, window=None, soft_cap=None, sinks=None) -> torch.Tensor:
    """float64 attention of one sequence, written out from the definitions: q [ql, H, d] are the last ql
    positions of k/v [n, kvh, d]. Scores s = scale * q.k, soft-capped to c * tanh(s / c) (Gemma 2) before the
    causal/window mask; a sink logit per head joins the softmax denominator with no value (gpt-oss):
    out = sum_j e^(s_j - m) v_j / (sum_j e^(s_j - m) + e^(sink - m)), m the max over the scores and the sink."""
    ql, heads, _ = q.shape
    n, kvh, _ = k.shape
    g = heads // kvh
    pos = torch.arange(n - ql, n)[:, None]
    key = torch.arange(n)[None, :]
    visible = key <= pos
    if window is not None:
        visible &= pos - key < window
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(heads):
        kh, vh = k[:, h // g].double(), v[:, h // g].double()
        s = (q[:, h].double() @ kh.T) * scale
        if soft_cap is not None:
            s = soft_cap * torch.tanh(s / soft_cap)
        s = s.masked_fill(~visible, -math.inf)
        m = s.max(-1, keepdim=True).values
        if sinks is not None:
            m = m.clamp(min=float(sinks[h]))
        e = (s - m).exp()
        denom = e.sum(-1, keepdim=True)
        if sinks is not None:
            denom = denom + (float(sinks[h]) - m).exp()
        out[:, h] = (e @ vh) / denom
    return out


@dataclass
class Batch:
    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    keys: list[torch.Tensor]  # per sequence [ctx, kvh, d]: the values the cache holds
    values: list[torch.Tensor]
    scale: float

    def args(self) -> tuple:
        return (self.query, self.k_cache, self.v_cache, self.block_tables, self.context_lens, self.query_start_loc,
                self.scale)

    def dense(self, **features) -> torch.Tensor:
        qsl = self.query_start_loc.tolist()
        return torch.cat([dense_features(self.query[qsl[i]:qsl[i + 1]], k, v, self.scale, **features)
                          for i, (k, v) in enumerate(zip(self.keys, self.values, strict=True))])


def make_batch(ctx: list[int], q_lens: list[int], *, kvh: int, group: int, d: int, bs: int, seed: int,
               q_dtype: torch.dtype = torch.float32, kv_dtype: torch.dtype | None = None,
               fill: float = 0.0) -> Batch:
    """A paged batch: blocks shuffled across sequences, unused slots ``fill`` (NaN shows a kernel reading outside a
    context), table padding -1. Queries are scaled up so that the scores reach past a small soft cap, and are a
    strided slice of a fused projection, as the model passes them."""
    kv_dtype = kv_dtype or q_dtype
    g = torch.Generator().manual_seed(seed)
    nblocks = [math.ceil(c / bs) for c in ctx]
    total = sum(nblocks) + 2
    perm = torch.randperm(total, generator=g)
    k_cache = torch.full((total, bs, kvh, d), fill, dtype=kv_dtype)
    v_cache = torch.full_like(k_cache, fill)
    bt = torch.full((len(ctx), max(nblocks) + 1), -1, dtype=torch.int32)
    keys, values, used = [], [], 0
    for i, (c, nb) in enumerate(zip(ctx, nblocks, strict=True)):
        blocks = perm[used:used + nb]
        used += nb
        bt[i, :nb] = blocks.to(torch.int32)
        kd = torch.randn(c, kvh, d, generator=g).to(kv_dtype)
        vd = torch.randn(c, kvh, d, generator=g).to(kv_dtype)
        slots = (blocks.repeat_interleave(bs)[:c] * bs + torch.arange(c) % bs).long()
        k_cache.view(-1, kvh, d)[slots] = kd
        v_cache.view(-1, kvh, d)[slots] = vd
        keys.append(kd)
        values.append(vd)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    fused = (3.0 * torch.randn(int(qsl[-1]), kvh * group + kvh, d, generator=g)).to(q_dtype)
    return Batch(fused[:, :kvh * group], k_cache, v_cache, bt, torch.tensor(ctx, dtype=torch.int32), qsl, keys,
                 values, 1.0 / math.sqrt(d))


def make_sinks(heads: int, seed: int) -> torch.Tensor:
    """Sink logits on the scores' scale, so that they take a real share of each row's softmax."""
    return 1.0 + 2.0 * torch.randn(heads, generator=torch.Generator().manual_seed(1000 + seed))


# decode rows (ctx 1, a block edge, edge + 1, several blocks), a chunk over a cached prefix, a whole prompt and a
# chunk that spans several query and key tiles
def mixed_lens(bs: int) -> tuple[list[int], list[int]]:
    return [1, bs, bs + 1, 3 * bs + 5, 2 * bs + 7, 19, 150], [1, 1, 1, 1, 9, 19, 70]


# (soft_cap, use sinks): each alone and both. A cap of 2 bites hard on these scores (|s| up to ~10)
FEATURES = [(2.0, False), (None, True), (2.0, True)]
FEATURE_IDS = ["softcap", "sinks", "both"]


def features_for(batch: Batch, soft_cap: float | None, use_sinks: bool, seed: int) -> dict:
    return {"soft_cap": soft_cap, "sinks": make_sinks(batch.query.shape[1], seed) if use_sinks else None}


def assert_matches(got: torch.Tensor, batch: Batch, window: int | None, features: dict, tol: float) -> None:
    """``got`` is the definition's result within ``tol``, and the features change that result by far more than
    ``tol``: a backend that ignored them would fail."""
    want = batch.dense(window=window, **features)
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    plain = batch.dense(window=window)
    assert (want - plain).abs().max() > 20 * tol


# ----------------------------------------------------------------------------------------- torch reference


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize(("soft_cap", "use_sinks"), FEATURES, ids=FEATURE_IDS)
@pytest.mark.parametrize(("group", "q_dtype", "kv_dtype"), [(1, torch.float32, None), (3, torch.float32, None),
                                                            (4, torch.bfloat16, None), (2, torch.float32,
                                                                                        torch.float16)])
def test_reference_features(group, q_dtype, kv_dtype, soft_cap, use_sinks, window):
    batch = make_batch(*mixed_lens(16), kvh=2, group=group, d=32, bs=16, seed=group, q_dtype=q_dtype,
                       kv_dtype=kv_dtype)
    features = features_for(batch, soft_cap, use_sinks, group)
    got = R.paged_attention(*batch.args(), sliding_window=window, **features)
    assert got.dtype == q_dtype
    assert_matches(got, batch, window, features, 2e-5 if q_dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize(("soft_cap", "use_sinks"), FEATURES, ids=FEATURE_IDS)
def test_reference_features_decode_buckets_and_whole_prompts(soft_cap, use_sinks):
    # a widely ragged pure-decode batch (split into length buckets), then whole prompts from position 0 (which
    # without features take the mask-free causal SDPA)
    lens = [1, 3, 16, 17, 40, 90, 120, 200, 201, 33, 64, 5]
    assert R._decode_buckets(torch.tensor(lens), 16) is not None
    decode = make_batch(lens, [1] * len(lens), kvh=2, group=3, d=32, bs=16, seed=5)
    prompts = make_batch([70, 1, 33], [70, 1, 33], kvh=2, group=2, d=32, bs=16, seed=6)
    for batch, window in ((decode, None), (decode, 24), (prompts, None)):
        features = features_for(batch, soft_cap, use_sinks, 7)
        assert_matches(R.paged_attention(*batch.args(), sliding_window=window, **features), batch, window,
                       features, 2e-5)


def test_features_off_is_plain_attention():
    # soft_cap 0 or None and no sinks: the very same result as without the arguments
    batch = make_batch(*mixed_lens(16), kvh=2, group=3, d=32, bs=16, seed=3)
    plain = R.paged_attention(*batch.args())
    assert torch.equal(R.paged_attention(*batch.args(), soft_cap=0.0, sinks=None), plain)
    assert torch.equal(R.paged_attention(*batch.args(), soft_cap=None), plain)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_bad_features_are_value_errors(backend):
    from kvpilot.kernels import cpu_native

    if backend == "cpu" and not cpu_native.available():
        pytest.skip("no native CPU kernel here")
    impl = R if backend == "torch" else cpu_native
    batch = make_batch([20, 5], [1, 5], kvh=2, group=3, d=32, bs=16, seed=2)
    heads = batch.query.shape[1]
    bad = [
        ({"sinks": torch.zeros(heads - 1)}, "sinks"),
        ({"sinks": torch.zeros(1, heads)}, "sinks"),
        ({"sinks": torch.zeros(heads, dtype=torch.float64)}, "sinks"),
        ({"sinks": torch.zeros(heads, dtype=torch.bfloat16)}, "sinks"),
        ({"sinks": [0.0] * heads}, "sinks"),
        ({"soft_cap": -1.0}, "soft_cap"),
        ({"soft_cap": float("nan")}, "soft_cap"),
        ({"soft_cap": float("inf")}, "soft_cap"),
    ]
    for kwargs, name in bad:
        with pytest.raises(ValueError, match=name):
            impl.paged_attention(*batch.args(), **kwargs)


def test_ops_passes_the_features_through(monkeypatch):
    # the entry module hands soft_cap and sinks to whichever backend it picks, by those keyword names
    seen = {}
    real = R.paged_attention

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setitem(K._ATTENTION_IMPLS, "torch", type("M", (), {"paged_attention": staticmethod(spy)}))
    before = K.configure(replace(K.current(), attention_backend="torch"))
    try:
        batch = make_batch(*mixed_lens(16), kvh=2, group=3, d=32, bs=16, seed=4)
        features = features_for(batch, 2.0, True, 4)
        got = K.paged_attention(*batch.args(), sliding_window=20, **features)
    finally:
        K.configure(before)
    assert seen["soft_cap"] == 2.0 and seen["sinks"] is features["sinks"] and seen["sliding_window"] == 20
    assert_matches(got, batch, 20, features, 2e-5)


# ------------------------------------------------------------------------------------------ native C kernels

# (query dtype, cache dtype): a float32 model over each cache, a bfloat16 model over each cache (bfloat16 over
# bfloat16 takes the dot-product paths on CPUs with AVX512-BF16)
NATIVE_DTYPES = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                 (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.float16)]
# (group, head_dim, block_size): head sizes 64/128 with blocks of whole vectors take the decode kernel's vector
# path for 16-bit caches, 40 the plain loops (and a V tile padded to whole panels in the prefill kernel)
NATIVE_SHAPES = [(1, 64, 16), (4, 128, 32), (3, 40, 16)]


def _native_or_skip(kv_dtype: torch.dtype):
    from kvpilot.kernels import cpu_native

    if not cpu_native.available():
        pytest.skip(f"no native CPU kernel: {cpu_native.build_error()}")
    if kv_dtype not in cpu_native.cache_dtypes():
        pytest.skip(f"this build reads no {kv_dtype} caches (a compiler without _Float16)")
    return cpu_native


def _spy_entry_points(monkeypatch, cpu_native, kv_dtype: torch.dtype) -> list[str]:
    """Record which C kernels (decode, prefill) a call ran for ``kv_dtype`` caches."""
    calls: list[str] = []
    for table, name in ((cpu_native._fns, "decode"), (cpu_native._prefill_fns, "prefill")):
        real = table[kv_dtype]

        def spy(*args, _real=real, _name=name):
            calls.append(_name)
            return _real(*args)

        monkeypatch.setitem(table, kv_dtype, spy)
    return calls


@needs_cc
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize(("soft_cap", "use_sinks"), FEATURES, ids=FEATURE_IDS)
@pytest.mark.parametrize(("group", "d", "bs"), NATIVE_SHAPES, ids=[f"g{g}-d{d}-bs{b}" for g, d, b in NATIVE_SHAPES])
@pytest.mark.parametrize(("q_dtype", "kv_dtype"), NATIVE_DTYPES,
                         ids=[f"{str(q)[6:]}-over-{str(k)[6:]}" for q, k in NATIVE_DTYPES])
def test_native_features(monkeypatch, q_dtype, kv_dtype, group, d, bs, soft_cap, use_sinks, window):
    cpu_native = _native_or_skip(kv_dtype)
    # NaN in every unused slot and -1 table padding: reading outside a context would show
    batch = make_batch(*mixed_lens(bs), kvh=2, group=group, d=d, bs=bs, seed=group * d, q_dtype=q_dtype,
                       kv_dtype=kv_dtype, fill=float("nan"))
    features = features_for(batch, soft_cap, use_sinks, d)
    calls = _spy_entry_points(monkeypatch, cpu_native, kv_dtype)
    got = cpu_native.paged_attention(*batch.args(), sliding_window=window, **features)
    assert calls == ["decode", "prefill"] and got.dtype == q_dtype
    # bfloat16 output rows are rounded once (and, on the dot-product path, the prefill weights too)
    assert_matches(got, batch, window, features, 5e-5 if q_dtype == torch.float32 else 2e-2)


@needs_cc
@pytest.mark.parametrize(("soft_cap", "use_sinks"), FEATURES, ids=FEATURE_IDS)
def test_native_features_threads_and_long_chunks(soft_cap, use_sinks):
    # rows and tasks shared out among threads (each computed the same way), a long chunk taken by wider query
    # tasks, and a pure decode batch
    cpu_native = _native_or_skip(torch.float32)
    batch = make_batch([600, 40, 1, 33, 97], [520, 1, 1, 33, 1], kvh=2, group=3, d=64, bs=16, seed=8,
                       fill=float("nan"))
    decode = make_batch([5, 300, 17, 64], [1] * 4, kvh=1, group=8, d=64, bs=16, seed=9, fill=float("nan"))
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            for b, window in ((batch, None), (batch, 100), (decode, 40)):
                features = features_for(b, soft_cap, use_sinks, n)
                got = cpu_native.paged_attention(*b.args(), sliding_window=window, **features)
                assert_matches(got, b, window, features, 5e-5)
    finally:
        torch.set_num_threads(threads)


@needs_cc
def test_native_features_wide_groups_fall_back_to_sdpa(monkeypatch):
    # more query heads per kv head than the prefill kernel takes: its chunks go to the reference, features too
    cpu_native = _native_or_skip(torch.float32)
    calls = _spy_entry_points(monkeypatch, cpu_native, torch.float32)
    batch = make_batch([40, 9], [40, 1], kvh=1, group=17, d=32, bs=16, seed=5, fill=0.0)
    features = features_for(batch, 2.0, True, 5)
    assert_matches(cpu_native.paged_attention(*batch.args(), **features), batch, None, features, 5e-5)
    assert calls == ["decode"]


@needs_cc
def test_native_features_through_ops(kernel_settings_cpu):
    batch = make_batch(*mixed_lens(16), kvh=2, group=3, d=64, bs=16, seed=12, fill=0.0)
    features = features_for(batch, 2.0, True, 12)
    assert K.attention_backend_for(batch.query, batch.k_cache) == "cpu"
    assert_matches(K.paged_attention(*batch.args(), sliding_window=20, **features), batch, 20, features, 5e-5)


@pytest.fixture
def kernel_settings_cpu():
    from kvpilot.kernels import cpu_native

    if not cpu_native.available():
        pytest.skip("no native CPU kernel here")
    before = K.configure(replace(K.current(), attention_backend="cpu"))
    yield
    K.configure(before)


# ------------------------------------------------------------------------------------------------- Triton

# @triton.jit reads TRITON_INTERPRET when triton is imported, which in a pytest session may already have
# happened: as in tests/test_kernels.py, a normal run spawns a fresh interpreter with the variable set from the
# start, and that child runs the test_triton_* tests. KVPILOT_TEST_TRITON_DEVICE=cuda runs them compiled on a
# GPU instead (tensors moved there and back).
TRITON_TEST_DEVICE = os.environ.get("KVPILOT_TEST_TRITON_DEVICE", "").strip()


def _triton_child(env_update: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "test_triton_", __file__]
    return subprocess.run(cmd, env=dict(os.environ, **env_update), capture_output=True, text=True, timeout=900)


if not (INTERPRETED or TRITON_TEST_DEVICE):

    @pytest.mark.slow
    def test_features_under_triton_interpreter():
        pytest.importorskip("triton")
        r = _triton_child({"TRITON_INTERPRET": "1"})
        assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-4000:]
        assert " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-2000:]

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled Triton kernels need a CUDA GPU")
    def test_features_compiled_on_cuda():
        pytest.importorskip("triton")
        r = _triton_child({"TRITON_INTERPRET": "0", "KVPILOT_TEST_TRITON_DEVICE": "cuda"})
        assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-4000:]
        assert " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-2000:]


@pytest.fixture(scope="module")
def tk():
    import triton.language as tl

    import kvpilot.kernels.triton_kernels as mod

    if TRITON_TEST_DEVICE == "cuda":
        assert torch.cuda.is_available() and not mod._INTERPRET, "compiled kernels need CUDA, no interpreter"
    else:  # fail loudly rather than run compiled kernels on CPU tensors
        assert mod._INTERPRET and type(tl.standard.cdiv).__name__ == "InterpretedFunction"
    return mod


def triton_attention(tk, batch: Batch, **kwargs) -> torch.Tensor:
    """``tk.paged_attention`` on the test's device (the CPU under the interpreter), the result back on the CPU."""
    dev = "cuda" if TRITON_TEST_DEVICE == "cuda" else "cpu"
    args = [a.to(dev) if isinstance(a, torch.Tensor) else a for a in batch.args()]
    kwargs = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    return tk.paged_attention(*args, **kwargs).cpu()


TRITON_TOL = {torch.float32: 5e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize(("soft_cap", "use_sinks"), FEATURES, ids=FEATURE_IDS)
@pytest.mark.parametrize(("dtype", "kv_dtype", "group"), [(torch.float32, None, 2), (torch.bfloat16, None, 4),
                                                          (torch.float16, None, 1), (torch.float32, torch.float16, 3)])
def test_triton_features(tk, dtype, kv_dtype, group, soft_cap, use_sinks, window):
    # decode rows beside a chunk over a cached prefix and a chunk of several tiles, in one launch; NaN in every
    # unused slot (Triton never reads them)
    batch = make_batch([1, 17, 50, 40, 90], [1, 1, 1, 9, 40], kvh=2, group=group, d=32, bs=16, seed=group,
                       q_dtype=dtype, kv_dtype=kv_dtype, fill=float("nan"))
    features = features_for(batch, soft_cap, use_sinks, group)
    got = triton_attention(tk, batch, sliding_window=window, **features)
    assert got.dtype == dtype
    assert_matches(got, batch, window, features, TRITON_TOL[dtype])


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize(("soft_cap", "use_sinks"), FEATURES, ids=FEATURE_IDS)
def test_triton_features_decode_splits(tk, soft_cap, use_sinks, splits):
    # decode rows with their keys split across programs (flash-decoding), some splits empty for the short rows:
    # the sink must count once, in the reduce
    batch = make_batch([300, 1, 65], [1, 1, 1], kvh=1, group=8, d=32, bs=16, seed=9, fill=float("nan"))
    for window in (None, 100):
        features = features_for(batch, soft_cap, use_sinks, splits)
        got = triton_attention(tk, batch, max_query_len=1, max_context_len=300, sliding_window=window,
                               num_splits=splits, **features)
        assert_matches(got, batch, window, features, 5e-5)


def test_triton_features_validation_and_dispatch(tk):
    batch = make_batch([20, 5], [1, 5], kvh=2, group=3, d=32, bs=16, seed=2, fill=float("nan"))
    for kwargs, name in (({"sinks": torch.zeros(5)}, "sinks"), ({"sinks": torch.zeros(6, dtype=torch.float16)}, "sinks"),
                         ({"soft_cap": -2.0}, "soft_cap")):
        with pytest.raises(ValueError, match=name):
            triton_attention(tk, batch, **kwargs)
    if TRITON_TEST_DEVICE == "cuda":
        return  # CUDA tensors go to Triton without a setting; the calls above were Triton's
    before = K.configure(replace(K.current(), attention_backend="triton"))
    try:
        features = features_for(batch, 2.0, True, 2)
        got = K.paged_attention(*batch.args(), **features)  # NaN outside contexts: only Triton survives that
    finally:
        K.configure(before)
    assert_matches(got, batch, None, features, 5e-5)


if not (INTERPRETED or TRITON_TEST_DEVICE):  # the child processes started above run these
    for _name in [n for n in globals() if n.startswith("test_triton_")]:
        del globals()[_name]
