"""Mixture-of-experts GGUFs (Mixtral as llama.cpp's "llama" with experts, Qwen2-MoE, Qwen3-MoE): a tiny random
HF model written as llama.cpp's converter writes it (stacked ``ffn_*_exps`` experts, router ``ffn_gate_inp``,
Qwen2-MoE's ``*_shexp`` shared expert, the expert metadata), converted by kvpilot.common.model_source and
checked against the HF model: config, every weight, and the engine's prompt logprobs and greedy tokens on the
GGUF's own tensors (the default for a .gguf model); and quantized experts (``kernels.gguf_moe``) against the
same model dequantized at load."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvpilot.common.gguf_weights import gguf_source
from kvpilot.common.model_source import resolve_model_path
from kvpilot.daemon.engine import LLM, SamplingParams
from support.gguf_blocks import quantize
from support.gguf_files import BPE_TOKENS, spm_tokens, write_gguf
from support.hf_parity import ATOL, max_logprob_error

pytest.importorskip("gguf")

COMMON = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
          "rms_norm_eps": 1e-6, "initializer_range": 0.08, "num_experts_per_tok": 2, "tie_word_embeddings": False}
QWEN_TOKENS = {"vocab_size": len(BPE_TOKENS), "bos_token_id": 257, "eos_token_id": 259, "pad_token_id": 257}


def _configs() -> dict[str, Callable[[], tuple[str, Any, type]]]:
    """name -> () -> (GGUF arch, HF config, HF model class)."""
    import transformers as tf

    return {
        # llama.cpp writes Mixtral as "llama" with experts, q/k rows permuted; no sliding window
        "mixtral": lambda: ("llama", tf.MixtralConfig(**COMMON, num_hidden_layers=2, intermediate_size=32, head_dim=16,
                                                      num_local_experts=4, sliding_window=None, rope_theta=1e6,
                                                      vocab_size=len(spm_tokens("phi3")), bos_token_id=1,
                                                      eos_token_id=3, pad_token_id=3), tf.MixtralForCausalLM),
        # a shared expert; routing weights not renormalized
        "qwen2_moe": lambda: ("qwen2moe", tf.Qwen2MoeConfig(**COMMON, **QWEN_TOKENS, num_hidden_layers=2,
                                                            intermediate_size=48, moe_intermediate_size=32,
                                                            num_experts=4, shared_expert_intermediate_size=40,
                                                            norm_topk_prob=False),
                              tf.Qwen2MoeForCausalLM),
        # head_dim 32 (not hidden/heads); norm_topk_prob True, as llama.cpp routes (a GGUF has no key for it)
        "qwen3_moe": lambda: ("qwen3moe", tf.Qwen3MoeConfig(**COMMON, **QWEN_TOKENS, head_dim=32, num_hidden_layers=2,
                                                            intermediate_size=48, moe_intermediate_size=32,
                                                            num_experts=4, norm_topk_prob=True),
                              tf.Qwen3MoeForCausalLM),
    }


NAMES = list(_configs())


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Any]]:
    """name -> (the .gguf, HF model), each built once; conversions go to a module-private cache."""
    root = tmp_path_factory.mktemp("gguf_moe")
    mp = pytest.MonkeyPatch()
    mp.setenv("KVPILOT_CACHE_DIR", str(root / "cache"))
    cache: dict[str, tuple[Path, Any]] = {}

    def build(name: str) -> tuple[Path, Any]:
        if name not in cache:
            arch, cfg, cls = _configs()[name]()
            torch.manual_seed(0)
            hf = cls(cfg).to(torch.float32).eval()
            with torch.no_grad():  # random norms, and routers (HF initializes some to 0)
                for n, p in hf.named_parameters():
                    if "norm" in n or n.endswith("gate.weight"):
                        p.add_(torch.randn_like(p) * 0.2)
            path = root / f"tiny-{name}.gguf"
            write_gguf(path, arch, hf)
            cache[name] = (path, hf)
        return cache[name]

    yield build
    mp.undo()


@pytest.mark.parametrize("name", NAMES)
def test_conversion_matches_hf(name: str, built: Callable[[str], tuple[Path, Any]]) -> None:
    from safetensors.torch import load_file
    from transformers import AutoConfig

    path, hf = built(name)
    folder = resolve_model_path(str(path))
    cfg, ref = AutoConfig.from_pretrained(folder), hf.config
    assert cfg.model_type == ref.model_type
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "vocab_size", "tie_word_embeddings", "num_experts", "num_local_experts",
                "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob",
                "decoder_sparse_step", "mlp_only_layers", "sliding_window", "rope_parameters"):
        if hasattr(ref, key):
            assert getattr(cfg, key) == getattr(ref, key), (key, getattr(cfg, key), getattr(ref, key))
    got = load_file(str(folder / "model.safetensors"))
    want = hf.state_dict()
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)
    assert gguf_source(folder) == path  # served on the GGUF's own tensors


@pytest.mark.parametrize("name", NAMES)
def test_engine_on_the_gguf_matches_hf(name: str, built: Callable[[str], tuple[Path, Any]]) -> None:
    path, hf = built(name)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(6, int(hf.config.vocab_size), (n,), generator=gen).tolist() for n in (21, 13)]
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=16, max_model_len=64)  # no quantization given
    assert llm.engine.loaded.quantization == "gguf"
    worst = max_logprob_error(llm, hf, prompts)
    print(f"{name}: max |logprob - HF| = {worst:.2e}")
    assert worst < ATOL


# experts in Q4_1 (gate and up) and Q4_0 (down), the other linear layers in Q8_0 where their widths are whole
# 32-weight blocks (llama.cpp keeps the others in float too)
_EXPERT_TYPES = {"experts.gate_up_proj": 3, "experts.down_proj": 2}


def _quantized_experts(name: str, data: Any) -> tuple[Any, int] | None:
    import numpy as np

    qtype = next((t for key, t in _EXPERT_TYPES.items() if name.endswith(key)), None)
    if qtype is None and (not name.endswith("_proj.weight") or data.shape[-1] % 32):
        return None
    flat = data.reshape(-1, data.shape[-1])  # each expert's rows, in blocks along the input as llama.cpp's
    blocks = quantize(flat, qtype or 8, np.random.default_rng(0))
    return blocks.reshape(*data.shape[:-1], -1), qtype or 8


@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe"])
def test_quantized_experts_match_the_dequantized_model(name: str, built: Callable[[str], tuple[Path, Any]],
                                                       tmp_path: Path) -> None:
    """Experts on their Q4_1/Q8_0/Q4_0 blocks against the same file dequantized at load (``quantization
    none``): the same float32 weights, summed in another order."""
    _, hf = built(name)
    arch = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}[name]
    path = tmp_path / f"{name}-q.gguf"
    write_gguf(path, arch, hf, _quantized_experts)
    kw = {"dtype": "float32", "num_kv_blocks": 16, "max_model_len": 64}
    blocks, dense = LLM(model=str(path), **kw), LLM(model=str(path), quantization="none", **kw)
    assert blocks.engine.loaded.weight_bytes < 0.5 * dense.engine.loaded.weight_bytes
    assert all(layer.moe.gguf_experts is not None for layer in blocks.engine.runner.model.layers)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(6, int(hf.config.vocab_size), (n,), generator=gen).tolist() for n in (21, 13, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=1, logprobs=1, ignore_eos=True)
    got, want = (llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                 for llm in (blocks, dense))
    for a, b in zip(got, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        pa = [lp for d in a.prompt_logprobs[1:] for lp in d.values()]
        pb = [lp for d in b.prompt_logprobs[1:] for lp in d.values()]
        assert max(abs(x.logprob - y.logprob) for x, y in zip(pa, pb, strict=True)) < ATOL
