"""A decode step's layers in one native call (``models/native_decode.py``) against the same engine running the
layers through Python: the same kernels in the same order, so tokens and logprobs are bit-identical, through
batching, chunked prefill, prefix-cache hits, preemption and seeded sampling; and the models it leaves to
Python say why."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvpilot.daemon.engine import LLM, SamplingParams
from kvpilot.daemon.engine.models import native_decode
from kvpilot.daemon.engine.models.native_decode import NativeDecodeLayers
from support.gguf_blocks import quantize
from support.gguf_files import BPE_TOKENS, spm_tokens, write_gguf

pytestmark = pytest.mark.skipif(native_decode._entry() is None, reason="native CPU kernels not built")  # noqa: SLF001

# K-quants need rows in multiples of 256 weights
COMMON = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
          "intermediate_size": 512, "num_hidden_layers": 3, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
          "tie_word_embeddings": False}
GEMMA = {**COMMON, "tie_word_embeddings": True, "sliding_window": 16, "vocab_size": len(spm_tokens("gemma")),
         "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
# a Q4_K_M-like mix: q|k|v and gate|up each hold runs of two block types
MIXED = {"q_proj": 12, "k_proj": 12, "v_proj": 14, "o_proj": 6, "gate_proj": 3, "up_proj": 8, "down_proj": 2,
         "embed_tokens": 8, "lm_head": 8}


def _mixed(name: str, data: np.ndarray) -> tuple[np.ndarray, int] | None:
    if data.ndim != 2:
        return None
    qtype = next(t for key, t in MIXED.items() if key in name)
    return quantize(data, qtype, np.random.default_rng(qtype)), qtype


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """arch -> a tiny random model of it written as a GGUF file with mixed block types."""
    import transformers as tf

    root = tmp_path_factory.mktemp("native_decode")
    mp = pytest.MonkeyPatch()
    mp.setenv("KVPILOT_CACHE_DIR", str(root / "cache"))
    configs = {
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON, vocab_size=len(spm_tokens("phi3")),
                                                            bos_token_id=1, eos_token_id=3)),
        "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**COMMON, vocab_size=len(BPE_TOKENS), bos_token_id=257,
                                                            eos_token_id=259)),  # q/k/v biases
        "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**COMMON, vocab_size=len(BPE_TOKENS), bos_token_id=257,
                                                            eos_token_id=259)),  # q/k norms
        # sandwich norms (1 + w, float32 under bfloat16), GeGLU, q/k norms, sliding windows and two RoPE tables
        "gemma3": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**GEMMA, query_pre_attn_scalar=64, layer_types=[
            "sliding_attention", "sliding_attention", "full_attention"])),
        # attention soft-capping
        "gemma2": lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(**GEMMA, query_pre_attn_scalar=64,
                                                               attn_logit_softcapping=20.0,
                                                               final_logit_softcapping=3.0)),
    }
    made: dict[str, Path] = {}

    def build(arch: str) -> Path:
        if arch not in made:
            torch.manual_seed(0)
            hf = configs[arch]().float().eval()
            with torch.no_grad():
                for n, p in hf.named_parameters():
                    if "norm" in n or n.endswith("bias"):
                        p.add_(torch.randn_like(p) * 0.2)
            made[arch] = root / f"tiny-{arch}.gguf"
            write_gguf(made[arch], arch, hf, _mixed)
        return made[arch]

    yield build
    mp.undo()


def _prompts(n: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(8, vocab, (int(k),), generator=gen).tolist()
            for k in torch.randint(3, 70, (n,), generator=gen)]


def _run(llm: LLM, prompts: list[list[int]]) -> list[Any]:
    """Greedy with logprobs for most prompts, seeded sampling for two: (token ids, logprobs) per output."""
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
    sampled = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=24, ignore_eos=True, seed=7, n=2)
    params = [sampled if i in (1, 4) else greedy for i in range(len(prompts))]
    llm.engine.reset_prefix_cache()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(list(c.token_ids), None if c.logprobs is None else
              [[(k, v.logprob) for k, v in sorted(d.items())] for d in c.logprobs]) for c in o.outputs]
            for o in outs]


def _both_ways(llm: LLM, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> tuple[list, list, int]:
    """The outputs with the native layers, the native steps they took, and the outputs through Python."""
    model = llm.engine.runner.model
    native_steps = 0
    run = NativeDecodeLayers.run

    def counted(self: NativeDecodeLayers, *a: Any) -> torch.Tensor | None:
        nonlocal native_steps
        y = run(self, *a)
        native_steps += y is not None
        return y

    monkeypatch.setattr(NativeDecodeLayers, "run", counted)
    native = _run(llm, prompts)
    model.use_native_decode = False
    python = _run(llm, prompts)
    model.use_native_decode = True
    return native, python, native_steps


def _assert_native_matches_python(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seven prompts and a repeated one (a prefix-cache hit) through ``llm`` (built with a 48-token budget and a
    cache too small for all at once): the native layers took most decode steps, their outputs equal the Python
    layers' bit for bit, and some sequence was preempted."""
    prompts = _prompts(7, llm.engine.runner.model.vocab_size)
    prompts.append(list(prompts[0]))
    native, python, steps = _both_ways(llm, prompts, monkeypatch)
    assert steps > 10
    assert native == python
    assert llm.engine.get_stats().num_preempted_total > 0


@pytest.mark.parametrize(("dtype", "quantization"), [("float32", None), ("bfloat16", None), ("float32", "none")],
                         ids=["gguf-float32", "gguf-bfloat16", "panels-float32"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3", "gemma2"])
def test_native_layers_match_python_bit_for_bit(arch: str, dtype: str, quantization: str | None,
                                               gguf_model: Callable[[str], Path],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """On the GGUF blocks, and on float32 weights dequantized at load (their panel copies). Chunked prefill
    (48-token budget), prefix-cache hits (a repeated prompt) and recompute preemption (a cache too small for
    every sequence at once) beside the batched decode steps."""
    path = gguf_model(arch)
    llm = LLM(model=str(path), dtype=dtype, quantization=quantization, max_model_len=256, num_kv_blocks=40,
              block_size=8, max_num_seqs=8, max_num_batched_tokens=48, enable_prefix_caching=True)
    model = llm.engine.runner.model
    assert NativeDecodeLayers.why_not(model) is None
    _assert_native_matches_python(llm, monkeypatch)


def test_models_the_native_layers_leave_to_python_say_why(gguf_model: Callable[[str], Path], tmp_path: Path) -> None:
    from transformers import Olmo2Config, Olmo2ForCausalLM

    from support.hf_parity import save_tiny

    cfg = Olmo2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                      num_hidden_layers=2, vocab_size=256, max_position_embeddings=128)
    save_tiny(cfg, Olmo2ForCausalLM, tmp_path, lambda n: "norm" in n)
    olmo = LLM(model=str(tmp_path), dtype="float32", max_model_len=128, num_kv_blocks=16)
    assert "q/k norms over the whole projection" in (NativeDecodeLayers.why_not(olmo.engine.runner.model) or "")
    dense = LLM(model=str(gguf_model("llama")), dtype="bfloat16", quantization="none", max_model_len=128,
                num_kv_blocks=16)  # oneDNN's bfloat16 GEMMs
    model = dense.engine.runner.model
    assert "neither as GGUF blocks nor as float32 panels" in (NativeDecodeLayers.why_not(model) or "")
    out = dense.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=3),
                         use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert model._native_decode is False  # noqa: SLF001 - decided once, not per step


MOE_COMMON = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": False}


def _moe_configs() -> dict[str, Callable[[], tuple[Any, type]]]:
    import transformers as tf

    return {
        # renormalized top-2 of 8, and Qwen3-MoE's q/k norms with top-2 of 8 unrenormalized
        "mixtral": lambda: (tf.MixtralConfig(**MOE_COMMON, intermediate_size=32, num_local_experts=8),
                            tf.MixtralForCausalLM),
        "qwen3_moe": lambda: (tf.Qwen3MoeConfig(**MOE_COMMON, intermediate_size=48, moe_intermediate_size=40,
                                                num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
                              tf.Qwen3MoeForCausalLM),
        # a shared expert with its sigmoid gate: left to Python
        "qwen2_moe": lambda: (tf.Qwen2MoeConfig(**MOE_COMMON, intermediate_size=48, moe_intermediate_size=32,
                                                shared_expert_intermediate_size=48, num_experts=8,
                                                num_experts_per_tok=2), tf.Qwen2MoeForCausalLM),
    }


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Any]]:
    from support.hf_parity import tiny_models

    return tiny_models(tmp_path_factory.mktemp, _moe_configs, lambda n: "norm" in n or n.endswith("bias"))


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_native_moe_layers_match_python_bit_for_bit(arch: str, moe_model: Callable[[str], tuple[Path, Any]],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """MoE layers on the native experts kernel (float32 SiLU experts in panels): the router, the routing and
    the experts in the loop, as the Python layer calls them; through chunked prefill, prefix-cache hits and
    preemption, as above."""
    from kvpilot.kernels import cpu_native

    if cpu_native.panel_gemm_max_rows() == 0:
        pytest.skip("native panel kernel not built")
    folder, _ = moe_model(arch)
    llm = LLM(model=str(folder), dtype="float32", max_model_len=256, num_kv_blocks=40, block_size=8, max_num_seqs=8,
              max_num_batched_tokens=48, enable_prefix_caching=True)
    model = llm.engine.runner.model
    assert all(layer.moe is not None and layer.moe.native_experts for layer in model.layers)
    assert NativeDecodeLayers.why_not(model) is None
    _assert_native_matches_python(llm, monkeypatch)


def test_moe_models_the_native_layers_leave_to_python_say_why(moe_model: Callable[[str], tuple[Path, Any]]) -> None:
    folder, _ = moe_model("qwen2_moe")
    llm = LLM(model=str(folder), dtype="float32", max_model_len=128, num_kv_blocks=16)
    assert "a shared expert" in (NativeDecodeLayers.why_not(llm.engine.runner.model) or "")
    folder, _ = moe_model("mixtral")
    llm = LLM(model=str(folder), dtype="float32", max_model_len=128, num_kv_blocks=16, small_batch_gemm=False)
    assert "experts the native kernels do not run" in (NativeDecodeLayers.why_not(llm.engine.runner.model) or "")
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=3),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def _quantized_moe(name: str, data: np.ndarray) -> tuple[np.ndarray, int] | None:
    """Experts in Q4_1 (gate|up) and Q4_0 (down), the other 2-D weights in Q8_0, as llama.cpp's files mix them."""
    qtype = 3 if name.endswith("experts.gate_up_proj") else 2 if name.endswith("experts.down_proj") else None
    if qtype is None and (not name.endswith("_proj.weight") or data.shape[-1] % 32):
        return None
    flat = data.reshape(-1, data.shape[-1])  # each expert's rows in blocks along the input
    blocks = quantize(flat, qtype or 8, np.random.default_rng(0))
    return blocks.reshape(*data.shape[:-1], -1), qtype or 8


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("arch", "gguf_arch"), [("mixtral", "llama"), ("qwen3_moe", "qwen3moe")])
def test_native_gguf_moe_layers_match_python_bit_for_bit(arch: str, gguf_arch: str, dtype: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """MoE layers whose experts stay in their GGUF blocks (the native GGUF MoE kernel), float32 and bfloat16
    activations (the router then in float32, on panels)."""
    cfg, cls = _moe_configs()[arch]()
    if arch == "qwen3_moe":
        cfg.moe_intermediate_size = 64  # whole 32-weight blocks along the down projection's input
    # the vocabulary of the tokenizer the GGUF writer embeds for the arch
    if gguf_arch == "llama":
        cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id = len(spm_tokens("phi3")), 1, 3
    else:
        cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id = len(BPE_TOKENS), 257, 259
    torch.manual_seed(0)
    hf = cls(cfg).float().eval()
    with torch.no_grad():  # random norms and routers (HF initializes some to 0 or 1)
        for n, p in hf.named_parameters():
            if "norm" in n or n.endswith("gate.weight"):
                p.add_(torch.randn_like(p) * 0.2)
    monkeypatch.setenv("KVPILOT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(path, gguf_arch, hf, _quantized_moe)
    llm = LLM(model=str(path), dtype=dtype, max_model_len=256, num_kv_blocks=40, block_size=8, max_num_seqs=8,
              max_num_batched_tokens=48, enable_prefix_caching=True)
    model = llm.engine.runner.model
    assert all(layer.moe is not None and layer.moe.gguf_experts is not None and layer.moe.native_experts
               and (layer.moe.router_panels is not None) == (dtype == "bfloat16") for layer in model.layers)
    assert NativeDecodeLayers.why_not(model) is None
    _assert_native_matches_python(llm, monkeypatch)


def test_native_moe_layers_compose_with_speculation(moe_model: Callable[[str], tuple[Path, Any]]) -> None:
    """ngram speculation on a MoE model whose decode steps run natively: its verification steps (several rows a
    sequence) take the Python layers, the others the native loop; greedy tokens equal the run without drafts,
    through chunked prefill, prefix-cache hits and preemption."""
    from kvpilot.kernels import cpu_native

    if cpu_native.panel_gemm_max_rows() == 0:
        pytest.skip("native panel kernel not built")
    folder, _ = moe_model("mixtral")
    gen = torch.Generator().manual_seed(5)
    prompts = []
    for i in range(6):  # copy-heavy prompts (a passage, then its start again), so that drafts get accepted
        passage = torch.randint(8, 250, (24 + i,), generator=gen).tolist()
        prompts.append({"prompt_token_ids": passage + passage[: 6 + i]})
    prompts.append(dict(prompts[0]))  # a prefix-cache hit
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = {}
    for name, spec in (("plain", None), ("ngram", {"method": "ngram", "num_speculative_tokens": 3,
                                                   "prompt_lookup_min": 1, "prompt_lookup_max": 3})):
        llm = LLM(model=str(folder), dtype="float32", max_model_len=256, num_kv_blocks=24, block_size=8,
                  max_num_seqs=8, max_num_batched_tokens=48, enable_prefix_caching=True, speculative_config=spec)
        assert NativeDecodeLayers.why_not(llm.engine.runner.model) is None
        outs[name] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
        stats = llm.engine.get_stats()
        assert stats.num_preempted_total > 0
        if spec is not None:
            assert llm.engine.speculator.stats.num_accepted_tokens > 0
    assert outs["ngram"] == outs["plain"]
