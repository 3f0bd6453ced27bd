"""GGUF models served on their own blocks (``quantization="gguf"``, the default for a .gguf model) against
the same model with the weights dequantized: every format on a tiny random Qwen3 written as a GGUF file,
and the bundled Q4_1 SmolLM2.

The reference is HF's model with the weights the ``gguf`` package dequantizes, so both sides multiply by
identical float32 weights and differ only in summation order: the logprobs agree to ATOL (1e-3, as for
the float models), and the greedy tokens are HF's wherever HF's top two are not a near tie.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvpilot.daemon.engine import LLM
from kvpilot.daemon.engine.models.archs import Qwen3ForCausalLM
from kvpilot.daemon.engine.models.quantization import get_quant_method
from kvpilot.daemon.engine.sampling_params import SamplingParams
from support.gguf_blocks import TYPES, dequantize, quantize
from support.gguf_files import BPE_TOKENS, write_gguf
from support.hf_parity import ATOL, max_logprob_error

# K-quants need rows in multiples of 256 weights: hidden and intermediate sizes are multiples of it
CONFIG = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
          "intermediate_size": 512, "num_hidden_layers": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
          "rope_theta": 1e6, "bos_token_id": 257, "eos_token_id": 259, "pad_token_id": 257,
          "tie_word_embeddings": False}


def _quantizer(hf: Any, qtype: int) -> Callable[[str, np.ndarray], tuple[np.ndarray, int] | None]:
    """Quantizes the linear layers and embeddings, and puts the dequantized weights back into ``hf``."""
    rng = np.random.default_rng(qtype)
    params = dict(hf.named_parameters())

    def quantize_one(name: str, data: np.ndarray) -> tuple[np.ndarray, int] | None:
        if data.ndim != 2:
            return None
        blocks = quantize(data, qtype, rng)
        with torch.no_grad():
            params[name].copy_(torch.from_numpy(dequantize(blocks, qtype)).reshape(data.shape))
        return blocks, qtype

    return quantize_one


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], tuple[Path, Any]]:
    """GGML type -> (the .gguf of a tiny Qwen3 in that type, HF's model on its dequantized weights)."""
    import transformers as tf

    root = tmp_path_factory.mktemp("gguf_quantized")
    mp = pytest.MonkeyPatch()
    mp.setenv("KVPILOT_CACHE_DIR", str(root / "cache"))
    cache: dict[int, tuple[Path, Any]] = {}

    def build(qtype: int) -> tuple[Path, Any]:
        if qtype not in cache:
            torch.manual_seed(0)
            hf = tf.Qwen3ForCausalLM(tf.Qwen3Config(**CONFIG, vocab_size=len(BPE_TOKENS))).float().eval()
            with torch.no_grad():
                for n, p in hf.named_parameters():
                    if "norm" in n:
                        p.add_(torch.randn_like(p) * 0.2)
            path = root / f"tiny-qwen3-{TYPES[qtype]}.gguf"
            write_gguf(path, "qwen3", hf, _quantizer(hf, qtype))
            cache[qtype] = (path, hf)
        return cache[qtype]

    yield build
    mp.undo()


def _prompts(n: int, vocab: int, seed: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(6, vocab, (int(k),), generator=gen).tolist() for k in torch.randint(5, 40, (n,), generator=gen)]


def _greedy(llm: LLM, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("qtype", sorted(TYPES), ids=[TYPES[t] for t in sorted(TYPES)])
def test_each_format_matches_the_dequantized_model(qtype: int, built: Callable[[int], tuple[Path, Any]]) -> None:
    path, hf = built(qtype)
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=24, max_model_len=128)
    loaded = llm.engine.loaded
    assert loaded.quantization == "gguf"
    float_bytes = sum(p.numel() * 4 for p in hf.parameters())
    assert loaded.weight_bytes < 0.45 * float_bytes  # 8-bit blocks at most, beside float32 norms
    worst = max_logprob_error(llm, hf, _prompts(3, len(BPE_TOKENS)))
    print(f"{TYPES[qtype]}: max |logprob - dequantized HF| = {worst:.2e}")
    assert worst < ATOL


@pytest.mark.parametrize("qtype", [3, 12], ids=["Q4_1", "Q4_K"])
def test_bfloat16_greedy_matches_the_dequantized_model(qtype: int, built: Callable[[int], tuple[Path, Any]]) -> None:
    """bfloat16 activations round differently per summation order: 7 of 8 greedy continuations identical."""
    path, _ = built(qtype)
    prompts = _prompts(8, len(BPE_TOKENS), seed=5)
    kw = {"dtype": "bfloat16", "num_kv_blocks": 48, "max_model_len": 128}
    quantized = _greedy(LLM(model=str(path), **kw), prompts, 12)
    dense = _greedy(LLM(model=str(path), quantization="none", **kw), prompts, 12)
    assert sum(a == b for a, b in zip(quantized, dense, strict=True)) >= 7


def test_quantization_none_dequantizes_at_load(built: Callable[[int], tuple[Path, Any]]) -> None:
    path, _ = built(3)
    dense = LLM(model=str(path), dtype="float32", quantization="none", num_kv_blocks=8, max_model_len=64)
    quantized = LLM(model=str(path), dtype="float32", num_kv_blocks=8, max_model_len=64)
    assert dense.engine.loaded.quantization == "none"
    assert dense.engine.loaded.weight_bytes > 4 * quantized.engine.loaded.weight_bytes


def test_bad_blocks_are_named(built: Callable[[int], tuple[Path, Any]], tmp_path: Path) -> None:
    """A row of the wrong size, or blocks without their type, fail the load naming the tensor."""
    from kvpilot.common.gguf_weights import iter_gguf_weights
    from kvpilot.common.model_source import resolve_model_path
    from kvpilot.daemon.engine.model_files import load_config

    path, _ = built(3)
    config = load_config(resolve_model_path(str(path)))

    def model() -> Qwen3ForCausalLM:
        return Qwen3ForCausalLM(config, max_model_len=64, quant_method=get_quant_method("gguf"))

    weights = list(iter_gguf_weights(path, config))
    name = "model.layers.0.mlp.down_proj.qweight"
    cut = [(n, w[:, :-4] if n == name else w) for n, w in weights]
    with pytest.raises(RuntimeError, match=r"down_proj.qweight.*Q4_1 blocks"):
        model().load_weights(cut)
    untyped = [(n, w) for n, w in weights if n != name.replace("qweight", "qweight_type")]
    with pytest.raises(RuntimeError, match=r"down_proj.qweight.*without its qweight_type"):
        model().load_weights(untyped)
    folder = resolve_model_path(str(path))  # the converted folder, without the record of its GGUF
    for f in folder.iterdir():
        if f.name != "kvpilot_source.json":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ValueError, match="quantization 'gguf' runs .gguf models"):
        LLM(model=str(tmp_path), quantization="gguf", num_kv_blocks=8, max_model_len=64)


# ------------------------------------------------------------------------------------ the bundled Q4_1 model

CHAT = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
        "Explain what a CPU cache is.", "Translate 'good morning' to Spanish.", "What is 12 times 7?",
        "Name a famous painter.", "Give me a tip for learning to code."]


def test_builtin_q4_1_runs_on_its_blocks() -> None:
    """SmolLM2's own Q4_1 file (Q8_0 embedding): 7 of 8 greedy continuations as the dequantized model's,
    in at most 30% of the float32 weights' bytes."""
    kw = {"model": "builtin://smollm2-135m", "dtype": "float32", "num_kv_blocks": 64, "max_model_len": 256}
    quantized, dense = LLM(**kw), LLM(quantization="none", **kw)
    assert quantized.engine.loaded.quantization == "gguf"
    assert quantized.engine.loaded.weight_bytes <= 0.3 * dense.engine.loaded.weight_bytes
    params = SamplingParams(temperature=0.0, max_tokens=24)
    messages = [[{"role": "user", "content": c}] for c in CHAT]
    a = [o.outputs[0].token_ids for o in quantized.chat(messages, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in dense.chat(messages, params, use_tqdm=False)]
    assert sum(list(x) == list(y) for x, y in zip(a, b, strict=True)) >= 7
