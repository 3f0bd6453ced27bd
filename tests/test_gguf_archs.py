"""GGUF files of every dense architecture transformers' GGUF loader maps and the engine runs natively (Qwen3,
Gemma 2, Gemma 3, Phi-3): a tiny random HF model is written as llama.cpp's converter writes it (its tensor
names, Gemma's norms stored as 1 + w, Phi-3's LongRoPE factors as tensors, a small BPE or sentencepiece
vocabulary), converted by kvpilot.common.model_source, and checked against the HF model: config fields,
every weight, and the engine's prompt logprobs and greedy tokens."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvpilot.common.model_source import resolve_model_path
from kvpilot.daemon.engine import LLM
from support.gguf_files import BPE_TOKENS, spm_tokens, write_gguf
from support.hf_parity import ATOL, WINDOW, max_logprob_error

gguf = pytest.importorskip("gguf")

COMMON = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
          "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "initializer_range": 0.08}

def _configs() -> dict[str, Callable[[], tuple[Any, type]]]:
    """GGUF arch -> () -> (HF config, HF model class), each with a setting the GGUF must carry over."""
    import transformers as tf

    gemma_vocab = len(spm_tokens("gemma"))
    longrope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
                "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [2.0 + 0.5 * i for i in range(8)]}
    return {
        # head_dim 32 is not hidden/heads (16): it must come from attention.key_length
        "qwen3": lambda: (tf.Qwen3Config(**COMMON, head_dim=32, num_hidden_layers=2, vocab_size=len(BPE_TOKENS),
                                         rope_theta=1e6, bos_token_id=257, eos_token_id=259, pad_token_id=257,
                                         tie_word_embeddings=False), tf.Qwen3ForCausalLM),
        # query_pre_attn_scalar = head_dim, as llama.cpp assumes below 27B; soft-caps unlike HF's defaults
        "gemma2": lambda: (tf.Gemma2Config(**COMMON, head_dim=16, num_hidden_layers=2, vocab_size=gemma_vocab,
                                           sliding_window=WINDOW, query_pre_attn_scalar=16,
                                           attn_logit_softcapping=20.0, final_logit_softcapping=3.0,
                                           pad_token_id=0, eos_token_id=1, bos_token_id=2), tf.Gemma2ForCausalLM),
        # 6 layers: llama.cpp's (and HF's default) pattern, five sliding then one global
        "gemma3": lambda: (tf.Gemma3TextConfig(**COMMON, head_dim=16, num_hidden_layers=6, vocab_size=gemma_vocab,
                                               sliding_window=WINDOW, query_pre_attn_scalar=16,
                                               pad_token_id=0, eos_token_id=1, bos_token_id=2),
                           tf.Gemma3ForCausalLM),
        "phi3": lambda: (tf.Phi3Config(**COMMON, num_hidden_layers=2, vocab_size=len(spm_tokens("phi3")),
                                       sliding_window=WINDOW, original_max_position_embeddings=64,
                                       rope_parameters=dict(longrope), tie_word_embeddings=False,
                                       bos_token_id=1, eos_token_id=3, pad_token_id=3), tf.Phi3ForCausalLM),
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Any]]:
    """arch -> (the .gguf, HF model), each built once; conversions go to a module-private cache."""
    root = tmp_path_factory.mktemp("gguf_archs")
    mp = pytest.MonkeyPatch()
    mp.setenv("KVPILOT_CACHE_DIR", str(root / "cache"))
    cache: dict[str, tuple[Path, Any]] = {}

    def build(arch: str) -> tuple[Path, Any]:
        if arch not in cache:
            cfg, cls = _configs()[arch]()
            torch.manual_seed(0)
            hf = cls(cfg).to(torch.float32).eval()
            with torch.no_grad():  # HF inits norms to 1 (Gemma: 0): random ones make the norm convention count
                for n, p in hf.named_parameters():
                    if "norm" in n:
                        p.add_(torch.randn_like(p) * 0.2)
            path = root / f"tiny-{arch}.gguf"
            write_gguf(path, arch, hf)
            cache[arch] = (path, hf)
        return cache[arch]

    yield build
    mp.undo()


ARCHS = list(_configs())


def _close(a: Any, b: Any) -> bool:
    """Equal, floats to float32 precision (GGUF metadata and the LongRoPE factor tensors are float32)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) or isinstance(b, float):
        return a == pytest.approx(b, rel=1e-6)
    return bool(a == b)


@pytest.mark.parametrize("arch", ARCHS)
def test_conversion_matches_hf(arch: str, built: Callable[[str], tuple[Path, Any]]) -> None:
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    path, hf = built(arch)
    folder = resolve_model_path(str(path))
    cfg, ref = AutoConfig.from_pretrained(folder), hf.config
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "vocab_size", "sliding_window", "query_pre_attn_scalar", "tie_word_embeddings",
                "attn_logit_softcapping", "final_logit_softcapping", "rope_parameters", "layer_types",
                "original_max_position_embeddings"):
        if hasattr(ref, key):
            assert _close(getattr(cfg, key), getattr(ref, key)), (key, getattr(cfg, key), getattr(ref, key))
    got = load_file(str(folder / "model.safetensors"))
    want = {k: v for k, v in hf.state_dict().items() if not (k == "lm_head.weight" and ref.tie_word_embeddings)}
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        # Gemma's norms went through 1 + w and back in float32: within an ulp of 1
        torch.testing.assert_close(got[k], v, rtol=0, atol=2e-7 if "norm" in k else 0, msg=k)

    tok = AutoTokenizer.from_pretrained(folder)
    assert len(tok) == ref.vocab_size
    eos = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
    if arch.startswith("gemma"):
        assert eos == [1, tok.convert_tokens_to_ids("<end_of_turn>")]
        assert "<start_of_turn>" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    elif arch == "phi3":
        assert eos == [3, 4, 5]  # <|endoftext|>, <|assistant|>, <|end|>
    else:
        assert eos == 259


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_on_the_gguf_matches_hf(arch: str, built: Callable[[str], tuple[Path, Any]]) -> None:
    path, hf = built(arch)
    gen = torch.Generator().manual_seed(1)
    vocab = int(hf.config.vocab_size)
    prompts = [torch.randint(6, vocab, (n,), generator=gen).tolist() for n in (21, 13)]  # past the windows
    # max_model_len within Phi-3's original window: the short LongRoPE factors, as HF uses for these lengths
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=16, max_model_len=64)
    worst = max_logprob_error(llm, hf, prompts)
    print(f"{arch}: max |logprob - HF| = {worst:.2e}")
    assert worst < ATOL


def test_unsupported_gguf_architecture_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPILOT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "olmo2")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"m\.gguf.*GGUF architecture 'olmo2' is not supported.*'phi3'.*'qwen3'"):
        resolve_model_path(str(path))
