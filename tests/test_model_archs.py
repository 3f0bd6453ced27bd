"""Every registered dense architecture against HF transformers, in float32: tiny random-weight models built
from transformers' config classes, saved with save_pretrained and loaded through kvpilot's loader.

Prompt logprobs (and the greedy tokens' logprobs) must be within 1e-3 of HF's log-softmax, and greedy
tokens equal HF's argmax except at exact near-ties. Prompts are longer than the sliding windows and span
several KV blocks; each model also runs under chunked prefill and with a prefix-cache hit. Bad configs are
a ValueError naming the model and the field."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvpilot.daemon.engine import LLM
from kvpilot.daemon.engine.models import MODEL_REGISTRY
from support import models_table
from support.hf_parity import ATOL, WINDOW, max_logprob_error, tiny_models, token_prompts

TINY = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "initializer_range": 0.08, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
ALTERNATING = ["sliding_attention", "full_attention"] * 2


def _gemma3_text() -> Any:
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**TINY, num_hidden_layers=4, sliding_window=WINDOW, layer_types=ALTERNATING,
                            query_pre_attn_scalar=24,  # not head_dim: the scale must come from it
                            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                             "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                "rope_theta": 1e6}})


def _configs() -> dict[str, Callable[[], tuple[Any, type]]]:
    """name -> () -> (HF config, HF model class)."""
    import transformers as tf

    longrope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
                "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [2.0 + 0.5 * i for i in range(8)]}
    return {
        "qwen3": lambda: (tf.Qwen3Config(**TINY, num_hidden_layers=2, attention_bias=True, use_sliding_window=True,
                                         sliding_window=WINDOW, max_window_layers=1), tf.Qwen3ForCausalLM),
        "gemma3": lambda: (_gemma3_text(), tf.Gemma3ForCausalLM),
        "gemma3_multimodal": lambda: (tf.Gemma3Config(
            text_config=_gemma3_text().to_dict(), mm_tokens_per_image=4,
            vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                           "num_attention_heads": 2, "image_size": 28, "patch_size": 14}),
            tf.Gemma3ForConditionalGeneration),
        # attention soft-capping off: ops.paged_attention may not take it (see test_gemma2_attention_soft_cap)
        "gemma2": lambda: (tf.Gemma2Config(**TINY, num_hidden_layers=4, sliding_window=WINDOW,
                                           query_pre_attn_scalar=24, attn_logit_softcapping=None,
                                           final_logit_softcapping=3.0), tf.Gemma2ForCausalLM),
        "phi3_short": lambda: (tf.Phi3Config(**{k: v for k, v in TINY.items() if k != "head_dim"}, num_hidden_layers=2,
                                             original_max_position_embeddings=64, rope_parameters=dict(longrope)),
                               tf.Phi3ForCausalLM),
        "olmo2": lambda: (tf.Olmo2Config(**TINY, num_hidden_layers=2, attention_bias=True), tf.Olmo2ForCausalLM),
        # Phi-4-mini's shape: LongRoPE over 3/4 of each head (12 of 16 dims: 6 factors), the rest passed
        "phi3_partial": lambda: (tf.Phi3Config(**{k: v for k, v in TINY.items() if k != "head_dim"},
                                               num_hidden_layers=2, original_max_position_embeddings=64,
                                               rope_parameters={**longrope, "partial_rotary_factor": 0.75,
                                                                "short_factor": longrope["short_factor"][:6],
                                                                "long_factor": longrope["long_factor"][:6]}),
                                 tf.Phi3ForCausalLM),
    }


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Any]]:
    """name -> (saved folder, HF model), each built once per module."""
    return tiny_models(tmp_path_factory.mktemp, _configs, lambda n: n.endswith(".bias") or "norm" in n)


WORST: dict[str, float] = {}


@pytest.mark.parametrize("name", list(_configs()))
def test_matches_hf(name: str, tiny: Callable[[str], tuple[Path, Any]]) -> None:
    folder, hf = tiny(name)
    max_len = 64 if name.startswith("phi3") else None  # LongRoPE's short factors: every position in the window
    prompts = token_prompts()
    llm = LLM(model=str(folder), dtype="float32", num_kv_blocks=64, max_model_len=max_len)
    worst = max_logprob_error(llm, hf, prompts)
    worst = max(worst, max_logprob_error(llm, hf, prompts))  # again: the prompts' blocks are now in the prefix cache
    chunked = LLM(model=str(folder), dtype="float32", num_kv_blocks=64, max_model_len=max_len,
                  max_num_batched_tokens=16, enable_prefix_caching=False)
    worst = max(worst, max_logprob_error(chunked, hf, prompts))
    WORST[name] = worst
    print(f"{name}: max |logprob - HF| = {worst:.2e}")
    assert worst < ATOL, f"{name}: max |logprob - HF| = {worst:.2e}"


def test_phi3_long_rope_beyond_the_original_window(tiny: Callable[[str], tuple[Path, Any]]) -> None:
    """Past original_max_position_embeddings HF switches to the long factors, as a max_model_len past it does."""
    folder, hf = tiny("phi3_short")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (90,), generator=gen).tolist(), torch.randint(3, 256, (70,), generator=gen).tolist()]
    llm = LLM(model=str(folder), dtype="float32", num_kv_blocks=64)
    worst = max_logprob_error(llm, hf, prompts)
    print(f"phi3_long: max |logprob - HF| = {worst:.2e}")
    assert worst < ATOL


def test_gemma2_attention_soft_cap(tiny: Callable[[str], tuple[Path, Any]], tmp_path: Path) -> None:
    """Gemma 2's attention logit soft-capping, which every real Gemma 2 checkpoint sets."""
    folder, hf = tiny("gemma2")
    capped = tmp_path / "capped"
    shutil.copytree(folder, capped)
    _edit_config(capped, attn_logit_softcapping=2.0)
    from transformers import AutoModelForCausalLM

    hf_capped = AutoModelForCausalLM.from_pretrained(str(capped), dtype=torch.float32).eval()
    llm = LLM(model=str(capped), dtype="float32", num_kv_blocks=64)
    assert max_logprob_error(llm, hf_capped, token_prompts()) < ATOL


def test_every_registered_architecture_is_tested() -> None:
    tested = {"Qwen3ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "Gemma2ForCausalLM",
              "Phi3ForCausalLM", "Olmo2ForCausalLM"}
    # the mixture-of-experts architectures are tests/test_model_moe.py's
    tested |= {"MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM"}
    # Llama, Mistral and Qwen2 are tests/test_model_parity.py's
    assert set(MODEL_REGISTRY) == tested | {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}


# ------------------------------------------------------------------ bad configs and checkpoints


def _edit_config(folder: Path, **changes: Any) -> None:
    path = folder / "config.json"
    d = json.loads(path.read_text())
    d.update(changes)
    path.write_text(json.dumps(d))


def _copy(tiny: Callable[[str], tuple[Path, Any]], name: str, dst: Path) -> Path:
    shutil.copytree(tiny(name)[0], dst)
    return dst


def test_unsupported_architecture_is_a_clear_error(tiny: Callable[[str], tuple[Path, Any]], tmp_path: Path) -> None:
    folder = _copy(tiny, "qwen3", tmp_path / "m")
    _edit_config(folder, architectures=["FooForCausalLM"])
    with pytest.raises(ValueError, match=r"model '.*m'.*unsupported architecture \['FooForCausalLM'\]"):
        LLM(model=str(folder), dtype="float32", num_kv_blocks=16)


def test_unknown_rope_type_is_a_clear_error(tiny: Callable[[str], tuple[Path, Any]], tmp_path: Path) -> None:
    folder = _copy(tiny, "qwen3", tmp_path / "m")
    _edit_config(folder, rope_parameters={"rope_type": "warp9", "rope_theta": 10000.0})
    with pytest.raises(ValueError, match=r"model '.*m'.*rope_type.*warp9"):
        LLM(model=str(folder), dtype="float32", num_kv_blocks=16)


def test_unsupported_activation_is_a_clear_error(tiny: Callable[[str], tuple[Path, Any]], tmp_path: Path) -> None:
    folder = _copy(tiny, "olmo2", tmp_path / "m")
    _edit_config(folder, hidden_act="relu")
    with pytest.raises(ValueError, match=r"model '.*m'.*hidden_act='relu'"):
        LLM(model=str(folder), dtype="float32", num_kv_blocks=16)


def test_missing_weight_is_a_clear_error(tiny: Callable[[str], tuple[Path, Any]], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = _copy(tiny, "qwen3", tmp_path / "m")
    (st,) = folder.glob("*.safetensors")
    tensors = load_file(str(st))
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, str(st), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model '.*m'.*missing weights \['layers.1.self_attn.k_norm.weight'\]"):
        LLM(model=str(folder), dtype="float32", num_kv_blocks=16)


def test_readme_lists_the_registry() -> None:
    """README.md's architectures row is tests/support/models_table.py's output (`make readme` rewrites it)."""
    doc = models_table.TARGET.read_text(encoding="utf-8")
    assert models_table.START in doc and models_table.END in doc
    assert models_table.rewrite(doc, dict(MODEL_REGISTRY)) == doc, "README's models row drifted: run `make readme`"
