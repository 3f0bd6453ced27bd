"""model_files: the plain config.json / tokenizer paths give what transformers' auto classes give."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from kvpilot.common.model_source import resolve_model_path
from kvpilot.common.tokenizer import load_tokenizer
from kvpilot.daemon.engine.model_files import load_config, read_plain_config
from kvpilot.daemon.engine.models import get_model_class
from kvpilot.daemon.engine.models.llama import _layer_sliding_window, rope_inv_freq

# every config field the native model, the loader and the engine read
READ_FIELDS = (
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size", "max_position_embeddings",
    "tie_word_embeddings", "eos_token_id", "attention_bias", "mlp_bias",
)


@pytest.fixture(scope="module")
def builtin_dir() -> Path:
    return resolve_model_path("builtin://smollm2-135m")


def _copy_with(src: Path, dst: Path, **changes) -> Path:
    """The model folder's config and tokenizer files (no weights) with config.json changed."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    d = json.loads((src / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    (dst / "config.json").write_text(json.dumps(d))
    return dst


def test_plain_config_matches_autoconfig_on_every_field_read(builtin_dir: Path) -> None:
    plain = read_plain_config(builtin_dir)
    assert plain is not None, "the builtin Llama config should not need AutoConfig"
    auto = AutoConfig.from_pretrained(str(builtin_dir))
    for name in READ_FIELDS:
        assert getattr(plain, name) == getattr(auto, name), name
    for name in ("sliding_window", "use_sliding_window", "layer_types"):
        assert getattr(plain, name, None) == getattr(auto, name, None), name
    assert get_model_class(plain) is get_model_class(auto)
    for i in range(auto.num_hidden_layers):
        assert _layer_sliding_window(plain, i) == _layer_sliding_window(auto, i)
    inv_plain, scale_plain = rope_inv_freq(plain, plain.head_dim, 8192)
    inv_auto, scale_auto = rope_inv_freq(auto, auto.head_dim, 8192)
    torch.testing.assert_close(inv_plain, inv_auto, rtol=0, atol=0)
    assert scale_plain == scale_auto


def test_old_style_llama3_rope_is_read_like_autoconfig(builtin_dir: Path, tmp_path: Path) -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 2048}
    folder = _copy_with(builtin_dir, tmp_path / "m", rope_parameters=None, rope_theta=500000.0, rope_scaling=scaling)
    plain = read_plain_config(folder)
    assert plain is not None
    auto = AutoConfig.from_pretrained(str(folder))
    inv_plain, _ = rope_inv_freq(plain, 64, 8192)
    inv_auto, _ = rope_inv_freq(auto, 64, 8192)
    torch.testing.assert_close(inv_plain, inv_auto, rtol=0, atol=0)
    assert not torch.equal(inv_plain, rope_inv_freq(read_plain_config(builtin_dir), 64, 8192)[0])


@pytest.mark.parametrize("changes", [
    {"rms_norm_eps": None},  # LlamaConfig's default would apply: AutoConfig's to give
    {"num_key_value_heads": None},
    {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}},  # computed by transformers
    {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]},  # other types: their own class defaults
])
def test_configs_that_need_class_defaults_go_through_autoconfig(builtin_dir: Path, tmp_path: Path,
                                                                changes: dict) -> None:
    folder = _copy_with(builtin_dir, tmp_path / "m", **changes)
    assert read_plain_config(folder) is None
    loaded = load_config(folder)
    assert type(loaded) is type(AutoConfig.from_pretrained(str(folder)))
    if "rms_norm_eps" in changes:
        assert loaded.rms_norm_eps == 1e-6  # LlamaConfig's default, which the plain path cannot know


def test_tokenizer_is_the_one_autotokenizer_gives(builtin_dir: Path) -> None:
    fast = load_tokenizer(builtin_dir)
    auto = AutoTokenizer.from_pretrained(str(builtin_dir))
    assert type(fast) is type(auto)
    texts = ["Hello world!", "  héllo\t2+2=4\n\n", "<|im_start|>user\nhi<|im_end|>", ""]
    for text in texts:
        assert fast(text)["input_ids"] == auto(text)["input_ids"]
    ids = auto("Tokens, and more tokens.")["input_ids"]
    assert fast.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)
    assert fast.convert_ids_to_tokens(ids) == auto.convert_ids_to_tokens(ids)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    assert (fast.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    assert (fast.eos_token_id, fast.all_special_ids) == (auto.eos_token_id, auto.all_special_ids)


def test_a_named_tokenizer_class_goes_through_autotokenizer(builtin_dir: Path, tmp_path: Path) -> None:
    folder = _copy_with(builtin_dir, tmp_path / "m")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "GPT2Tokenizer"
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert type(load_tokenizer(folder)) is type(AutoTokenizer.from_pretrained(str(folder)))
    assert type(load_tokenizer(folder)).__name__ == "GPT2Tokenizer"
