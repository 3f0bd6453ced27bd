"""Mixture-of-experts kernels: routing against hand-worked cases and HF's routers and MoE blocks; every
fused_moe backend (torch reference, CPU path, Triton under TRITON_INTERPRET=1 in a child process) against a
float64 implementation written here from the definition."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import pytest
import torch

from kvpilot.kernels import moe, moe_reference
from kvpilot.kernels import ops as K
from support.triton_child import run_triton_tests_in_interpreter

# Triton tests run in a fresh interpreter with TRITON_INTERPRET=1 from the start (triton reads it on import):
# a normal run spawns it and the child runs test_triton_* (tests/test_kernels.py does the same)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

H, INTER = 64, 96  # INTER not a power of two: every tile has a ragged edge


@pytest.fixture
def kernel_settings() -> Iterator[Callable[..., None]]:
    before = K.current()
    yield lambda **changes: K.configure(replace(before, **changes))
    K.configure(before)


# ------------------------------------------------------------------------- the float64 definition


def moe_f64(hidden, w13, w2, weights, ids, act="silu", b13=None, b2=None, alpha=1.702, limit=7.0):
    """out[t] = sum_j w[t,j] * (act(x[t] @ w13[e].T + b13[e]) @ w2[e].T + b2[e]), e = ids[t,j], in float64
    over every (token, slot) pair at once: no sorting, no gathering by expert."""
    t, k = ids.shape
    e = ids.reshape(-1).long()
    x = hidden.double().repeat_interleave(k, dim=0)  # pair p = t * k + j
    gu = torch.einsum("ph,pnh->pn", x, w13.double()[e])
    if b13 is not None:
        gu = gu + b13.double()[e]
    inter = w2.shape[2]
    if act == "silu":
        gate, up = gu[:, :inter], gu[:, inter:]
        a = gate / (1 + torch.exp(-gate)) * up
    else:
        gate, up = gu[:, 0::2], gu[:, 1::2]
        gate = torch.minimum(gate, torch.tensor(limit, dtype=torch.float64))
        up = up.clamp(-limit, limit)
        a = (up + 1) * gate / (1 + torch.exp(-alpha * gate))
    y = torch.einsum("pi,phi->ph", a, w2.double()[e])
    if b2 is not None:
        y = y + b2.double()[e]
    return (y * weights.double().reshape(-1, 1)).view(t, k, -1).sum(dim=1)


@dataclass
class Case:
    hidden: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    act: str
    b13: torch.Tensor | None
    b2: torch.Tensor | None

    def run(self, fn):
        return fn(self.hidden, self.w13, self.w2, self.weights, self.ids, activation=self.act, w13_bias=self.b13,
                  w2_bias=self.b2)

    def expected(self):
        return moe_f64(self.hidden, self.w13, self.w2, self.weights, self.ids, self.act, self.b13, self.b2)


def make_case(tokens: int, experts: int, k: int, dtype: torch.dtype, act: str, bias: bool, seed: int = 0) -> Case:
    """Random layer and skewed routing: a few experts draw most tokens and (where k leaves room) two never
    get any. Weights scaled so gate|up values reach past gpt-oss's clamp at +-7."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, H, generator=g)
    w13 = torch.randn(experts, 2 * INTER, H, generator=g) * 0.5
    w2 = torch.randn(experts, H, INTER, generator=g) / INTER**0.5
    logits = torch.randn(tokens, experts, generator=g) + torch.linspace(3, 0, experts)
    if experts - k >= 2:
        logits[:, [1, experts - 1]] = float("-inf")  # experts with no tokens
    weights, ids = moe.moe_route(logits, k, renormalize=True)
    b13 = torch.randn(experts, 2 * INTER, generator=g) * 2 if bias else None
    b2 = torch.randn(experts, H, generator=g) if bias else None

    def cast(t):
        return None if t is None else t.to(dtype)

    return Case(cast(hidden), cast(w13), cast(w2), weights, ids, act, cast(b13), cast(b2))


# (tokens, experts, k): decode and ragged prefill, top-1/2/8, E=8 and 16
SHAPES = [(1, 8, 1), (1, 16, 8), (37, 8, 2), (37, 16, 8), (37, 16, 1)]
VARIANTS = [("silu", False), ("silu", True), ("gpt_oss", True), ("gpt_oss", False)]


def assert_moe_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """float32: products and sums in another order than float64 (1e-5 of the output's scale). bfloat16: the
    inputs are rounded before the float64 definition sees them, so what is left is the kernels' own rounding of
    gate|up or the activation (8-bit mantissa: 2^-9 relative) feeding a 96-term dot product, and the output's
    final rounding (2^-9): measured up to ~6e-3 of the scale, held to 1.5e-2."""
    assert got.dtype == dtype and got.shape == want.shape
    scale = float(want.abs().max())
    tol = (1e-5 if dtype == torch.float32 else 1.5e-2) * max(scale, 1.0)
    err = float((got.double() - want).abs().max())
    assert err <= tol, f"max |diff| {err:.3g} > {tol:.3g} (scale {scale:.3g})"


def test_cases_are_what_they_claim():
    # the skew and the clamp actually happen, so the backends' tests cover them
    case = make_case(37, 16, 2, torch.float32, "gpt_oss", True)
    loads = torch.bincount(case.ids.reshape(-1), minlength=16)
    assert (loads == 0).sum() >= 2 and loads.max() >= 3 * max(int(loads[loads > 0].min()), 1)
    gu = case.hidden @ case.w13[0].T + case.b13[0]
    assert (gu[:, 0::2] > 7).any() and (gu[:, 1::2].abs() > 7).any()


# ------------------------------------------------------------------------------- torch and CPU paths

BACKENDS = {"reference": moe_reference.fused_moe, "cpu": moe.fused_moe_cpu}


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(("act", "bias"), VARIANTS, ids=[f"{a}{'-bias' if b else ''}" for a, b in VARIANTS])
@pytest.mark.parametrize(("tokens", "experts", "k"), SHAPES, ids=[f"T{t}-E{e}-k{k}" for t, e, k in SHAPES])
def test_fused_moe_matches_the_definition(backend, dtype, act, bias, tokens, experts, k):
    case = make_case(tokens, experts, k, dtype, act, bias)
    assert_moe_close(case.run(BACKENDS[backend]), case.expected(), dtype)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_fused_moe_takes_int32_ids_strided_hidden_and_other_swiglu_constants(backend):
    case = make_case(37, 8, 2, torch.float32, "gpt_oss", True, seed=5)
    wide = torch.randn(37, 2 * H)
    wide[:, :H] = case.hidden  # hidden as a strided view of a wider tensor
    got = BACKENDS[backend](wide[:, :H], case.w13, case.w2, case.weights, case.ids.int(), activation="gpt_oss",
                            w13_bias=case.b13, w2_bias=case.b2, swiglu_alpha=1.0, swiglu_limit=3.0)
    want = moe_f64(case.hidden, case.w13, case.w2, case.weights, case.ids, "gpt_oss", case.b13, case.b2, 1.0, 3.0)
    assert_moe_close(got, want, torch.float32)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_fused_moe_of_no_tokens_is_empty(backend):
    case = make_case(1, 8, 2, torch.bfloat16, "silu", False)
    got = BACKENDS[backend](case.hidden[:0], case.w13, case.w2, case.weights[:0], case.ids[:0])
    assert got.shape == (0, H) and got.dtype == torch.bfloat16


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_fused_moe_rejects_bad_input(backend):
    case = make_case(4, 8, 2, torch.float32, "silu", False)
    fn = BACKENDS[backend]
    with pytest.raises(ValueError, match="lie in"):
        fn(case.hidden, case.w13, case.w2, case.weights, torch.full_like(case.ids, 8))
    with pytest.raises(ValueError, match="activation"):
        fn(case.hidden, case.w13, case.w2, case.weights, case.ids, activation="gelu")
    with pytest.raises(ValueError, match="do not fit"):
        fn(case.hidden, case.w13[:, :, :32], case.w2, case.weights, case.ids)
    with pytest.raises(ValueError, match="w2_bias"):
        fn(case.hidden, case.w13, case.w2, case.weights, case.ids, w2_bias=torch.zeros(8, INTER))


def test_ops_dispatch_follows_the_backend_setting(kernel_settings):
    case = make_case(37, 16, 8, torch.float32, "gpt_oss", True)
    assert K.moe_backend_for(case.hidden) == "cpu"
    got_cpu = case.run(K.fused_moe)
    kernel_settings(attention_backend="torch")
    assert K.moe_backend_for(case.hidden) == "torch"
    assert_moe_close(case.run(K.fused_moe), case.expected(), torch.float32)
    assert_moe_close(got_cpu, case.expected(), torch.float32)


# ----------------------------------------------------------------------------------------- moe_align


@pytest.mark.parametrize(("tokens", "experts", "k", "block"), [(1, 8, 2, 16), (37, 16, 8, 16), (37, 8, 2, 64),
                                                               (5, 16, 1, 4)])
def test_moe_align_groups_pairs_into_single_expert_blocks(tokens, experts, k, block):
    ids = make_case(tokens, experts, k, torch.float32, "silu", False).ids
    sorted_ids, expert_ids, total = moe.moe_align(ids, experts, block)
    pairs, total = tokens * k, int(total)
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=experts)
    assert total == int(((counts + block - 1) // block * block).sum()) and total % block == 0
    assert sorted_ids.numel() == expert_ids.numel() * block >= total
    used = sorted_ids[:total]
    real = used[used < pairs]
    assert sorted(real.tolist()) == list(range(pairs))  # every pair exactly once
    assert bool((sorted_ids[total:] == pairs).all()) and bool((expert_ids[total // block:] == -1).all())
    blocks = used.view(-1, block)
    for b, e in enumerate(expert_ids[: total // block].tolist()):
        members = blocks[b][blocks[b] < pairs]
        assert members.numel() > 0 and bool((flat[members.long()] == e).all())
        assert members.tolist() == sorted(members.tolist())  # token order within an expert
    assert set(expert_ids[: total // block].tolist()) == set(flat.tolist())  # experts without tokens: no block


# ---------------------------------------------------------------------------------------------- routing


def test_route_hand_worked():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]]).log()  # softmax: 0.1, 0.2, 0.3, 0.4
    w, ids = moe.moe_route(logits, 2)
    assert ids.tolist() == [[3, 2]] and torch.allclose(w, torch.tensor([[0.4, 0.3]]))
    w, ids = moe.moe_route(logits, 2, renormalize=True)
    assert ids.tolist() == [[3, 2]] and torch.allclose(w, torch.tensor([[4 / 7, 3 / 7]]))
    w, ids = moe.moe_route(logits, 2, topk_before_softmax=True)  # softmax over log 4, log 3
    assert ids.tolist() == [[3, 2]] and torch.allclose(w, torch.tensor([[4 / 7, 3 / 7]]))
    w, ids = moe.moe_route(logits, 1, renormalize=True)
    assert ids.tolist() == [[3]] and w.tolist() == [[1.0]]
    # sigmoid scores; the correction bias picks expert 2 but its weight stays sigmoid(-1)
    sig = torch.sigmoid(torch.tensor([-1.0, 2.0]))
    w, ids = moe.moe_route(torch.tensor([[0.0, 1.0, -1.0, 2.0]]), 2, scoring="sigmoid",
                           correction_bias=torch.tensor([0.0, 0.0, 5.0, 0.0]))
    assert ids.tolist() == [[2, 3]] and torch.allclose(w, sig[None])
    w, _ = moe.moe_route(torch.tensor([[0.0, 1.0, -1.0, 2.0]]), 2, scoring="sigmoid", renormalize=True,
                         correction_bias=torch.tensor([0.0, 0.0, 5.0, 0.0]))
    assert torch.allclose(w, (sig / sig.sum())[None])
    w, ids = moe.moe_route(torch.tensor([[0.0, 1.0, -1.0, 2.0]], dtype=torch.bfloat16), 2)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64
    with pytest.raises(ValueError, match="top_k"):
        moe.moe_route(logits, 5)
    with pytest.raises(ValueError, match="softmax"):
        moe.moe_route(logits, 2, scoring="sigmoid", topk_before_softmax=True)


def _init(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return module.eval()


def _hf(name: str):
    return pytest.importorskip(f"transformers.models.{name}.modeling_{name}")


ROUTERS = [("mixtral", {}), ("qwen2_moe", {"norm_topk_prob": False}), ("qwen3_moe", {"norm_topk_prob": True}),
           ("qwen3_moe", {"norm_topk_prob": False}), ("gpt_oss", {})]


def _config(name: str, **extra):
    tf = pytest.importorskip("transformers")
    cls = {"mixtral": tf.MixtralConfig, "qwen2_moe": tf.Qwen2MoeConfig, "qwen3_moe": tf.Qwen3MoeConfig,
           "gpt_oss": tf.GptOssConfig}[name]
    common = {"hidden_size": H, "num_experts_per_tok": 4 if name == "gpt_oss" else 2}
    if name in ("mixtral", "gpt_oss"):
        return cls(intermediate_size=INTER, num_local_experts=8, **common, **extra)
    return cls(moe_intermediate_size=INTER, num_experts=8, shared_expert_intermediate_size=INTER, **common, **extra)


def _our_route(name: str, config, logits: torch.Tensor):
    if name == "gpt_oss":
        return moe.moe_route(logits, config.num_experts_per_tok, topk_before_softmax=True)
    return moe.moe_route(logits, config.num_experts_per_tok,
                         renormalize=name == "mixtral" or config.norm_topk_prob)


@pytest.mark.parametrize(("name", "extra"), ROUTERS, ids=[f"{n}{''.join(f'-{k}={v}' for k, v in e.items())}"
                                                          for n, e in ROUTERS])
def test_route_matches_hf_routers(name, extra):
    mod = _hf(name)
    config = _config(name, **extra)
    prefix = {"mixtral": "Mixtral", "qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe", "gpt_oss": "GptOss"}[name]
    router = _init(getattr(mod, f"{prefix}TopKRouter")(config), seed=1)
    x = torch.randn(37, H, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, hf_w, hf_ids = router(x)
    w, ids = _our_route(name, config, logits)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(w, hf_w.float(), rtol=1e-6, atol=1e-7)
    if name != "gpt_oss":
        # bfloat16 logits: the same experts; HF rounds the weights to bfloat16, we keep them float32
        with torch.no_grad():
            logits16, hf_w16, hf_ids16 = router.to(torch.bfloat16)(x.to(torch.bfloat16))
        w16, ids16 = _our_route(name, config, logits16)
        assert torch.equal(ids16, hf_ids16)
        torch.testing.assert_close(w16, hf_w16.float(), rtol=2**-8, atol=0)


BLOCKS = [("mixtral", "MixtralSparseMoeBlock"), ("qwen3_moe", "Qwen3MoeSparseMoeBlock"),
          ("qwen2_moe", "Qwen2MoeSparseMoeBlock"), ("gpt_oss", "GptOssMLP")]


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize(("name", "block"), BLOCKS, ids=[n for n, _ in BLOCKS])
def test_route_and_fused_moe_reproduce_hf_moe_blocks(name, block, backend):
    # the weight layouts as the models' loaders will map them: Mixtral/Qwen take gate_up_proj as is, gpt-oss's
    # [E, H, 2I] (interleaved) and [E, I, H] are transposed; Qwen2-MoE adds its gated shared expert outside
    mod = _hf(name)
    config = _config(name, norm_topk_prob=True) if name.startswith("qwen") else _config(name)
    if name == "mixtral":
        config.router_jitter_noise = 0.0
    moe_block = _init(getattr(mod, block)(config), seed=3)
    x = torch.randn(1, 37, H, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = moe_block(x)
        want = want[0] if isinstance(want, tuple) else want
        flat = x[0]
        router = moe_block.router if name == "gpt_oss" else moe_block.gate
        logits = router(flat)[0]
        w, ids = _our_route(name, config, logits)
        experts = moe_block.experts
        if name == "gpt_oss":
            got = BACKENDS[backend](flat, experts.gate_up_proj.transpose(1, 2), experts.down_proj.transpose(1, 2),
                                    w, ids, activation="gpt_oss", w13_bias=experts.gate_up_proj_bias,
                                    w2_bias=experts.down_proj_bias, swiglu_alpha=config.swiglu_alpha,
                                    swiglu_limit=config.swiglu_limit)
        else:
            got = BACKENDS[backend](flat, experts.gate_up_proj, experts.down_proj, w, ids)
        if name == "qwen2_moe":
            got = got + torch.sigmoid(moe_block.shared_expert_gate(flat)) * moe_block.shared_expert(flat)
    torch.testing.assert_close(got, want[0], rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------------ Triton

if not INTERPRETED:

    @pytest.mark.slow
    def test_fused_moe_under_triton_interpreter():
        run_triton_tests_in_interpreter(__file__)

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled Triton kernels need a CUDA GPU")
    def test_fused_moe_compiled_on_cuda():
        case = make_case(37, 16, 8, torch.bfloat16, "gpt_oss", True)
        dev = Case(*(t.cuda() if isinstance(t, torch.Tensor) else t for t in vars(case).values()))
        assert K.moe_backend_for(dev.hidden) == "triton"
        assert_moe_close(dev.run(K.fused_moe).cpu(), case.expected(), torch.bfloat16)


@pytest.fixture(scope="module")
def mt():
    import triton.language as tl

    import kvpilot.kernels.moe_triton as mod

    # fail loudly rather than run compiled kernels on CPU tensors
    assert mod.INTERPRET and type(tl.standard.cdiv).__name__ == "InterpretedFunction"
    return mod


# the interpreter runs every program in numpy: a subset of the in-process grid, every shape and variant once
TRITON_CASES = [(*shape, torch.float32, *variant) for shape, variant in zip(SHAPES, VARIANTS + VARIANTS[:1],
                                                                           strict=True)]
TRITON_CASES += [(37, 16, 8, torch.bfloat16, "silu", False), (37, 8, 2, torch.bfloat16, "gpt_oss", True),
                 (1, 16, 8, torch.bfloat16, "gpt_oss", True), (37, 8, 2, torch.float32, "gpt_oss", True)]


@pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child")
@pytest.mark.parametrize(("tokens", "experts", "k", "dtype", "act", "bias"), TRITON_CASES)
def test_triton_fused_moe_matches_the_definition(mt, tokens, experts, k, dtype, act, bias):
    case = make_case(tokens, experts, k, dtype, act, bias)
    assert_moe_close(case.run(mt.fused_moe), case.expected(), dtype)


@pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child")
def test_triton_dispatch_and_int32_ids(mt, kernel_settings):
    kernel_settings(attention_backend="triton")
    case = make_case(37, 16, 2, torch.float32, "silu", True, seed=7)
    assert K.moe_backend_for(case.hidden) == "triton"
    case = replace(case, ids=case.ids.int())
    assert_moe_close(case.run(K.fused_moe), case.expected(), torch.float32)
