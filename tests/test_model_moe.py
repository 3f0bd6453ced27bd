"""The mixture-of-experts architectures against HF transformers, in float32: tiny random-weight Mixtral,
Qwen2-MoE, Qwen3-MoE and gpt-oss models built from transformers' config classes, saved with save_pretrained
and loaded through kvpilot's loader (tests/test_model_archs.py's pattern and checks: prompt logprobs within
1e-3 of HF's log-softmax, greedy tokens equal but for near-ties, also under chunked prefill and with
prefix-cache hits). Also: checkpoints holding the experts fused, steps where some experts get no tokens,
gpt-oss's YaRN numbers, and the refusals (MXFP4, a missing expert weight)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvpilot.daemon.engine import LLM
from kvpilot.kernels import ops
from support.hf_parity import ATOL, WINDOW, max_logprob_error, tiny_models, token_prompts

TINY = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "initializer_range": 0.08, "pad_token_id": 0,
        "bos_token_id": 1, "eos_token_id": 2, "num_experts_per_tok": 2}
EXPERTS, EXPERT_INTER = 8, 32
# gpt-oss's YaRN settings (beta_fast/slow, no truncation), with the factor and original window of a 256-position model
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 64, "truncate": False}


def _configs() -> dict[str, Callable[[], tuple[Any, type]]]:
    """name -> () -> (HF config, HF model class)."""
    import transformers as tf

    return {
        "mixtral": lambda: (tf.MixtralConfig(**TINY, num_hidden_layers=2, intermediate_size=EXPERT_INTER,
                                             num_local_experts=EXPERTS, sliding_window=WINDOW),
                            tf.MixtralForCausalLM),
        # layers 0 and 2 MoE, layer 1 dense (mlp_only_layers); routing weights not renormalized
        "qwen2_moe": lambda: (tf.Qwen2MoeConfig(**TINY, num_hidden_layers=3, intermediate_size=48,
                                                moe_intermediate_size=EXPERT_INTER, num_experts=EXPERTS,
                                                shared_expert_intermediate_size=40, mlp_only_layers=[1],
                                                norm_topk_prob=False), tf.Qwen2MoeForCausalLM),
        # layers 1 and 3 MoE (decoder_sparse_step=2), 0 and 2 dense
        "qwen3_moe": lambda: (tf.Qwen3MoeConfig(**TINY, num_hidden_layers=4, intermediate_size=48,
                                                moe_intermediate_size=EXPERT_INTER, num_experts=EXPERTS,
                                                decoder_sparse_step=2, norm_topk_prob=True, attention_bias=True),
                              tf.Qwen3MoeForCausalLM),
        # the SwiGLU limit low enough that the tiny model's activations are clamped
        "gpt_oss": lambda: (tf.GptOssConfig(**TINY, num_hidden_layers=2, intermediate_size=EXPERT_INTER,
                                            num_local_experts=EXPERTS, sliding_window=WINDOW,
                                            layer_types=["sliding_attention", "full_attention"], swiglu_limit=0.3,
                                            rope_parameters=YARN),
                            tf.GptOssForCausalLM),
    }


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Any]]:
    """name -> (saved folder, HF model), each built once per module."""
    # routers and sinks too: HF initializes some routers to 0
    return tiny_models(tmp_path_factory.mktemp, _configs, lambda n: n.endswith("bias") or "norm" in n
                       or n.endswith(("sinks", "gate.weight", "router.weight")))


def _llm(folder: Path, **kw: Any) -> LLM:
    return LLM(model=str(folder), dtype="float32", num_kv_blocks=64, max_model_len=256, **kw)


def _parity(folder: Path, hf: Any) -> float:
    prompts = token_prompts()
    llm = _llm(folder)
    worst = max_logprob_error(llm, hf, prompts)
    worst = max(worst, max_logprob_error(llm, hf, prompts))  # again: the prompts' blocks are now in the prefix cache
    chunked = _llm(folder, max_num_batched_tokens=16, enable_prefix_caching=False)
    return max(worst, max_logprob_error(chunked, hf, prompts))


@pytest.mark.parametrize("name", list(_configs()))
def test_matches_hf(name: str, tiny: Callable[[str], tuple[Path, Any]]) -> None:
    worst = _parity(*tiny(name))
    print(f"{name}: max |logprob - HF| = {worst:.2e}")
    assert worst < ATOL, f"{name}: max |logprob - HF| = {worst:.2e}"


def _fuse(folder: Path, block: str, per_expert: tuple[str, str, str], new_block: str) -> None:
    """Rewrite the checkpoint with each layer's experts as transformers 5's modules hold them: gate|up
    stacked ``[E, 2I, H]`` and down ``[E, H, I]``, under ``new_block``."""
    from safetensors.torch import load_file, save_file

    (st,) = folder.glob("*.safetensors")
    tensors = load_file(str(st))
    out: dict[str, torch.Tensor] = {}
    stacks: dict[tuple[str, str], list[torch.Tensor | None]] = {}
    for name, w in tensors.items():
        parts = name.split(".")
        if f".{block}.experts." in name:
            layer, e, proj = parts[2], int(parts[5]), parts[6]
            stacks.setdefault((layer, proj), [None] * EXPERTS)[e] = w
        else:
            out[name.replace(f".{block}.", f".{new_block}.")] = w
    for layer in {key[0] for key in stacks}:
        gate, up, down = (torch.stack(stacks[(layer, p)]) for p in per_expert)  # type: ignore[arg-type]
        out[f"model.layers.{layer}.{new_block}.experts.gate_up_proj"] = torch.cat((gate, up), dim=1).contiguous()
        out[f"model.layers.{layer}.{new_block}.experts.down_proj"] = down.contiguous()
    st.unlink()
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_fused_expert_checkpoints(name: str, tiny: Callable[[str], tuple[Path, Any]], tmp_path: Path) -> None:
    """Experts stored fused (transformers 5's modules; Mixtral's block named "mlp" there) load alike."""
    folder, hf = tiny(name)
    fused = tmp_path / "fused"
    shutil.copytree(folder, fused)
    if name == "mixtral":
        _fuse(fused, "block_sparse_moe", ("w1", "w3", "w2"), "mlp")
    else:
        _fuse(fused, "mlp", ("gate_proj", "up_proj", "down_proj"), "mlp")
    assert max_logprob_error(_llm(fused), hf, token_prompts()) < ATOL


def test_steps_with_idle_experts(tiny: Callable[[str], tuple[Path, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps whose routing leaves experts without tokens (decode steps, short and skewed prefills) match HF."""
    counts: list[torch.Tensor] = []
    real = ops.fused_moe

    def spy(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
            **kw: Any) -> torch.Tensor:
        counts.append(torch.bincount(ids.reshape(-1), minlength=w13.shape[0]))
        return real(hidden, w13, w2, weights, ids, **kw)

    monkeypatch.setattr(ops, "fused_moe", spy)
    folder, hf = tiny("qwen3_moe")
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (2, 3, 60)]
    worst = max_logprob_error(_llm(folder), hf, prompts, steps=6)
    assert worst < ATOL
    # batched prefills where some experts take many tokens and others none (the skewed random router)
    assert any((c == 0).any() and c.max() > 8 for c in counts), [c.tolist() for c in counts]
    assert any((c == 0).any() and c.sum() == 2 for c in counts), "no one-token step"


def test_gpt_oss_yarn_matches_hf(tiny: Callable[[str], tuple[Path, Any]]) -> None:
    """rope.py's YaRN (through transformers' own function) gives HF's frequencies and attention scaling."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    from kvpilot.daemon.engine.models.rope import rope_inv_freq

    cfg = tiny("gpt_oss")[1].config
    ours, scale = rope_inv_freq(cfg, cfg.head_dim, 256)
    theirs = GptOssRotaryEmbedding(cfg)
    assert cfg.rope_parameters["rope_type"] == "yarn" and theirs.attention_scaling > 1.0
    torch.testing.assert_close(ours, theirs.inv_freq, rtol=0, atol=0)
    assert scale == pytest.approx(theirs.attention_scaling, rel=1e-12)


# ------------------------------------------------------------------ refusals


def _edit_config(folder: Path, **changes: Any) -> None:
    path = folder / "config.json"
    d = json.loads(path.read_text())
    d.update(changes)
    path.write_text(json.dumps(d))


def test_mxfp4_checkpoint_is_refused(tiny: Callable[[str], tuple[Path, Any]], tmp_path: Path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(tiny("gpt_oss")[0], folder)
    _edit_config(folder, quantization_config={"quant_method": "mxfp4",
                                              "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]})
    with pytest.raises(ValueError, match=r"model '.*m'.*quantization.*mxfp4.*not supported"):
        _llm(folder)


def test_missing_expert_weight_is_a_clear_error(tiny: Callable[[str], tuple[Path, Any]], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "m"
    shutil.copytree(tiny("qwen3_moe")[0], folder)
    (st,) = folder.glob("*.safetensors")
    tensors = load_file(str(st))
    del tensors["model.layers.3.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(st), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model '.*m'.*Qwen3MoeForCausalLM.*missing weights "
                                         r"\['layers.3.mlp.experts.5.up_proj.weight'\]"):
        _llm(folder)
